/*
 * The two passes Adasum makes over every span of every layer, for float32 and float64 (see _kernels.h):
 *
 *   dots(a, b, n, out)               out = [a·b, a·a, b·b], in float64
 *   scaled_add(dst, a, b, n, ca, cb)  dst = ca·a + cb·b, in float64, rounded once to the type
 *
 * Each reads its inputs once. Products and sums are taken in double (a product of two floats is exact in
 * double), so the dot products need no float64 copy of the data and the combine rounds once.
 *
 * The results do not depend on the instruction set: the AVX-512 and AVX2 loops (chosen where the CPU has
 * them, by select_isa()) and the portable loops add in the same fixed order, and none fuses a multiply with
 * an add where that could change a rounding (the build turns floating-point contraction off), so every rank
 * of a job computes bitwise the same numbers from the same data even when its CPUs differ.
 */
#include "_kernels.h"

#include <string.h>

/*
 * The summation order, fixed for every build, over one span:
 *   1. while at least 32 elements remain, element i goes to lane i mod 32 (32 independent sums keep the
 *      adders and the memory system busy on long spans);
 *   2. the lanes fold to eight: v[j] = (l[j] + l[j + 8]) + (l[j + 16] + l[j + 24]);
 *   3. while at least 8 elements remain, element i goes to v[i mod 8] (short spans stay vectorised);
 *   4. out = (((v0 + v4) + (v1 + v5)) + (v2 + v6)) + (v3 + v7), then the last n mod 8 elements in order.
 * The portable, AVX2 and AVX-512 loops all follow it exactly.
 *
 * For float32 inputs the SIMD loops may fuse a product with its sum (FMA): the product of two floats is
 * exact in double, so a fused multiply-add rounds exactly where the separate multiply and add do.
 */
#define LANES 32
#define DEFINE_PORTABLE(T, NAME)                                                                      \
    static void dots_##NAME##_portable(const T *a, const T *b, Py_ssize_t n, double *out)            \
    {                                                                                               \
        double ab[LANES] = {0}, aa[LANES] = {0}, bb[LANES] = {0};                                   \
        Py_ssize_t i = 0;                                                                           \
        for (int w = LANES; w >= 8; w /= 4) { /* step 1 over 32 lanes, step 3 over 8 */             \
            if (w == 8) {                                                                           \
                fold(ab);                                                                           \
                fold(aa);                                                                           \
                fold(bb);                                                                           \
            }                                                                                       \
            for (; i + w <= n; i += w) {                                                            \
                for (int j = 0; j < w; j++) {                                                       \
                    double x = (double)a[i + j], y = (double)b[i + j];                              \
                    ab[j] += x * y;                                                                 \
                    aa[j] += x * x;                                                                 \
                    bb[j] += y * y;                                                                 \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        finish(ab, aa, bb, out);                                                                    \
        tail_##NAME(a + i, b + i, n - i, out);                                                      \
    }                                                                                               \
                                                                                                    \
    static void scaled_add_##NAME##_portable(T *dst, const T *a, const T *b, Py_ssize_t n, double ca, \
                                             double cb)                                             \
    {                                                                                               \
        for (Py_ssize_t i = 0; i < n; i++)                                                          \
            dst[i] = (T)(ca * (double)a[i] + cb * (double)b[i]);                                    \
    }

/* Step 2 of the order: lanes 0..31 to lanes 0..7. */
static void
fold(double *l)
{
    for (int j = 0; j < 8; j++)
        l[j] = (l[j] + l[j + 8]) + (l[j + 16] + l[j + 24]);
}

/* Step 4 of the order (before the tail): 8 lanes per sum into out[0..2]. */
static void
finish(const double *ab, const double *aa, const double *bb, double *out)
{
    const double *acc[3] = {ab, aa, bb};
    for (int k = 0; k < 3; k++) {
        const double *l = acc[k];
        out[k] = (((l[0] + l[4]) + (l[1] + l[5])) + (l[2] + l[6])) + (l[3] + l[7]);
    }
}

#define DEFINE_TAIL(T, NAME)                                                                          \
    static void tail_##NAME(const T *a, const T *b, Py_ssize_t n, double *out)                       \
    {                                                                                               \
        for (Py_ssize_t i = 0; i < n; i++) {                                                        \
            double x = (double)a[i], y = (double)b[i];                                              \
            out[0] += x * y;                                                                        \
            out[1] += x * x;                                                                        \
            out[2] += y * y;                                                                        \
        }                                                                                           \
    }

DEFINE_TAIL(float, f32)
DEFINE_TAIL(double, f64)
DEFINE_PORTABLE(float, f32)
DEFINE_PORTABLE(double, f64)

dots_fn dots_f32 = (dots_fn)dots_f32_portable, dots_f64 = (dots_fn)dots_f64_portable;
scaled_add_fn scaled_add_f32 = (scaled_add_fn)scaled_add_f32_portable,
              scaled_add_f64 = (scaled_add_fn)scaled_add_f64_portable;
const char *isa = "portable";

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2")))
#define AVX2_FMA_TARGET __attribute__((target("avx2,fma")))

/*
 * The dot products with W doubles per register, for AVX2 (W = 4) and AVX-512 (W = 8). Step 1: lanes
 * W·m .. W·m + W - 1 of a sum in register m (m < 32 / W); steps 2-3: lanes 0..7 in registers 0 .. 8 / W - 1.
 */
/* Elements i + W·m .. i + W·m + W - 1 into register m of each sum (inside DEFINE_DOTS_SIMD). */
#define DOTS_STEP(VD, W, LOAD, ACC, m)                                                                \
    do {                                                                                            \
        VD x = LOAD(a + i + (W) * (m)), y = LOAD(b + i + (W) * (m));                                \
        ab[m] = ACC(x, y, ab[m]);                                                                   \
        aa[m] = ACC(x, x, aa[m]);                                                                   \
        bb[m] = ACC(y, y, bb[m]);                                                                   \
    } while (0)

#define DEFINE_DOTS_SIMD(ATTR, SUFFIX, T, NAME, VD, W, ZERO, ADD, STORE, LOAD, ACC)                  \
    ATTR static void dots_##NAME##_##SUFFIX(const T *a, const T *b, Py_ssize_t n, double *out)        \
    {                                                                                               \
        enum { R = LANES / (W), V = 8 / (W) };                                                      \
        VD ab[R], aa[R], bb[R];                                                                     \
        for (int m = 0; m < R; m++)                                                                 \
            ab[m] = aa[m] = bb[m] = ZERO();                                                         \
        Py_ssize_t i = 0;                                                                           \
        for (; i + LANES <= n; i += LANES) {                                                        \
            for (int m = 0; m < R; m++)                                                             \
                DOTS_STEP(VD, W, LOAD, ACC, m);                                                     \
        }                                                                                           \
        VD *sums[3] = {ab, aa, bb};                                                                 \
        for (int k = 0; k < 3; k++) {                                                               \
            VD *l = sums[k];                                                                        \
            for (int t = 0; t < V; t++)                                                             \
                l[t] = ADD(ADD(l[t], l[t + V]), ADD(l[t + 2 * V], l[t + 3 * V]));                   \
        }                                                                                           \
        for (; i + 8 <= n; i += 8) {                                                                \
            for (int m = 0; m < V; m++)                                                             \
                DOTS_STEP(VD, W, LOAD, ACC, m);                                                     \
        }                                                                                           \
        double l_ab[8], l_aa[8], l_bb[8];                                                           \
        for (int m = 0; m < V; m++) {                                                               \
            STORE(l_ab + (W) * m, ab[m]);                                                           \
            STORE(l_aa + (W) * m, aa[m]);                                                           \
            STORE(l_bb + (W) * m, bb[m]);                                                           \
        }                                                                                           \
        finish(l_ab, l_aa, l_bb, out);                                                              \
        tail_##NAME(a + i, b + i, n - i, out);                                                      \
    }

#define AVX2_F32(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define AVX2_MUL_ADD(x, y, acc) _mm256_add_pd(acc, _mm256_mul_pd(x, y))
#define AVX2_FMA(x, y, acc) _mm256_fmadd_pd(x, y, acc)
#define DEFINE_DOTS_AVX2(ATTR, SUFFIX, T, NAME, LOAD, ACC)                                            \
    DEFINE_DOTS_SIMD(ATTR, SUFFIX, T, NAME, __m256d, 4, _mm256_setzero_pd, _mm256_add_pd, _mm256_storeu_pd, \
                     LOAD, ACC)
DEFINE_DOTS_AVX2(AVX2, avx2, float, f32, AVX2_F32, AVX2_MUL_ADD)
DEFINE_DOTS_AVX2(AVX2_FMA_TARGET, avx2fma, float, f32, AVX2_F32, AVX2_FMA)
DEFINE_DOTS_AVX2(AVX2, avx2, double, f64, _mm256_loadu_pd, AVX2_MUL_ADD)

/*
 * dst = ca·a + cb·b with W doubles per register: the same loop for AVX2 (W = 4) and AVX-512 (W = 8), over
 * float32 (widened on load, rounded once on store) and float64; the tail goes to the portable loop.
 */
#define DEFINE_SCALED_ADD(ATTR, ISA, W, VD, SET1, CVT_UP, LOAD_F, CVT_DOWN, STORE_F, LOAD_D, STORE_D, MUL, ADD) \
    ATTR static void scaled_add_f32_##ISA(float *dst, const float *a, const float *b, Py_ssize_t n, double ca, \
                                          double cb)                                                     \
    {                                                                                                    \
        VD p = SET1(ca), q = SET1(cb);                                                                   \
        Py_ssize_t i = 0;                                                                                \
        for (; i + W <= n; i += W) {                                                                     \
            VD x = CVT_UP(LOAD_F(a + i)), y = CVT_UP(LOAD_F(b + i));                                     \
            STORE_F(dst + i, CVT_DOWN(ADD(MUL(p, x), MUL(q, y))));                                       \
        }                                                                                                \
        scaled_add_f32_portable(dst + i, a + i, b + i, n - i, ca, cb);                                   \
    }                                                                                                    \
                                                                                                         \
    ATTR static void scaled_add_f64_##ISA(double *dst, const double *a, const double *b, Py_ssize_t n,     \
                                          double ca, double cb)                                          \
    {                                                                                                    \
        VD p = SET1(ca), q = SET1(cb);                                                                   \
        Py_ssize_t i = 0;                                                                                \
        for (; i + W <= n; i += W) {                                                                     \
            VD x = LOAD_D(a + i), y = LOAD_D(b + i);                                                     \
            STORE_D(dst + i, ADD(MUL(p, x), MUL(q, y)));                                                 \
        }                                                                                                \
        scaled_add_f64_portable(dst + i, a + i, b + i, n - i, ca, cb);                                   \
    }

DEFINE_SCALED_ADD(AVX2, avx2, 4, __m256d, _mm256_set1_pd, _mm256_cvtps_pd, _mm_loadu_ps, _mm256_cvtpd_ps,
                  _mm_storeu_ps, _mm256_loadu_pd, _mm256_storeu_pd, _mm256_mul_pd, _mm256_add_pd)

/* AVX-512F: the same loops, 8 doubles per register. */
#define AVX512 __attribute__((target("avx512f")))

#define LOAD_F32_AS_F64_512(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#define AVX512_MUL_ADD(x, y, acc) _mm512_add_pd(acc, _mm512_mul_pd(x, y))
#define DEFINE_DOTS_AVX512(T, NAME, LOAD, ACC)                                                        \
    DEFINE_DOTS_SIMD(AVX512, avx512, T, NAME, __m512d, 8, _mm512_setzero_pd, _mm512_add_pd, _mm512_storeu_pd, \
                     LOAD, ACC)
DEFINE_DOTS_AVX512(float, f32, LOAD_F32_AS_F64_512, _mm512_fmadd_pd)  /* exact products: FMA gives the same bits */
DEFINE_DOTS_AVX512(double, f64, _mm512_loadu_pd, AVX512_MUL_ADD)
DEFINE_SCALED_ADD(AVX512, avx512, 8, __m512d, _mm512_set1_pd, _mm512_cvtps_pd, _mm256_loadu_ps, _mm512_cvtpd_ps,
                  _mm256_storeu_ps, _mm512_loadu_pd, _mm512_storeu_pd, _mm512_mul_pd, _mm512_add_pd)
#endif

/* Picks the widest loops the CPU has (AVX-512F, then AVX2), capped at `cap`: "portable", "avx2" or "auto"
 * (the setting kernels_isa; all of them give the same bits). */
void
select_isa(const char *cap)
{
    dots_f32 = (dots_fn)dots_f32_portable;
    dots_f64 = (dots_fn)dots_f64_portable;
    scaled_add_f32 = (scaled_add_fn)scaled_add_f32_portable;
    scaled_add_f64 = (scaled_add_fn)scaled_add_f64_portable;
    isa = "portable";
#ifdef HAVE_AVX2_PATH
    if (strcmp(cap, "portable") == 0)
        return;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && strcmp(cap, "avx2") != 0) {
        dots_f32 = (dots_fn)dots_f32_avx512;
        dots_f64 = (dots_fn)dots_f64_avx512;
        scaled_add_f32 = (scaled_add_fn)scaled_add_f32_avx512;
        scaled_add_f64 = (scaled_add_fn)scaled_add_f64_avx512;
        isa = "avx512f";
    } else if (__builtin_cpu_supports("avx2")) {
        dots_f32 = __builtin_cpu_supports("fma") ? (dots_fn)dots_f32_avx2fma : (dots_fn)dots_f32_avx2;
        dots_f64 = (dots_fn)dots_f64_avx2;
        scaled_add_f32 = (scaled_add_fn)scaled_add_f32_avx2;
        scaled_add_f64 = (scaled_add_fn)scaled_add_f64_avx2;
        isa = "avx2";
    }
#endif
}
