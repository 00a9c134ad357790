/*
 * adasum._kernels: the two passes Adasum makes over every piece of every layer, for float32 and float64.
 *
 *   dots(a, b, spans, out)             out[i] = [a·b, a·a, b·b] over a[s:e], b[s:e] for spans[i] = (s, e)
 *   scaled_add(dst, a, b, spans, ca, cb)  dst[s:e] = ca[i]·a[s:e] + cb[i]·b[s:e]   (dst may be a or b)
 *
 *   pair(left, right, dst, spans, nl, nr) dst[s:e] = Adasum(left[s:e], right[s:e]), one call per pair of vectors
 *   copy(dst, src, spans)                 dst[s:e] = src[s:e]   (packing tensors into a buffer and back)
 *
 * Any operand may also be a list of buffers, one per span: the caller's own tensors, read and written
 * where they lie instead of being packed into one buffer first. layout() tells whether tensors lie back
 * to back, apart, or overlapping.
 *
 * Both read their inputs once, in one pass, with the GIL released. Products and sums are taken in double
 * (a product of two floats is exact in double), so the dot products need no float64 copy of the buffer
 * and the combine rounds once to the buffer's type.
 *
 * The results do not depend on the instruction set: the AVX-512 and AVX2 loops (chosen at import where
 * the CPU has them) and the portable loops add in the same fixed order, and none fuses a multiply with an
 * add where that could change a rounding (the build turns floating-point contraction off), so every rank
 * of a job computes bitwise the same numbers from the same data even when its CPUs differ.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sched.h>
#include <time.h>

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

typedef void (*dots_fn)(const void *, const void *, Py_ssize_t, double *);
typedef void (*scaled_add_fn)(void *, const void *, const void *, Py_ssize_t, double, double);

static dots_fn dots_f32 = (dots_fn)dots_f32_portable, dots_f64 = (dots_fn)dots_f64_portable;
static scaled_add_fn scaled_add_f32 = (scaled_add_fn)scaled_add_f32_portable,
                     scaled_add_f64 = (scaled_add_fn)scaled_add_f64_portable;
static const char *isa = "portable";

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
static void
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

static PyObject *
k_use_isa(PyObject *self, PyObject *arg)
{
    const char *cap = PyUnicode_AsUTF8(arg);
    if (cap == NULL)
        return NULL;
    if (strcmp(cap, "auto") != 0 && strcmp(cap, "avx2") != 0 && strcmp(cap, "portable") != 0) {
        PyErr_Format(PyExc_ValueError, "use_isa: expected 'auto', 'avx2' or 'portable', got '%s'", cap);
        return NULL;
    }
    select_isa(cap);
    return PyUnicode_FromString(isa);
}

/* A C-contiguous buffer of 4- or 8-byte floats; returns the item size, or 0 with an exception set. */
static int
float_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return 0;
    const char *fmt = view->format ? view->format : "B";
    char code = fmt[strlen(fmt) - 1];
    if ((code == 'f' && view->itemsize == 4) || (code == 'd' && view->itemsize == 8))
        return (int)view->itemsize;
    PyErr_Format(PyExc_TypeError, "%s: expected a float32 or float64 buffer, got format '%s'", name, fmt);
    PyBuffer_Release(view);
    return 0;
}

static int
typed_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, Py_ssize_t count,
             const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return 0;
    if (view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", name, itemsize * count, view->len);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Spans as int64 pairs with 0 <= s <= e; returns their count, or -1 with an exception set. */
static Py_ssize_t
get_spans(PyObject *ospans, Py_buffer *spans)
{
    if (PyObject_GetBuffer(ospans, spans, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    Py_ssize_t n = spans->len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (spans->len != n * (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "spans must be int64 pairs");
        PyBuffer_Release(spans);
        return -1;
    }
    const int64_t *sp = (const int64_t *)spans->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sp[2 * i] < 0 || sp[2 * i + 1] < sp[2 * i]) {
            PyErr_Format(PyExc_IndexError, "span %zd = (%lld, %lld) is not a range", i, (long long)sp[2 * i],
                         (long long)sp[2 * i + 1]);
            PyBuffer_Release(spans);
            return -1;
        }
    }
    return n;
}

/*
 * An operand of the kernels: one flat buffer that every span indexes (element s of span i is at
 * buf + s), or a sequence of buffers, one per span, each exactly e - s elements long (the caller's own
 * tensors, read and written without packing them into one buffer).
 */
typedef struct {
    Py_buffer whole;
    Py_buffer *parts; /* NULL for a whole buffer */
    Py_ssize_t n;
    int itemsize;
} operand;

static void
release_operand(operand *op)
{
    if (op->parts) {
        for (Py_ssize_t i = 0; i < op->n; i++)
            PyBuffer_Release(&op->parts[i]);
        PyMem_Free(op->parts);
        op->parts = NULL;
    } else {
        PyBuffer_Release(&op->whole);
    }
}

/* Acquires `obj` as an operand over `n` spans of float32/float64; 1 on success, 0 with an exception set. */
static int
get_operand(PyObject *obj, operand *op, int writable, const char *name, const int64_t *sp, Py_ssize_t n)
{
    op->parts = NULL;
    op->n = n;
    if (PyObject_CheckBuffer(obj)) {
        if (!(op->itemsize = float_buffer(obj, &op->whole, writable, name)))
            return 0;
        Py_ssize_t len = op->whole.len / op->itemsize;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (sp[2 * i + 1] > len) {
                PyErr_Format(PyExc_IndexError, "%s: span %zd = (%lld, %lld) is outside a buffer of %zd elements",
                             name, i, (long long)sp[2 * i], (long long)sp[2 * i + 1], len);
                PyBuffer_Release(&op->whole);
                return 0;
            }
        }
        return 1;
    }
    PyObject *seq = PySequence_Fast(obj, "an operand must be a buffer or a sequence of buffers");
    if (!seq)
        return 0;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd parts (one per span), got %zd", name, n,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return 0;
    }
    op->parts = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!op->parts) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return 0;
    }
    op->itemsize = 0;
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        int size = float_buffer(PySequence_Fast_GET_ITEM(seq, i), &op->parts[i], writable, name);
        if (!size)
            break;
        if ((op->itemsize && size != op->itemsize) || op->parts[i].len != (sp[2 * i + 1] - sp[2 * i]) * size) {
            PyErr_Format(PyExc_ValueError, "%s: part %zd: expected %lld elements of %d bytes, got %zd bytes", name,
                         i, (long long)(sp[2 * i + 1] - sp[2 * i]), op->itemsize ? op->itemsize : size,
                         op->parts[i].len);
            PyBuffer_Release(&op->parts[i]);
            break;
        }
        op->itemsize = size;
    }
    Py_DECREF(seq);
    if (i < n) {
        op->n = i;
        release_operand(op);
        return 0;
    }
    if (!op->itemsize) /* no spans: any float type will do */
        op->itemsize = 4;
    return 1;
}

/* Where span i of the operand starts. */
static inline char *
operand_at(const operand *op, const int64_t *sp, Py_ssize_t i)
{
    return op->parts ? (char *)op->parts[i].buf : (char *)op->whole.buf + sp[2 * i] * op->itemsize;
}

static int
same_type(const operand *ops, int count)
{
    for (int k = 1; k < count; k++) {
        if (ops[k].itemsize != ops[0].itemsize && !(ops[k].parts && ops[k].n == 0) &&
            !(ops[0].parts && ops[0].n == 0)) {
            PyErr_SetString(PyExc_ValueError, "all operands must have the same dtype");
            return 0;
        }
    }
    return 1;
}

/* The spans and the operands of one kernel call, acquired together and released together. */
typedef struct {
    Py_buffer spans;
    const int64_t *sp;
    Py_ssize_t n;
    operand ops[4];
    int count;
} call_args;

static void
release_call(call_args *c)
{
    while (c->count > 0)
        release_operand(&c->ops[--c->count]);
    PyBuffer_Release(&c->spans);
}

/* Acquires the spans and `count` operands (operand 0 writable if `first_writable`) of one dtype; 1 on
 * success, 0 with an exception set and nothing held. */
static int
acquire_call(call_args *c, PyObject *ospans, PyObject **objs, const char **names, int count, int first_writable)
{
    c->count = 0;
    if ((c->n = get_spans(ospans, &c->spans)) < 0)
        return 0;
    c->sp = (const int64_t *)c->spans.buf;
    for (; c->count < count; c->count++) {
        if (!get_operand(objs[c->count], &c->ops[c->count], first_writable && c->count == 0, names[c->count],
                         c->sp, c->n)) {
            release_call(c);
            return 0;
        }
    }
    if (!same_type(c->ops, count)) {
        release_call(c);
        return 0;
    }
    return 1;
}

static PyObject *
k_dots(PyObject *self, PyObject *args)
{
    PyObject *objs[2], *ospans, *oout;
    static const char *names[] = {"a", "b"};
    if (!PyArg_ParseTuple(args, "OOOO:dots", &objs[0], &objs[1], &ospans, &oout))
        return NULL;
    call_args c;
    Py_buffer out;
    if (!acquire_call(&c, ospans, objs, names, 2, 0))
        return NULL;
    if (!typed_buffer(oout, &out, 1, 3 * sizeof(double), c.n, "out")) {
        release_call(&c);
        return NULL;
    }
    double *o = (double *)out.buf;
    dots_fn dots = c.ops[0].itemsize == 4 ? dots_f32 : dots_f64;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n; i++)
        dots(operand_at(&c.ops[0], c.sp, i), operand_at(&c.ops[1], c.sp, i), c.sp[2 * i + 1] - c.sp[2 * i],
             o + 3 * i);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    release_call(&c);
    Py_RETURN_NONE;
}

static PyObject *
k_scaled_add(PyObject *self, PyObject *args)
{
    PyObject *objs[3], *ospans, *oca, *ocb;
    static const char *names[] = {"dst", "a", "b"};
    if (!PyArg_ParseTuple(args, "OOOOOO:scaled_add", &objs[0], &objs[1], &objs[2], &ospans, &oca, &ocb))
        return NULL;
    call_args c;
    Py_buffer ca, cb;
    if (!acquire_call(&c, ospans, objs, names, 3, 1))
        return NULL;
    if (!typed_buffer(oca, &ca, 0, sizeof(double), c.n, "ca")) {
        release_call(&c);
        return NULL;
    }
    if (!typed_buffer(ocb, &cb, 0, sizeof(double), c.n, "cb")) {
        PyBuffer_Release(&ca);
        release_call(&c);
        return NULL;
    }
    const double *p = (const double *)ca.buf, *q = (const double *)cb.buf;
    scaled_add_fn scaled_add = c.ops[0].itemsize == 4 ? scaled_add_f32 : scaled_add_f64;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n; i++)
        scaled_add(operand_at(&c.ops[0], c.sp, i), operand_at(&c.ops[1], c.sp, i), operand_at(&c.ops[2], c.sp, i),
                   c.sp[2 * i + 1] - c.sp[2 * i], p[i], q[i]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&cb);
    PyBuffer_Release(&ca);
    release_call(&c);
    Py_RETURN_NONE;
}

/* Below this a float64 squared norm may have lost bits to underflow, or be zero only because every square
 * underflowed (adasum.combine.TINY). */
#define TINY 0x1p-900

/*
 * [x.y, x.x, y.y] of float64 data again, on the data scaled by 2^-k where 2^k bounds its largest magnitude
 * (exact), for partials that overflowed or may have underflowed: the coefficients only use their ratios.
 * Zero data gives zeros; NaN or Inf in the data leaves g as it was (non-finite, on purpose).
 */
static void
rescaled_dots_f64(const double *x, const double *y, Py_ssize_t n, double *g)
{
    double m = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double ax = fabs(x[i]), ay = fabs(y[i]);
        m = !(ax <= m) ? ax : m; /* a NaN sticks */
        m = !(ay <= m) ? ay : m;
    }
    if (m == 0.0) {
        g[0] = g[1] = g[2] = 0.0;
        return;
    }
    if (!isfinite(m))
        return;
    int k;
    frexp(m, &k);
    /* subnormal data: 2^-k is beyond the range, so scale up in two steps (as adasum.combine._scale_down) */
    int half = k >= -1020 ? -k : -k / 2;
    double s = ldexp(1.0, half), s2 = ldexp(1.0, -k - half), d = 0.0, a = 0.0, b = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double xs = x[i] * s * s2, ys = y[i] * s * s2;
        d += xs * ys;
        a += xs * xs;
        b += ys * ys;
    }
    g[0] = d, g[1] = a, g[2] = b;
}

/* dst = Adasum(left, right) span by span (the loop of pair(), below). */
static void
pair_spans(const operand *left, const operand *right, const operand *dst, const int64_t *sp, Py_ssize_t n,
           long long count_left, long long count_right)
{
    double total = (double)(count_left + count_right);
    double w_left = (double)count_left / total, w_right = (double)count_right / total;
    dots_fn dots = dst->itemsize == 4 ? dots_f32 : dots_f64;
    scaled_add_fn scaled_add = dst->itemsize == 4 ? scaled_add_f32 : scaled_add_f64;
    for (Py_ssize_t i = 0; i < n; i++) {
        void *d = operand_at(dst, sp, i);
        const void *x = operand_at(left, sp, i), *y = operand_at(right, sp, i);
        Py_ssize_t len = sp[2 * i + 1] - sp[2 * i];
        double g[3];
        dots(x, y, len, g);
        if (dst->itemsize == 8 && !(isfinite(g[0]) && isfinite(g[1]) && isfinite(g[2]) && g[1] >= TINY && g[2] >= TINY))
            rescaled_dots_f64((const double *)x, (const double *)y, len, g);
        double q_left = g[1] != 0.0 ? g[0] / g[1] : 0.0, q_right = g[2] != 0.0 ? g[0] / g[2] : 0.0;
        scaled_add(d, x, y, len, 1.0 - w_left * q_left, 1.0 - w_right * q_right);
    }
}

/*
 * pair(left, right, dst, spans, count_left, count_right): dst = Adasum(left, right) span by span, where
 * left and right stand for count_left and count_right ranks. The coefficients are those of
 * adasum.combine.coefficients, computed with the same operations in the same order (so the same bits).
 */
static PyObject *
k_pair(PyObject *self, PyObject *args)
{
    PyObject *objs[3], *ospans;
    static const char *names[] = {"dst", "left", "right"};
    long long count_left, count_right;
    if (!PyArg_ParseTuple(args, "OOOOLL:pair", &objs[1], &objs[2], &objs[0], &ospans, &count_left, &count_right))
        return NULL;
    if (count_left < 0 || count_right < 0 || count_left + count_right == 0) {
        PyErr_SetString(PyExc_ValueError, "counts must be >= 0 and not both 0");
        return NULL;
    }
    call_args c;
    if (!acquire_call(&c, ospans, objs, names, 3, 1))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pair_spans(&c.ops[1], &c.ops[2], &c.ops[0], c.sp, c.n, count_left, count_right);
    Py_END_ALLOW_THREADS
    release_call(&c);
    Py_RETURN_NONE;
}

static void
copy_spans(const operand *dst, const operand *src, const int64_t *sp, Py_ssize_t n)
{
    size_t size = (size_t)dst->itemsize;
    for (Py_ssize_t i = 0; i < n; i++)
        memmove(operand_at(dst, sp, i), operand_at(src, sp, i), (size_t)(sp[2 * i + 1] - sp[2 * i]) * size);
}

/*
 * The MPI library of the process (the one mpi4py loaded), called directly by small_doubling(). Handles
 * (communicators, datatypes, ops) are passed as integers the width of a pointer: MPICH's are ints and
 * Open MPI's pointers, and on the 64-bit ABIs this module binds on (x86-64, AArch64) an int argument is
 * the low half of the register or stack slot it travels in, so one prototype serves both.
 */
typedef int (*mpi_sendrecv_fn)(const void *, int, intptr_t, int, int, void *, int, intptr_t, int, int, intptr_t,
                               void *);
typedef int (*mpi_send_fn)(const void *, int, intptr_t, int, int, intptr_t);
typedef int (*mpi_recv_fn)(void *, int, intptr_t, int, int, intptr_t, void *);
typedef int (*mpi_iallreduce_fn)(const void *, void *, int, intptr_t, intptr_t, intptr_t, void *);
typedef int (*mpi_test_fn)(void *, int *, void *);
static struct {
    mpi_sendrecv_fn sendrecv;
    mpi_send_fn send;
    mpi_recv_fn recv;
    mpi_iallreduce_fn iallreduce;
    mpi_test_fn test;
} mpi;

static PyObject *
k_bind_mpi(PyObject *self, PyObject *args)
{
    unsigned long long sendrecv, send, recv, iallreduce, test;
    if (!PyArg_ParseTuple(args, "KKKKK:bind_mpi", &sendrecv, &send, &recv, &iallreduce, &test))
        return NULL;
#if (defined(__x86_64__) || defined(__aarch64__)) && UINTPTR_MAX == 0xffffffffffffffffULL
    mpi.sendrecv = (mpi_sendrecv_fn)(uintptr_t)sendrecv;
    mpi.send = (mpi_send_fn)(uintptr_t)send;
    mpi.recv = (mpi_recv_fn)(uintptr_t)recv;
    mpi.iallreduce = (mpi_iallreduce_fn)(uintptr_t)iallreduce;
    mpi.test = (mpi_test_fn)(uintptr_t)test;
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static double
seconds_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + 1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}

/*
 * The agreement of a call: MPI_Iallreduce(MAX) of scratch[0:4] into scratch[4:8] on comm, then MPI_Test
 * until it completes (as a blocking allreduce would wait, without holding the GIL). After `patience`
 * seconds (> 0) it stops waiting: 1 is returned and the request's handle is left in scratch[8] for the
 * caller to go on waiting and tell who has not arrived. 0 when complete, or MPI's error code (> 1).
 * scratch must outlive the request.
 */
static int
agree_spin(int64_t *scratch, intptr_t int64, intptr_t max, intptr_t comm, double patience)
{
    long long status[16] = {0};
    intptr_t req = 0; /* MPICH's handle is an int: its upper half stays 0 */
    int flag = 0, rc = mpi.iallreduce(scratch, scratch + 4, 4, int64, max, comm, &req);
    if (rc)
        return rc;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned long spins = 1;; spins++) {
        if ((rc = mpi.test(&req, &flag, status)))
            return rc;
        if (flag)
            return 0;
        /* Hand the core over now and then: with more ranks than cores (oversubscribed, as on a laptop or
         * a CI machine) the rank being waited for may need it. At 4 ranks on 2 cores a pure spin took a
         * 4 ms agreement, against 13-20 us with this and 31-44 us for a blocking MPI_Allreduce. */
        if ((spins & 15) == 0)
            sched_yield();
        if (patience > 0 && (spins & 1023) == 0 && seconds_since(&t0) >= patience) {
            scratch[8] = (int64_t)req;
            return 1;
        }
    }
}

/* agree(scratch, comm, int64, max, patience) -> 0 (done), 1 (still waiting: the request is in
 * scratch[8]) or MPI's error code; see agree_spin(). scratch: writable int64, 9 elements. */
static PyObject *
k_agree(PyObject *self, PyObject *args)
{
    PyObject *oscratch;
    long long comm, int64, max;
    double patience;
    if (!PyArg_ParseTuple(args, "OLLLd:agree", &oscratch, &comm, &int64, &max, &patience))
        return NULL;
    if (!mpi.iallreduce) {
        PyErr_SetString(PyExc_RuntimeError, "agree: bind_mpi() was not called");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(oscratch, &b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (b.len < 9 * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "agree: scratch must hold 9 int64");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = agree_spin((int64_t *)b.buf, (intptr_t)int64, (intptr_t)max, (intptr_t)comm, patience);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromLong(rc);
}

/* The fields of small_doubling()'s program (int64), then four per level: partner, count_left,
 * count_right, upper. */
enum { P_COMM, P_BYTE, P_INT64, P_MAX, P_TAG, P_NBYTES, P_OUT, P_FOLD, P_FOLD_SELF, P_FOLD_OTHER, P_LEVELS,
       P_FIELDS };

static int
run_small(const int64_t *prog, long long digest, int64_t *scratch, double patience, const operand *buf,
          const operand *scr, const operand *src, const operand *dst, const int64_t *sp, Py_ssize_t n)
{
    intptr_t comm = (intptr_t)prog[P_COMM], byte = (intptr_t)prog[P_BYTE];
    int tag = (int)prog[P_TAG], count = (int)prog[P_NBYTES];
    long long status[16] = {0};
    int rc;
    if (patience >= 0) { /* a negative patience: the agreement is done (it went on in Python) */
        scratch[0] = digest, scratch[1] = -digest, scratch[2] = 0, scratch[3] = 0;
        rc = agree_spin(scratch, (intptr_t)prog[P_INT64], (intptr_t)prog[P_MAX], comm, patience);
        if (rc == 1)
            return -2;
        if (rc)
            return rc;
    }
    const int64_t *seen = scratch + 4;
    if (!(seen[2] == 0 && seen[0] == -seen[1]))
        return -1;
    copy_spans(buf, src, sp, n);
    void *b = buf->whole.buf, *r = scr->whole.buf;
    if (prog[P_OUT] >= 0) { /* folded out: hand the vector over, get the result back */
        if ((rc = mpi.send(b, count, byte, (int)prog[P_OUT], tag, comm)) ||
            (rc = mpi.recv(b, count, byte, (int)prog[P_OUT], tag, comm, status)))
            return rc;
        copy_spans(dst, buf, sp, n);
        return 0;
    }
    int fold = prog[P_FOLD] >= 0;
    if (fold) {
        if ((rc = mpi.recv(r, count, byte, (int)prog[P_FOLD], tag, comm, status)))
            return rc;
        pair_spans(buf, scr, buf, sp, n, prog[P_FOLD_SELF], prog[P_FOLD_OTHER]);
    }
    long long levels = prog[P_LEVELS];
    for (long long i = 0; i < levels; i++) {
        const int64_t *lv = prog + P_FIELDS + 4 * i;
        if ((rc = mpi.sendrecv(b, count, byte, (int)lv[0], tag, r, count, byte, (int)lv[0], tag, comm, status)))
            return rc;
        const operand *out = i == levels - 1 && !fold ? dst : buf;
        pair_spans(lv[3] ? scr : buf, lv[3] ? buf : scr, out, sp, n, lv[1], lv[2]);
    }
    if (fold) {
        if ((rc = mpi.send(b, count, byte, (int)prog[P_FOLD], tag, comm)))
            return rc;
    }
    if (fold || levels == 0)
        copy_spans(dst, buf, sp, n);
    return 0;
}

/*
 * small_doubling(buf, scr, src, dst, spans, program, digest, scratch, patience): the whole of a small
 * Adasum call by recursive doubling, as adasum.doubling.SmallCall makes it (the same collective, messages
 * and kernel calls as the general schedule, so ranks may mix the two), with no Python in between: the
 * agreement allreduce of [digest, -digest, 0, 0] (agree_spin(), in scratch), packing src into buf, the
 * fold, one exchange and pair() per level, the result into dst. Returns 0, -1 if the ranks disagree
 * (nothing was sent; the caller explains), -2 if the agreement is still waiting after `patience` seconds
 * (its request in scratch[8]: the caller waits on, then calls again with a negative patience to skip the
 * agreement), or MPI's error code.
 */
static PyObject *
k_small_doubling(PyObject *self, PyObject *args)
{
    PyObject *objs[4], *ospans, *oprog, *oscratch;
    long long digest;
    double patience;
    static const char *names[] = {"buf", "scr", "dst", "src"};
    if (!PyArg_ParseTuple(args, "OOOOOOLOd:small_doubling", &objs[0], &objs[1], &objs[3], &objs[2], &ospans,
                          &oprog, &digest, &oscratch, &patience))
        return NULL;
    if (!mpi.iallreduce) {
        PyErr_SetString(PyExc_RuntimeError, "small_doubling: bind_mpi() was not called");
        return NULL;
    }
    Py_buffer prog, scratch;
    if (PyObject_GetBuffer(oprog, &prog, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(oscratch, &scratch, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&prog);
        return NULL;
    }
    const int64_t *p = (const int64_t *)prog.buf;
    Py_ssize_t fields = prog.len / (Py_ssize_t)sizeof(int64_t);
    if (fields < P_FIELDS || fields != P_FIELDS + 4 * p[P_LEVELS] || scratch.len < 9 * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&prog);
        PyBuffer_Release(&scratch);
        PyErr_SetString(PyExc_ValueError, "small_doubling: malformed program or scratch");
        return NULL;
    }
    call_args c;
    if (!acquire_call(&c, ospans, objs, names, 1, 1)) {
        PyBuffer_Release(&prog);
        PyBuffer_Release(&scratch);
        return NULL;
    }
    /* scr and dst (written), src (read) complete the operands */
    int ok = 1;
    for (int k = 1; ok && k < 4; k++) {
        ok = get_operand(objs[k], &c.ops[k], k < 3, names[k], c.sp, c.n);
        if (ok)
            c.count = k + 1;
    }
    int rc = 0;
    if (ok) {
        if (!same_type(c.ops, 4) || c.ops[0].parts || c.ops[1].parts ||
            c.ops[0].whole.len < p[P_NBYTES] || c.ops[1].whole.len < p[P_NBYTES]) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "small_doubling: buf and scr must be whole buffers of nbytes");
            ok = 0;
        }
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        rc = run_small(p, digest, (int64_t *)scratch.buf, patience, &c.ops[0], &c.ops[1], &c.ops[3], &c.ops[2],
                       c.sp, c.n);
        Py_END_ALLOW_THREADS
    }
    release_call(&c);
    PyBuffer_Release(&prog);
    PyBuffer_Release(&scratch);
    if (!ok)
        return NULL;
    return PyLong_FromLong(rc);
}

/* copy(dst, src, spans): dst[s:e] = src[s:e] for each span (packing tensors into a buffer, or back). */
static PyObject *
k_copy(PyObject *self, PyObject *args)
{
    PyObject *objs[2], *ospans;
    static const char *names[] = {"dst", "src"};
    if (!PyArg_ParseTuple(args, "OOO:copy", &objs[0], &objs[1], &ospans))
        return NULL;
    call_args c;
    if (!acquire_call(&c, ospans, objs, names, 2, 1))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_spans(&c.ops[0], &c.ops[1], c.sp, c.n);
    Py_END_ALLOW_THREADS
    release_call(&c);
    Py_RETURN_NONE;
}

typedef struct {
    uintptr_t start, end;
} extent;

static int
by_start(const void *x, const void *y)
{
    uintptr_t a = ((const extent *)x)->start, b = ((const extent *)y)->start;
    return (a > b) - (a < b);
}

/* layout(arrays, writable): how C-contiguous buffers lie in memory (see the method's docstring). */
static PyObject *
k_layout(PyObject *self, PyObject *args)
{
    PyObject *oarrays;
    int writable;
    if (!PyArg_ParseTuple(args, "Op:layout", &oarrays, &writable))
        return NULL;
    PyObject *seq = PySequence_Fast(oarrays, "layout needs a sequence of buffers");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), live = 0;
    extent *ext = PyMem_Malloc((n ? n : 1) * sizeof(extent));
    if (!ext) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    int adjacent = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer view;
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, flags) < 0) {
            PyMem_Free(ext);
            Py_DECREF(seq);
            return NULL;
        }
        if (view.len > 0) {
            uintptr_t start = (uintptr_t)view.buf;
            if (live && start != ext[live - 1].end)
                adjacent = 0;
            ext[live].start = start;
            ext[live].end = start + (uintptr_t)view.len;
            live++;
        }
        PyBuffer_Release(&view);
    }
    Py_DECREF(seq);
    long result = 2;
    if (!adjacent) {
        qsort(ext, (size_t)live, sizeof(extent), by_start);
        result = 1;
        for (Py_ssize_t i = 1; i < live; i++)
            if (ext[i].start < ext[i - 1].end)
                result = 0;
    }
    PyMem_Free(ext);
    return PyLong_FromLong(result);
}

/* address(obj): where the buffer's first element lies (to tell views of one allocation apart). */
static PyObject *
k_address(PyObject *self, PyObject *obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0)
        return NULL;
    PyObject *result = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return result;
}

/* key(items): tuple((type(t), t.shape, t.dtype, getattr(t, "device", None)) for t in items). */
static PyObject *
k_key(PyObject *self, PyObject *items)
{
    static PyObject *s_shape, *s_dtype, *s_device;
    if (!s_shape && (!(s_shape = PyUnicode_InternFromString("shape")) ||
                     !(s_dtype = PyUnicode_InternFromString("dtype")) ||
                     !(s_device = PyUnicode_InternFromString("device"))))
        return NULL;
    PyObject *seq = PySequence_Fast(items, "key needs a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *shape = PyObject_GetAttr(t, s_shape), *dtype = shape ? PyObject_GetAttr(t, s_dtype) : NULL;
        PyObject *device = NULL;
        if (dtype && !(device = PyObject_GetAttr(t, s_device)) && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            device = Py_NewRef(Py_None);
        }
        PyObject *entry = device ? PyTuple_Pack(4, (PyObject *)Py_TYPE(t), shape, dtype, device) : NULL;
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        Py_XDECREF(device);
        if (!entry) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, entry);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"dots", k_dots, METH_VARARGS,
     "dots(a, b, spans, out): out[i] = [a.b, a.a, b.b] over a[s:e], b[s:e] for spans[i] = (s, e), in "
     "float64.\n\nspans: int64 (n, 2); out: writable float64 (n, 3). An operand (a, b) is a contiguous "
     "float32 or float64 buffer that the spans index, or a sequence of n such buffers, buffer i holding "
     "the e - s elements of span i. All operands have one dtype."},
    {"scaled_add", k_scaled_add, METH_VARARGS,
     "scaled_add(dst, a, b, spans, ca, cb): dst[s:e] = ca[i]*a[s:e] + cb[i]*b[s:e] for spans[i] = (s, e), "
     "computed in float64 and rounded once to the dtype. Operands as for dots; dst may be a or b."},
    {"pair", k_pair, METH_VARARGS,
     "pair(left, right, dst, spans, count_left, count_right): dst[s:e] = Adasum(left[s:e], right[s:e]) "
     "for each span, the left vector standing for count_left ranks and the right for count_right (the size-weighted rule): "
     "dots, coefficients and combine in one call. Operands as for dots; dst may be left or right."},
    {"bind_mpi", k_bind_mpi, METH_VARARGS,
     "bind_mpi(sendrecv, send, recv, iallreduce, test): the addresses of MPI_Sendrecv, MPI_Send, MPI_Recv, "
     "MPI_Iallreduce and MPI_Test of the MPI library in use, for small_doubling() and agree(). False where "
     "this platform's calling convention is not known to pass handles of either MPI ABI alike (both are then "
     "unusable)."},
    {"agree", k_agree, METH_VARARGS,
     "agree(scratch, comm, int64, max, patience) -> 0, 1 or an MPI error code: MPI_Iallreduce(MAX) of "
     "scratch[0:4] into scratch[4:8], waited for without the GIL; 1 if it is still waiting after patience "
     "seconds (> 0; 0 waits for ever), its request handle in scratch[8]."},
    {"small_doubling", k_small_doubling, METH_VARARGS,
     "small_doubling(buf, scr, src, dst, spans, program, digest, scratch, patience) -> 0, -1 (the ranks "
     "disagree), -2 (still waiting for the agreement after patience seconds; its request in scratch[8]) or an "
     "MPI error code: a small Adasum call by recursive doubling, agreement included, without Python in "
     "between (see the source for the program's fields)."},
    {"copy", k_copy, METH_VARARGS,
     "copy(dst, src, spans): dst[s:e] = src[s:e] for each span; operands as for dots."},
    {"address", k_address, METH_O, "address(obj): the address of the first element of obj's buffer."},
    {"use_isa", k_use_isa, METH_O,
     "use_isa(cap) -> the instruction set now used: the widest the CPU has, capped at cap ('auto', 'avx2' "
     "or 'portable')."},
    {"key", k_key, METH_O,
     "key(items): tuple((type(t), t.shape, t.dtype, getattr(t, 'device', None)) for t in items), the part "
     "of a call's plan key that its tensors give."},
    {"layout", k_layout, METH_VARARGS,
     "layout(arrays, writable): 2 if the non-empty C-contiguous buffers lie back to back in order, 1 if no "
     "two of them overlap, 0 if some do. A non-contiguous buffer, or a read-only one when writable is true, "
     "raises the exporter's error (BufferError, or numpy's ValueError)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "adasum._kernels",
    "Single-pass float64-accurate dot products and combine for float32/float64 buffers.", -1, methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    select_isa("auto");
    return PyModule_Create(&module);
}
