/*
 * adasum._kernels: the two passes Adasum makes over every piece of every layer, for float32 and float64.
 *
 *   dots(a, b, spans, out)             out[i] = [a·b, a·a, b·b] over a[s:e], b[s:e] for spans[i] = (s, e)
 *   scaled_add(dst, a, b, spans, ca, cb)  dst[s:e] = ca[i]·a[s:e] + cb[i]·b[s:e]   (dst may be a)
 *   dots_parts / scaled_add_parts          the same with a[s:e] given as a separate buffer per span
 *                                          (the caller's own tensors, read without packing them first)
 *
 * Both read their inputs once, in one pass, with the GIL released. Products and sums are taken in double
 * (a product of two floats is exact in double), so the dot products need no float64 copy of the buffer
 * and the combine rounds once to the buffer's type.
 *
 * The results do not depend on the instruction set: the AVX2 loops (chosen at import where the CPU has
 * them) and the portable loops add in the same fixed order, and neither fuses a multiply with an add
 * (the build turns floating-point contraction off), so every rank of a job computes bitwise the same
 * numbers from the same data even when its CPUs differ.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/*
 * The summation order, fixed for every build: element i goes to lane i mod 8 while at least 8 elements
 * remain; at the end lane j and lane j + 4 are added (j = 0..3), then ((l0 + l1) + l2) + l3, then the last
 * n mod 8 elements in order. The portable loops below and the AVX2 loops follow it exactly.
 */
#define DEFINE_PORTABLE(T, NAME)                                                                      \
    static void dots_##NAME##_portable(const T *a, const T *b, Py_ssize_t n, double *out)            \
    {                                                                                               \
        double ab[8] = {0}, aa[8] = {0}, bb[8] = {0};                                               \
        Py_ssize_t i = 0;                                                                           \
        for (; i + 8 <= n; i += 8) {                                                                \
            for (int j = 0; j < 8; j++) {                                                           \
                double x = (double)a[i + j], y = (double)b[i + j];                                  \
                ab[j] += x * y;                                                                     \
                aa[j] += x * x;                                                                     \
                bb[j] += y * y;                                                                     \
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

static void
finish(double *ab, double *aa, double *bb, double *out)
{
    double *acc[3] = {ab, aa, bb};
    for (int k = 0; k < 3; k++) {
        double *l = acc[k];
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

AVX2 static void
finish_avx2(__m256d ab0, __m256d ab1, __m256d aa0, __m256d aa1, __m256d bb0, __m256d bb1, double *out)
{
    double ab[8], aa[8], bb[8];
    _mm256_storeu_pd(ab, ab0);
    _mm256_storeu_pd(ab + 4, ab1);
    _mm256_storeu_pd(aa, aa0);
    _mm256_storeu_pd(aa + 4, aa1);
    _mm256_storeu_pd(bb, bb0);
    _mm256_storeu_pd(bb + 4, bb1);
    finish(ab, aa, bb, out);
}

#define ACCUMULATE(x0, x1, y0, y1)                                                                    \
    do {                                                                                            \
        ab0 = _mm256_add_pd(ab0, _mm256_mul_pd(x0, y0));                                            \
        ab1 = _mm256_add_pd(ab1, _mm256_mul_pd(x1, y1));                                            \
        aa0 = _mm256_add_pd(aa0, _mm256_mul_pd(x0, x0));                                            \
        aa1 = _mm256_add_pd(aa1, _mm256_mul_pd(x1, x1));                                            \
        bb0 = _mm256_add_pd(bb0, _mm256_mul_pd(y0, y0));                                            \
        bb1 = _mm256_add_pd(bb1, _mm256_mul_pd(y1, y1));                                            \
    } while (0)

AVX2 static void
dots_f32_avx2(const float *a, const float *b, Py_ssize_t n, double *out)
{
    __m256d ab0 = _mm256_setzero_pd(), ab1 = ab0, aa0 = ab0, aa1 = ab0, bb0 = ab0, bb1 = ab0;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(a + i)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(a + i + 4));
        __m256d y0 = _mm256_cvtps_pd(_mm_loadu_ps(b + i)), y1 = _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4));
        ACCUMULATE(x0, x1, y0, y1);
    }
    finish_avx2(ab0, ab1, aa0, aa1, bb0, bb1, out);
    tail_f32(a + i, b + i, n - i, out);
}

AVX2 static void
dots_f64_avx2(const double *a, const double *b, Py_ssize_t n, double *out)
{
    __m256d ab0 = _mm256_setzero_pd(), ab1 = ab0, aa0 = ab0, aa1 = ab0, bb0 = ab0, bb1 = ab0;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d x0 = _mm256_loadu_pd(a + i), x1 = _mm256_loadu_pd(a + i + 4);
        __m256d y0 = _mm256_loadu_pd(b + i), y1 = _mm256_loadu_pd(b + i + 4);
        ACCUMULATE(x0, x1, y0, y1);
    }
    finish_avx2(ab0, ab1, aa0, aa1, bb0, bb1, out);
    tail_f64(a + i, b + i, n - i, out);
}

AVX2 static void
scaled_add_f32_avx2(float *dst, const float *a, const float *b, Py_ssize_t n, double ca, double cb)
{
    __m256d p = _mm256_set1_pd(ca), q = _mm256_set1_pd(cb);
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(a + i)), y = _mm256_cvtps_pd(_mm_loadu_ps(b + i));
        _mm_storeu_ps(dst + i, _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(p, x), _mm256_mul_pd(q, y))));
    }
    scaled_add_f32_portable(dst + i, a + i, b + i, n - i, ca, cb);
}

AVX2 static void
scaled_add_f64_avx2(double *dst, const double *a, const double *b, Py_ssize_t n, double ca, double cb)
{
    __m256d p = _mm256_set1_pd(ca), q = _mm256_set1_pd(cb);
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d x = _mm256_loadu_pd(a + i), y = _mm256_loadu_pd(b + i);
        _mm256_storeu_pd(dst + i, _mm256_add_pd(_mm256_mul_pd(p, x), _mm256_mul_pd(q, y)));
    }
    scaled_add_f64_portable(dst + i, a + i, b + i, n - i, ca, cb);
}
#endif

/* Picks the AVX2 loops where the CPU has them (ADASUM_KERNELS_ISA=portable forces the portable ones). */
static void
select_isa(void)
{
#ifdef HAVE_AVX2_PATH
    const char *env = getenv("ADASUM_KERNELS_ISA");
    if (env && strcmp(env, "portable") == 0)
        return;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        dots_f32 = (dots_fn)dots_f32_avx2;
        dots_f64 = (dots_fn)dots_f64_avx2;
        scaled_add_f32 = (scaled_add_fn)scaled_add_f32_avx2;
        scaled_add_f64 = (scaled_add_fn)scaled_add_f64_avx2;
        isa = "avx2";
    }
#endif
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

/* Checks every span against the buffer length before any work starts. */
static int
check_spans(const int64_t *spans, Py_ssize_t n, Py_ssize_t len)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = spans[2 * i], e = spans[2 * i + 1];
        if (s < 0 || e < s || e > len) {
            PyErr_Format(PyExc_IndexError, "span %zd = (%lld, %lld) is outside a buffer of %zd elements", i,
                         (long long)s, (long long)e, len);
            return 0;
        }
    }
    return 1;
}

/* Spans as int64 pairs, checked against a buffer of `len` elements; returns their count or -1. */
static Py_ssize_t
get_spans(PyObject *ospans, Py_buffer *spans, Py_ssize_t len)
{
    if (PyObject_GetBuffer(ospans, spans, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    Py_ssize_t n = spans->len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (spans->len != n * (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "spans must be int64 pairs");
        PyBuffer_Release(spans);
        return -1;
    }
    if (!check_spans((const int64_t *)spans->buf, n, len)) {
        PyBuffer_Release(spans);
        return -1;
    }
    return n;
}

static PyObject *
k_dots(PyObject *self, PyObject *args)
{
    PyObject *oa, *ob, *ospans, *oout;
    if (!PyArg_ParseTuple(args, "OOOO:dots", &oa, &ob, &ospans, &oout))
        return NULL;
    Py_buffer a, b, spans, out;
    int ok = 0, size_a, size_b;
    if (!(size_a = float_buffer(oa, &a, 0, "a")))
        return NULL;
    if (!(size_b = float_buffer(ob, &b, 0, "b")))
        goto release_a;
    if (size_a != size_b || a.len != b.len) {
        PyErr_SetString(PyExc_ValueError, "a and b must have the same dtype and length");
        goto release_b;
    }
    Py_ssize_t n = get_spans(ospans, &spans, a.len / size_a);
    if (n < 0)
        goto release_b;
    if (!typed_buffer(oout, &out, 1, 3 * sizeof(double), n, "out"))
        goto release_spans;
    const int64_t *sp = (const int64_t *)spans.buf;
    double *o = (double *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = sp[2 * i], e = sp[2 * i + 1];
        if (size_a == 4)
            dots_f32((const float *)a.buf + s, (const float *)b.buf + s, e - s, o + 3 * i);
        else
            dots_f64((const double *)a.buf + s, (const double *)b.buf + s, e - s, o + 3 * i);
    }
    Py_END_ALLOW_THREADS
    ok = 1;
    PyBuffer_Release(&out);
release_spans:
    PyBuffer_Release(&spans);
release_b:
    PyBuffer_Release(&b);
release_a:
    PyBuffer_Release(&a);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
k_scaled_add(PyObject *self, PyObject *args)
{
    PyObject *odst, *oa, *ob, *ospans, *oca, *ocb;
    if (!PyArg_ParseTuple(args, "OOOOOO:scaled_add", &odst, &oa, &ob, &ospans, &oca, &ocb))
        return NULL;
    Py_buffer dst, a, b, spans, ca, cb;
    int ok = 0, size_d, size_a, size_b;
    if (!(size_d = float_buffer(odst, &dst, 1, "dst")))
        return NULL;
    if (!(size_a = float_buffer(oa, &a, 0, "a")))
        goto release_dst;
    if (!(size_b = float_buffer(ob, &b, 0, "b")))
        goto release_a;
    if (size_a != size_d || size_b != size_d || a.len != dst.len || b.len != dst.len) {
        PyErr_SetString(PyExc_ValueError, "dst, a and b must have the same dtype and length");
        goto release_b;
    }
    Py_ssize_t n = get_spans(ospans, &spans, dst.len / size_d);
    if (n < 0)
        goto release_b;
    if (!typed_buffer(oca, &ca, 0, sizeof(double), n, "ca"))
        goto release_spans;
    if (!typed_buffer(ocb, &cb, 0, sizeof(double), n, "cb"))
        goto release_ca;
    const int64_t *sp = (const int64_t *)spans.buf;
    const double *p = (const double *)ca.buf, *q = (const double *)cb.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = sp[2 * i], e = sp[2 * i + 1];
        if (size_d == 4)
            scaled_add_f32((float *)dst.buf + s, (const float *)a.buf + s, (const float *)b.buf + s, e - s,
                           p[i], q[i]);
        else
            scaled_add_f64((double *)dst.buf + s, (const double *)a.buf + s, (const double *)b.buf + s,
                           e - s, p[i], q[i]);
    }
    Py_END_ALLOW_THREADS
    ok = 1;
    PyBuffer_Release(&cb);
release_ca:
    PyBuffer_Release(&ca);
release_spans:
    PyBuffer_Release(&spans);
release_b:
    PyBuffer_Release(&b);
release_a:
    PyBuffer_Release(&a);
release_dst:
    PyBuffer_Release(&dst);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* Acquires parts[i] (a sequence of n buffers) with parts[i] holding exactly spans[i] elements of `itemsize`
 * bytes each; on failure releases what it took, sets an exception and returns NULL. */
static Py_buffer *
get_parts(PyObject *oparts, Py_ssize_t n, const int64_t *sp, int itemsize)
{
    PyObject *seq = PySequence_Fast(oparts, "parts must be a sequence of buffers");
    if (!seq)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "expected %zd parts (one per span), got %zd", n,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!views) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        int size = float_buffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], 0, "parts[i]");
        if (!size)
            break;
        if (size != itemsize || views[i].len != (sp[2 * i + 1] - sp[2 * i]) * itemsize) {
            PyErr_Format(PyExc_ValueError, "part %zd: expected %lld elements of %d bytes, got %zd bytes", i,
                         (long long)(sp[2 * i + 1] - sp[2 * i]), itemsize, views[i].len);
            PyBuffer_Release(&views[i]);
            break;
        }
    }
    Py_DECREF(seq);
    if (i < n) {
        while (i-- > 0)
            PyBuffer_Release(&views[i]);
        PyMem_Free(views);
        return NULL;
    }
    return views;
}

static void
release_parts(Py_buffer *views, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

static PyObject *
k_dots_parts(PyObject *self, PyObject *args)
{
    PyObject *oparts, *ob, *ospans, *oout;
    if (!PyArg_ParseTuple(args, "OOOO:dots_parts", &oparts, &ob, &ospans, &oout))
        return NULL;
    Py_buffer b, spans, out;
    int size = float_buffer(ob, &b, 0, "b");
    if (!size)
        return NULL;
    Py_ssize_t n = get_spans(ospans, &spans, b.len / size);
    if (n < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    PyObject *result = NULL;
    if (typed_buffer(oout, &out, 1, 3 * sizeof(double), n, "out")) {
        const int64_t *sp = (const int64_t *)spans.buf;
        Py_buffer *parts = get_parts(oparts, n, sp, size);
        if (parts) {
            double *o = (double *)out.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                int64_t s = sp[2 * i], e = sp[2 * i + 1];
                if (size == 4)
                    dots_f32(parts[i].buf, (const float *)b.buf + s, e - s, o + 3 * i);
                else
                    dots_f64(parts[i].buf, (const double *)b.buf + s, e - s, o + 3 * i);
            }
            Py_END_ALLOW_THREADS
            release_parts(parts, n);
            result = Py_None;
        }
        PyBuffer_Release(&out);
    }
    PyBuffer_Release(&spans);
    PyBuffer_Release(&b);
    Py_XINCREF(result);
    return result;
}

static PyObject *
k_scaled_add_parts(PyObject *self, PyObject *args)
{
    PyObject *odst, *oparts, *ob, *ospans, *oca, *ocb;
    if (!PyArg_ParseTuple(args, "OOOOOO:scaled_add_parts", &odst, &oparts, &ob, &ospans, &oca, &ocb))
        return NULL;
    Py_buffer dst, b, spans, ca, cb;
    PyObject *result = NULL;
    int size = float_buffer(odst, &dst, 1, "dst");
    if (!size)
        return NULL;
    int size_b = float_buffer(ob, &b, 0, "b");
    if (!size_b)
        goto release_dst;
    if (size_b != size || b.len != dst.len) {
        PyErr_SetString(PyExc_ValueError, "dst and b must have the same dtype and length");
        goto release_b;
    }
    Py_ssize_t n = get_spans(ospans, &spans, b.len / size);
    if (n < 0)
        goto release_b;
    if (!typed_buffer(oca, &ca, 0, sizeof(double), n, "ca"))
        goto release_spans;
    if (!typed_buffer(ocb, &cb, 0, sizeof(double), n, "cb"))
        goto release_ca;
    const int64_t *sp = (const int64_t *)spans.buf;
    Py_buffer *parts = get_parts(oparts, n, sp, size);
    if (parts) {
        const double *p = (const double *)ca.buf, *q = (const double *)cb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = sp[2 * i], e = sp[2 * i + 1];
            if (size == 4)
                scaled_add_f32((float *)dst.buf + s, parts[i].buf, (const float *)b.buf + s, e - s, p[i], q[i]);
            else
                scaled_add_f64((double *)dst.buf + s, parts[i].buf, (const double *)b.buf + s, e - s, p[i],
                               q[i]);
        }
        Py_END_ALLOW_THREADS
        release_parts(parts, n);
        result = Py_None;
    }
    PyBuffer_Release(&cb);
release_ca:
    PyBuffer_Release(&ca);
release_spans:
    PyBuffer_Release(&spans);
release_b:
    PyBuffer_Release(&b);
release_dst:
    PyBuffer_Release(&dst);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"dots", k_dots, METH_VARARGS,
     "dots(a, b, spans, out): out[i] = [a.b, a.a, b.b] over a[s:e], b[s:e] for spans[i] = (s, e), in "
     "float64.\n\na, b: contiguous float32 or float64 buffers of one dtype and length; spans: int64 (n, 2); "
     "out: writable float64 (n, 3)."},
    {"scaled_add", k_scaled_add, METH_VARARGS,
     "scaled_add(dst, a, b, spans, ca, cb): dst[s:e] = ca[i]*a[s:e] + cb[i]*b[s:e] for spans[i] = (s, e), "
     "computed in float64 and rounded once to dst's dtype. dst may be a."},
    {"dots_parts", k_dots_parts, METH_VARARGS,
     "dots_parts(parts, b, spans, out): as dots, with a[s:e] given as parts[i], a buffer of e - s elements "
     "of b's dtype."},
    {"scaled_add_parts", k_scaled_add_parts, METH_VARARGS,
     "scaled_add_parts(dst, parts, b, spans, ca, cb): as scaled_add, with a[s:e] given as parts[i]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "adasum._kernels",
    "Single-pass float64-accurate dot products and combine for float32/float64 buffers.", -1, methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    select_isa();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "ISA", isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
