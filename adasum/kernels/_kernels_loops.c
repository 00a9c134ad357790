/*
 * The two passes Adasum makes over every span of every layer, for float32, float64, float16 and bfloat16
 * (see _kernels.h):
 *
 *   dots(a, b, n, out)               out = [a·b, a·a, b·b], in float64
 *   scaled_add(dst, a, b, n, ca, cb)  dst = ca·a + cb·b, in float64, rounded once to the type
 *
 * Each reads its inputs once. Products and sums are taken in double (a product of two floats is exact in
 * double), so the dot products need no float64 copy of the data and the combine rounds once. 16-bit
 * elements are widened to double in registers as they are read (exactly; F16C for float16, a shift of the
 * bits for bfloat16) and the combine is rounded once from double to the 16-bit type, to nearest, ties to
 * even (NaN stays NaN), so no wider copy of a 16-bit span is ever made.
 *
 * The results do not depend on the instruction set: the AVX-512 and AVX2 loops (chosen where the CPU has
 * them, by select_isa()) and the portable loops add in the same fixed order, and none fuses a multiply with
 * an add where that could change a rounding (the build turns floating-point contraction off), so every rank
 * of a job computes bitwise the same numbers from the same data even when its CPUs differ.
 */
#include "_kernels.h"

#include <math.h>
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
#define DEFINE_PORTABLE(T, NAME, WIDEN, NARROW)                                                       \
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
                    double x = WIDEN(a[i + j]), y = WIDEN(b[i + j]);                                \
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
            dst[i] = NARROW(ca * WIDEN(a[i]) + cb * WIDEN(b[i]));                                   \
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

#define DEFINE_TAIL(T, NAME, WIDEN)                                                                   \
    static void tail_##NAME(const T *a, const T *b, Py_ssize_t n, double *out)                       \
    {                                                                                               \
        for (Py_ssize_t i = 0; i < n; i++) {                                                        \
            double x = WIDEN(a[i]), y = WIDEN(b[i]);                                                \
            out[0] += x * y;                                                                        \
            out[1] += x * x;                                                                        \
            out[2] += y * y;                                                                        \
        }                                                                                           \
    }

/*
 * The 16-bit types, one element at a time (the portable loops, and the tails of the SIMD loops). Widening is
 * exact. Narrowing rounds the double once to the 16-bit type: first to float32 rounding to odd (truncate,
 * then set the last bit if anything was cut off), then from float32 to nearest, ties to even; float32 holds
 * more than two bits beyond either 16-bit type's precision over its whole range, so the two steps give the
 * double's correctly rounded value (the SIMD loops narrow the same way, hence the same bits). A NaN stays a
 * NaN with its leading payload bits, quiet, as F16C's conversion leaves it.
 */
#define AS_DOUBLE(x) ((double)(x))
#define AS_FLOAT(x) ((float)(x))
#define AS_SELF(x) (x)

static inline double
f16_to_f64(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) { /* zero or subnormal: m · 2^-24 */
        double v = (double)m * 0x1p-24;
        return sign ? -v : v;
    }
    bits = sign | (e == 0x1f ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &bits, 4);
    return (double)f;
}

static inline double
bf16_to_f64(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return (double)f;
}

/* The bits of x rounded to float32 to odd. */
static inline uint32_t
f64_to_f32_odd(double x)
{
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    double back = (double)f;
    if (back != x && x == x) {
        if (fabs(back) > fabs(x)) /* rounded away from zero: one step back towards it */
            u -= 1;
        u |= 1;
    }
    return u;
}

/* float32 bits to float16 bits, to nearest, ties to even (what F16C's vcvtps2ph computes). */
static inline uint16_t
f32_to_f16(uint32_t u)
{
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return sign | 0x7e00 | ((a >> 13) & 0x3ff);
    if (a >= 0x477ff000u) /* 65520 and beyond: infinity */
        return sign | 0x7c00;
    if (a >= 0x38800000u) { /* a normal float16 (2^-14 and above) */
        uint32_t r = a - (112u << 23);
        return sign | (uint16_t)((r + 0xfff + ((r >> 13) & 1)) >> 13);
    }
    uint32_t e = a >> 23;
    if (e < 102) /* below 2^-25: zero */
        return sign;
    uint32_t m = (a & 0x7fffff) | 0x800000, s = 126 - e; /* subnormal: m · 2^(e - 150) in units of 2^-24 */
    uint32_t q = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1)))
        q++;
    return sign | (uint16_t)q;
}

/* float32 bits to bfloat16 bits, to nearest, ties to even; a NaN stays a quiet NaN. */
static inline uint16_t
f32_to_bf16(uint32_t u)
{
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline uint16_t
f64_to_f16(double x)
{
    return f32_to_f16(f64_to_f32_odd(x));
}

static inline uint16_t
f64_to_bf16(double x)
{
    return f32_to_bf16(f64_to_f32_odd(x));
}

DEFINE_TAIL(float, f32, AS_DOUBLE)
DEFINE_TAIL(double, f64, AS_DOUBLE)
DEFINE_TAIL(uint16_t, f16, f16_to_f64)
DEFINE_TAIL(uint16_t, bf16, bf16_to_f64)
DEFINE_PORTABLE(float, f32, AS_DOUBLE, AS_FLOAT)
DEFINE_PORTABLE(double, f64, AS_DOUBLE, AS_SELF)
DEFINE_PORTABLE(uint16_t, f16, f16_to_f64, f64_to_f16)
DEFINE_PORTABLE(uint16_t, bf16, bf16_to_f64, f64_to_bf16)

dots_fn dots_of[T_COUNT];
scaled_add_fn scaled_add_of[T_COUNT];
const char *isa = "portable";

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2")))
#define AVX2_FMA_TARGET __attribute__((target("avx2,fma")))
#define AVX2_F16C __attribute__((target("avx2,f16c")))
#define AVX2_FMA_F16C __attribute__((target("avx2,fma,f16c")))

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

/* Four elements widened to double: float32, float16 (F16C) and bfloat16 (its bits shifted into a float32). */
#define AVX2_F32(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define LOAD4_16(p) _mm_loadl_epi64((const __m128i *)(p))
#define AVX2_F16(p) _mm256_cvtps_pd(_mm_cvtph_ps(LOAD4_16(p)))
#define AVX2_BF16(p) _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(LOAD4_16(p)), 16)))
#define AVX2_MUL_ADD(x, y, acc) _mm256_add_pd(acc, _mm256_mul_pd(x, y))
#define AVX2_FMA(x, y, acc) _mm256_fmadd_pd(x, y, acc)
#define DEFINE_DOTS_AVX2(ATTR, SUFFIX, T, NAME, LOAD, ACC)                                            \
    DEFINE_DOTS_SIMD(ATTR, SUFFIX, T, NAME, __m256d, 4, _mm256_setzero_pd, _mm256_add_pd, _mm256_storeu_pd, \
                     LOAD, ACC)
DEFINE_DOTS_AVX2(AVX2, avx2, float, f32, AVX2_F32, AVX2_MUL_ADD)
DEFINE_DOTS_AVX2(AVX2_FMA_TARGET, avx2fma, float, f32, AVX2_F32, AVX2_FMA)
DEFINE_DOTS_AVX2(AVX2, avx2, double, f64, _mm256_loadu_pd, AVX2_MUL_ADD)
/* products of 16-bit values are exact in double too: FMA gives the same bits */
DEFINE_DOTS_AVX2(AVX2_F16C, avx2, uint16_t, f16, AVX2_F16, AVX2_MUL_ADD)
DEFINE_DOTS_AVX2(AVX2_FMA_F16C, avx2fma, uint16_t, f16, AVX2_F16, AVX2_FMA)
DEFINE_DOTS_AVX2(AVX2, avx2, uint16_t, bf16, AVX2_BF16, AVX2_MUL_ADD)
DEFINE_DOTS_AVX2(AVX2_FMA_TARGET, avx2fma, uint16_t, bf16, AVX2_BF16, AVX2_FMA)

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

/*
 * The AVX2 float16 combine rounds each double x to float32 to odd on its bits (keeps the first 23 bits of the
 * fraction, and sets the last of them if any of the 29 cut off was set), converts that to float32 (exactly),
 * and narrows the float32 with F16C, to nearest, ties to even: the portable loop's two steps, so the same
 * bits, with no branch. Cutting the bits is float32's rounding to odd wherever x lies in float32's normal
 * range; above it the conversion gives an infinity, as float16's rounding does, and below it (under 2^-126)
 * float16's value is a zero of x's sign either way.
 */
/* Eight float16 elements as two registers of four doubles, through F16C. */
#define WIDEN8_F16(p, lo, hi)                                                                         \
    do {                                                                                            \
        __m256 f_ = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)));                         \
        lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f_));                                           \
        hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f_, 1));                                         \
    } while (0)
#define AVX2_COMBINE8(WIDEN, x0, x1)                                                                  \
    do {                                                                                            \
        __m256d a0_, a1_, b0_, b1_;                                                                 \
        WIDEN(a + i, a0_, a1_);                                                                     \
        WIDEN(b + i, b0_, b1_);                                                                     \
        x0 = _mm256_add_pd(_mm256_mul_pd(p, a0_), _mm256_mul_pd(q, b0_));                           \
        x1 = _mm256_add_pd(_mm256_mul_pd(p, a1_), _mm256_mul_pd(q, b1_));                           \
    } while (0)

/* Four doubles cut to float32's precision, rounding to odd (exact in float32 in its normal range). */
AVX2 static inline __m256d
cut_to_odd(__m256d x)
{
    const __m256i low = _mm256_set1_epi64x((1LL << 29) - 1), last = _mm256_set1_epi64x(1LL << 29);
    __m256i u = _mm256_castpd_si256(x);
    __m256i exact = _mm256_cmpeq_epi64(_mm256_and_si256(u, low), _mm256_setzero_si256());
    return _mm256_castsi256_pd(_mm256_or_si256(_mm256_andnot_si256(low, u), _mm256_andnot_si256(exact, last)));
}

#define NARROW8_F16_AVX2(p, y)                                                                        \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
/* One float16 combine loop: 8 elements a round, widened to two registers of doubles, combined, cut to odd,
 * converted to float32 and narrowed by F16C; the tail by the portable loop. dst may be a or b: a round reads
 * its eight elements of a and b before it writes dst's. */
AVX2_F16C static void
scaled_add_f16_avx2(uint16_t *dst, const uint16_t *a, const uint16_t *b, Py_ssize_t n, double ca, double cb)
{
    __m256d p = _mm256_set1_pd(ca), q = _mm256_set1_pd(cb);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d x0, x1;
        AVX2_COMBINE8(WIDEN8_F16, x0, x1);
        __m256 y = _mm256_set_m128(_mm256_cvtpd_ps(cut_to_odd(x1)), _mm256_cvtpd_ps(cut_to_odd(x0)));
        NARROW8_F16_AVX2(dst + i, y);
    }
    scaled_add_f16_portable(dst + i, a + i, b + i, n - i, ca, cb);
}

/*
 * ROUND16 rounds each double x to the 16-bit type's grid in double arithmetic: with 2^e
 * the power of two of x's binade, clamped to the type's normal range [2^emin, 2^emax], and C = 2^(e + 52 - p)
 * carrying x's sign (p: the type's significant bits after the first, 10 for float16, 7 for bfloat16),
 * (x + C) - C is x rounded to a multiple of 2^(e - p), to nearest, ties to even: the type's own rounding,
 * subnormals included, as a double the type holds exactly (or one beyond its largest, which the conversion
 * takes to infinity). The sign of x goes back on a zero; infinities and NaN pass through unchanged. The
 * conversions to float32 and on to the type are then exact: the same bits as the portable loop's rounding.
 */
/*
 * The AVX2 bfloat16 combine works on the even and the odd elements of a round apart, so that no element
 * changes its place in a register: a bfloat16 in the upper half of a 32-bit lane is that lane's float32 (the
 * odd element, masked), the one in the lower half shifted up is the even element's. Each double is rounded by
 * ROUND16, so its float32 is exact and its upper half is the bfloat16; the two results go back to the two
 * halves of the lanes. No branch: subnormals, infinities and NaN take the same instructions.
 */
#define ROUND16_AVX2(x)                                                                               \
    do {                                                                                            \
        __m256d s_ = _mm256_and_pd(x, sign), e_ = _mm256_and_pd(x, expo);                            \
        __m256d c_ = _mm256_or_pd(_mm256_mul_pd(_mm256_min_pd(_mm256_max_pd(e_, lo), hi), scale), s_); \
        x = _mm256_or_pd(_mm256_sub_pd(_mm256_add_pd(x, c_), c_), s_);                               \
    } while (0)
AVX2 static void
scaled_add_bf16_avx2(uint16_t *dst, const uint16_t *a, const uint16_t *b, Py_ssize_t n, double ca, double cb)
{
    __m256d p = _mm256_set1_pd(ca), q = _mm256_set1_pd(cb);
    const __m256d sign = _mm256_set1_pd(-0.0), expo = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7ff0000000000000LL));
    const __m256d lo = _mm256_set1_pd(0x1p-126), hi = _mm256_set1_pd(0x1p127), scale = _mm256_set1_pd(0x1p45);
    const __m128i high = _mm_set1_epi32((int)0xffff0000u);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i va = _mm_loadu_si128((const __m128i *)(a + i)), vb = _mm_loadu_si128((const __m128i *)(b + i));
        __m256d x_even = _mm256_add_pd(_mm256_mul_pd(p, _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(va, 16)))),
                                       _mm256_mul_pd(q, _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(vb, 16)))));
        __m256d x_odd = _mm256_add_pd(_mm256_mul_pd(p, _mm256_cvtps_pd(_mm_castsi128_ps(_mm_and_si128(va, high)))),
                                      _mm256_mul_pd(q, _mm256_cvtps_pd(_mm_castsi128_ps(_mm_and_si128(vb, high)))));
        ROUND16_AVX2(x_even);
        ROUND16_AVX2(x_odd);
        __m128i ye = _mm_castps_si128(_mm256_cvtpd_ps(x_even)), yo = _mm_castps_si128(_mm256_cvtpd_ps(x_odd));
        _mm_storeu_si128((__m128i *)(dst + i), _mm_or_si128(_mm_srli_epi32(ye, 16), _mm_and_si128(yo, high)));
    }
    scaled_add_bf16_portable(dst + i, a + i, b + i, n - i, ca, cb);
}


/* AVX-512F: the same loops, 8 doubles per register; the 16-bit combine rounds by ROUND16 for both types. */
#define AVX512 __attribute__((target("avx512f")))
#define AVX512_16 __attribute__((target("avx512f,avx2,f16c")))

#define LOAD_F32_AS_F64_512(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#define LOAD8_16(p) _mm_loadu_si128((const __m128i *)(p))
#define LOAD_F16_AS_F64_512(p) _mm512_cvtps_pd(_mm256_cvtph_ps(LOAD8_16(p)))
#define LOAD_BF16_AS_F64_512(p) \
    _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LOAD8_16(p)), 16)))
#define AVX512_MUL_ADD(x, y, acc) _mm512_add_pd(acc, _mm512_mul_pd(x, y))
#define DEFINE_DOTS_AVX512(ATTR, T, NAME, LOAD, ACC)                                                  \
    DEFINE_DOTS_SIMD(ATTR, avx512, T, NAME, __m512d, 8, _mm512_setzero_pd, _mm512_add_pd, _mm512_storeu_pd, \
                     LOAD, ACC)
DEFINE_DOTS_AVX512(AVX512, float, f32, LOAD_F32_AS_F64_512, _mm512_fmadd_pd)  /* exact products: FMA gives the same bits */
DEFINE_DOTS_AVX512(AVX512, double, f64, _mm512_loadu_pd, AVX512_MUL_ADD)
DEFINE_DOTS_AVX512(AVX512_16, uint16_t, f16, LOAD_F16_AS_F64_512, _mm512_fmadd_pd)
DEFINE_DOTS_AVX512(AVX512_16, uint16_t, bf16, LOAD_BF16_AS_F64_512, _mm512_fmadd_pd)
DEFINE_SCALED_ADD(AVX512, avx512, 8, __m512d, _mm512_set1_pd, _mm512_cvtps_pd, _mm256_loadu_ps, _mm512_cvtpd_ps,
                  _mm256_storeu_ps, _mm512_loadu_pd, _mm512_storeu_pd, _mm512_mul_pd, _mm512_add_pd)

#define ROUND16_AVX512(x, lo, hi, scale, sign)                                                        \
    do {                                                                                            \
        __m512d s_ = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(x), sign));            \
        __m512d e_ = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(x), expo));            \
        __m512d c_ = _mm512_mul_pd(_mm512_min_pd(_mm512_max_pd(e_, lo), hi), scale);                \
        c_ = _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(c_), _mm512_castpd_si512(s_))); \
        x = _mm512_sub_pd(_mm512_add_pd(x, c_), c_);                                                \
        x = _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(x), _mm512_castpd_si512(s_)));   \
    } while (0)
#define AVX512_ROUND16_SETUP(EMIN, EMAX, P)                                                           \
    __m512d p = _mm512_set1_pd(ca), q = _mm512_set1_pd(cb);                                         \
    __m512i sign = _mm512_set1_epi64((long long)0x8000000000000000ULL), expo = _mm512_set1_epi64(0x7ff0000000000000LL); \
    __m512d lo = _mm512_set1_pd(EMIN), hi = _mm512_set1_pd(EMAX), scale = _mm512_set1_pd(P)
#define AVX512_COMBINE8(LOAD) _mm512_add_pd(_mm512_mul_pd(p, LOAD(a + i)), _mm512_mul_pd(q, LOAD(b + i)))

/* The AVX-512 16-bit combine loop, 8 doubles per register: one register a round, rounded by ROUND16_AVX512. */
#define DEFINE_SCALED_ADD16_AVX512(NAME, EMIN, EMAX, P, LOAD, STORE8)                                    \
    AVX512_16 static void scaled_add_##NAME##_avx512(uint16_t *dst, const uint16_t *a, const uint16_t *b, \
                                                     Py_ssize_t n, double ca, double cb)              \
    {                                                                                               \
        AVX512_ROUND16_SETUP(EMIN, EMAX, P);                                                        \
        Py_ssize_t i = 0;                                                                           \
        for (; i + 8 <= n; i += 8) {                                                                \
            __m512d x = AVX512_COMBINE8(LOAD);                                                      \
            ROUND16_AVX512(x, lo, hi, scale, sign);                                                 \
            STORE8(dst + i, x);                                                                     \
        }                                                                                           \
        scaled_add_##NAME##_portable(dst + i, a + i, b + i, n - i, ca, cb);                         \
    }
#define STORE8_F16_AVX512(p, x)                                                                       \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(_mm512_cvtpd_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define STORE8_BF16_AVX512(p, x)                                                                      \
    do {                                                                                            \
        __m256i u_ = _mm256_srli_epi32(_mm256_castps_si256(_mm512_cvtpd_ps(x)), 16);                 \
        _mm_storeu_si128((__m128i *)(p), _mm_packus_epi32(_mm256_castsi256_si128(u_), _mm256_extracti128_si256(u_, 1))); \
    } while (0)
DEFINE_SCALED_ADD16_AVX512(f16, 0x1p-14, 0x1p15, 0x1p42, LOAD_F16_AS_F64_512, STORE8_F16_AVX512)
DEFINE_SCALED_ADD16_AVX512(bf16, 0x1p-126, 0x1p127, 0x1p45, LOAD_BF16_AS_F64_512, STORE8_BF16_AVX512)
#endif

/* Picks the widest loops the CPU has (AVX-512F, then AVX2; F16C for float16), capped at `cap`: "portable",
 * "avx2" or "auto" (the setting kernels_isa; all of them give the same bits). */
#define USE_LOOPS(T, NAME, DOTS, ADD)                                                                 \
    do {                                                                                            \
        dots_of[T] = (dots_fn)dots_##NAME##_##DOTS;                                                 \
        scaled_add_of[T] = (scaled_add_fn)scaled_add_##NAME##_##ADD;                                \
    } while (0)

void
select_isa(const char *cap)
{
    USE_LOOPS(T_F32, f32, portable, portable);
    USE_LOOPS(T_F64, f64, portable, portable);
    USE_LOOPS(T_F16, f16, portable, portable);
    USE_LOOPS(T_BF16, bf16, portable, portable);
    isa = "portable";
#ifdef HAVE_AVX2_PATH
    if (strcmp(cap, "portable") == 0)
        return;
    __builtin_cpu_init();
    int f16c = __builtin_cpu_supports("f16c");
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && f16c && strcmp(cap, "avx2") != 0) {
        USE_LOOPS(T_F32, f32, avx512, avx512);
        USE_LOOPS(T_F64, f64, avx512, avx512);
        USE_LOOPS(T_F16, f16, avx512, avx512);
        USE_LOOPS(T_BF16, bf16, avx512, avx512);
        isa = "avx512f";
    } else if (__builtin_cpu_supports("avx2")) {
        int fma = __builtin_cpu_supports("fma");
        if (fma) {
            USE_LOOPS(T_F32, f32, avx2fma, avx2);
            USE_LOOPS(T_BF16, bf16, avx2fma, avx2);
        } else {
            USE_LOOPS(T_F32, f32, avx2, avx2);
            USE_LOOPS(T_BF16, bf16, avx2, avx2);
        }
        USE_LOOPS(T_F64, f64, avx2, avx2);
        if (f16c && fma)
            USE_LOOPS(T_F16, f16, avx2fma, avx2);
        else if (f16c)
            USE_LOOPS(T_F16, f16, avx2, avx2);
        isa = "avx2";
    }
#endif
}

/*
 * sum_rows16(rows, out, type, divisor) -> whether a NaN came out: the sum of the rows of `rows` (a
 * C-contiguous 2-D uint16 array: one row per rank, in rank order, each the bits of float16 or bfloat16
 * values; `type` 0 float16, 1 bfloat16) added in float32 in row order, divided by `divisor` (1: not),
 * rounded once to the 16-bit type (to nearest, ties to even) into `out` (n uint16). The arithmetic of
 * adasum/rule/sum16.py, bit for bit on every value but NaN, in one pass over blocks that stay in cache;
 * where a NaN comes out the caller computes the whole there (its NaN bits are the rule's).
 */
#define ROWS16_BLOCK 2048

static inline float
bf16_bits_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* bfloat16: branch-free loops over a block, which compilers vectorise (twice: portable and AVX2). */
#define DEFINE_SUM_ROWS_BF16(NAME, ATTR)                                                                    \
    static int ATTR NAME(const uint16_t *rows, Py_ssize_t size, Py_ssize_t n, uint16_t *out, float divisor) \
    {                                                                                                       \
        float acc[ROWS16_BLOCK];                                                                            \
        uint32_t bad = 0;                                                                                   \
        for (Py_ssize_t lo = 0; lo < n; lo += ROWS16_BLOCK) {                                               \
            Py_ssize_t m = n - lo < ROWS16_BLOCK ? n - lo : ROWS16_BLOCK;                                   \
            for (Py_ssize_t i = 0; i < m; i++)                                                              \
                acc[i] = bf16_bits_to_f32(rows[lo + i]);                                                    \
            for (Py_ssize_t j = 1; j < size; j++) {                                                         \
                const uint16_t *r = rows + j * n + lo;                                                      \
                for (Py_ssize_t i = 0; i < m; i++)                                                          \
                    acc[i] += bf16_bits_to_f32(r[i]);                                                       \
            }                                                                                               \
            if (divisor != 1.0f)                                                                            \
                for (Py_ssize_t i = 0; i < m; i++)                                                          \
                    acc[i] /= divisor;                                                                      \
            for (Py_ssize_t i = 0; i < m; i++) {                                                            \
                uint32_t u;                                                                                 \
                memcpy(&u, &acc[i], 4);                                                                     \
                bad |= (u & 0x7fffffffu) > 0x7f800000u; /* a NaN */                                         \
                out[lo + i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                           \
            }                                                                                               \
        }                                                                                                   \
        return bad != 0;                                                                                    \
    }

DEFINE_SUM_ROWS_BF16(sum_rows_bf16_portable, )

/* float16, one value at a time, elements [lo, hi) (the F16C path below is the fast one). */
static int
sum_rows_f16_portable(const uint16_t *rows, Py_ssize_t size, Py_ssize_t n, uint16_t *out, float divisor,
                      Py_ssize_t lo, Py_ssize_t hi)
{
    int nan = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        float a = (float)f16_to_f64(rows[i]); /* exact */
        for (Py_ssize_t j = 1; j < size; j++)
            a += (float)f16_to_f64(rows[j * n + i]);
        if (divisor != 1.0f)
            a /= divisor;
        uint32_t u;
        memcpy(&u, &a, 4);
        nan |= a != a;
        out[i] = f32_to_f16(u);
    }
    return nan;
}

#ifdef HAVE_AVX2_PATH
DEFINE_SUM_ROWS_BF16(sum_rows_bf16_avx2, AVX2)

/* float16 through F16C's exact widening and its narrowing to nearest, ties to even (f32_to_f16's rule). */
static int AVX2_F16C
sum_rows16_f16c(const uint16_t *rows, Py_ssize_t size, Py_ssize_t n, uint16_t *out, float divisor)
{
    int nan = 0;
    __m256 d = _mm256_set1_ps(divisor);
    for (Py_ssize_t lo = 0; lo < n; lo += ROWS16_BLOCK) {
        Py_ssize_t m = n - lo < ROWS16_BLOCK ? n - lo : ROWS16_BLOCK, v8 = m & ~(Py_ssize_t)7;
        for (Py_ssize_t i = 0; i < v8; i += 8) {
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rows + lo + i)));
            for (Py_ssize_t j = 1; j < size; j++)
                a = _mm256_add_ps(a, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rows + j * n + lo + i))));
            if (divisor != 1.0f)
                a = _mm256_div_ps(a, d);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0;
            _mm_storeu_si128((__m128i *)(out + lo + i), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
        }
        nan |= sum_rows_f16_portable(rows, size, n, out, divisor, lo + v8, lo + m);
    }
    return nan;
}
#endif

PyObject *
k_sum_rows16(PyObject *self, PyObject *args)
{
    PyObject *orows, *oout;
    int type;
    long long divisor;
    if (!PyArg_ParseTuple(args, "OOiL:sum_rows16", &orows, &oout, &type, &divisor))
        return NULL;
    if ((type != 0 && type != 1) || divisor < 1) {
        PyErr_SetString(PyExc_ValueError, "sum_rows16: type must be 0 (float16) or 1 (bfloat16), divisor >= 1");
        return NULL;
    }
    Py_buffer rows, out;
    if (PyObject_GetBuffer(orows, &rows, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0)
        return NULL;
    if (PyObject_GetBuffer(oout, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    int ok = rows.ndim == 2 && rows.itemsize == 2 && rows.shape[0] >= 1 && out.len == rows.shape[1] * 2;
    int nan = 0;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "sum_rows16: rows must be 2-D uint16 and out its row's length");
    } else {
        Py_ssize_t size = rows.shape[0], n = rows.shape[1];
        float d = (float)divisor;
        const uint16_t *r = (const uint16_t *)rows.buf;
        uint16_t *o = (uint16_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX2_PATH
        int avx2 = strcmp(isa, "portable") != 0 && __builtin_cpu_supports("avx2"); /* use_isa() caps it */
        if (type == 0 && avx2 && __builtin_cpu_supports("f16c"))
            nan = sum_rows16_f16c(r, size, n, o, d);
        else if (type == 1 && avx2)
            nan = sum_rows_bf16_avx2(r, size, n, o, d);
        else
#endif
            nan = type == 1 ? sum_rows_bf16_portable(r, size, n, o, d) : sum_rows_f16_portable(r, size, n, o, d, 0, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    return PyBool_FromLong(nan);
}
