/*
 * adasum._kernels: the two passes Adasum makes over every piece of every layer, for float32 and float64.
 *
 *   dots(a, b, spans, out)             out[i] = [a·b, a·a, b·b] over a[s:e], b[s:e] for spans[i] = (s, e)
 *   scaled_add(dst, a, b, spans, ca, cb)  dst[s:e] = ca[i]·a[s:e] + cb[i]·b[s:e]   (dst may be a)
 *
 * Both read their inputs once, in one pass, with the GIL released. Products and sums are taken in double
 * (a product of two floats is exact in double), so the dot products need no float64 copy of the buffer
 * and the combine rounds once to the buffer's type.
 *
 * The results do not depend on the instruction set the loops are compiled for: the dot products keep eight
 * independent partial sums in a fixed order and add them up in a fixed order, and the build turns off
 * floating-point contraction (no FMA), so every rank of a job computes bitwise the same numbers from the
 * same data even when its CPUs differ.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Eight partial sums per quantity (two vectors of four lanes), added up in a fixed order at the end. */
struct acc {
    v4d ab0, ab1, aa0, aa1, bb0, bb1;
};

static inline void
acc_add(struct acc *s, v4d x0, v4d x1, v4d y0, v4d y1)
{
    s->ab0 += x0 * y0;
    s->ab1 += x1 * y1;
    s->aa0 += x0 * x0;
    s->aa1 += x1 * x1;
    s->bb0 += y0 * y0;
    s->bb1 += y1 * y1;
}

static inline double
hsum(v4d lo, v4d hi)
{
    v4d v = lo + hi;
    return (v[0] + v[2]) + (v[1] + v[3]);
}

static inline void
acc_finish(const struct acc *s, const double *tail, Py_ssize_t n_tail, double *out)
{
    double ab = hsum(s->ab0, s->ab1), aa = hsum(s->aa0, s->aa1), bb = hsum(s->bb0, s->bb1);
    for (Py_ssize_t i = 0; i < n_tail; i++) {
        double x = tail[i], y = tail[n_tail + i];
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    out[0] = ab;
    out[1] = aa;
    out[2] = bb;
}

MULTIVERSION static void
dots_f32(const float *a, const float *b, Py_ssize_t n, double *out)
{
    struct acc s = {{0}, {0}, {0}, {0}, {0}, {0}};
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v4f a0, a1, b0, b1;
        memcpy(&a0, a + i, sizeof a0);
        memcpy(&a1, a + i + 4, sizeof a1);
        memcpy(&b0, b + i, sizeof b0);
        memcpy(&b1, b + i + 4, sizeof b1);
        acc_add(&s, __builtin_convertvector(a0, v4d), __builtin_convertvector(a1, v4d),
                __builtin_convertvector(b0, v4d), __builtin_convertvector(b1, v4d));
    }
    double tail[16];
    Py_ssize_t t = n - i;
    for (Py_ssize_t j = 0; j < t; j++) {
        tail[j] = (double)a[i + j];
        tail[t + j] = (double)b[i + j];
    }
    acc_finish(&s, tail, t, out);
}

MULTIVERSION static void
dots_f64(const double *a, const double *b, Py_ssize_t n, double *out)
{
    struct acc s = {{0}, {0}, {0}, {0}, {0}, {0}};
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v4d a0, a1, b0, b1;
        memcpy(&a0, a + i, sizeof a0);
        memcpy(&a1, a + i + 4, sizeof a1);
        memcpy(&b0, b + i, sizeof b0);
        memcpy(&b1, b + i + 4, sizeof b1);
        acc_add(&s, a0, a1, b0, b1);
    }
    double tail[16];
    Py_ssize_t t = n - i;
    for (Py_ssize_t j = 0; j < t; j++) {
        tail[j] = a[i + j];
        tail[t + j] = b[i + j];
    }
    acc_finish(&s, tail, t, out);
}

MULTIVERSION static void
scaled_add_f32(float *dst, const float *a, const float *b, Py_ssize_t n, double ca, double cb)
{
    for (Py_ssize_t i = 0; i < n; i++)
        dst[i] = (float)(ca * (double)a[i] + cb * (double)b[i]);
}

MULTIVERSION static void
scaled_add_f64(double *dst, const double *a, const double *b, Py_ssize_t n, double ca, double cb)
{
    for (Py_ssize_t i = 0; i < n; i++)
        dst[i] = ca * a[i] + cb * b[i];
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
    if (PyObject_GetBuffer(ospans, &spans, PyBUF_C_CONTIGUOUS) < 0)
        goto release_b;
    Py_ssize_t n = spans.len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (spans.len != n * (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "spans must be int64 pairs");
        goto release_spans;
    }
    if (!typed_buffer(oout, &out, 1, 3 * sizeof(double), n, "out"))
        goto release_spans;
    const int64_t *sp = (const int64_t *)spans.buf;
    Py_ssize_t len = a.len / size_a;
    if (check_spans(sp, n, len)) {
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
    }
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
    if (PyObject_GetBuffer(ospans, &spans, PyBUF_C_CONTIGUOUS) < 0)
        goto release_b;
    Py_ssize_t n = spans.len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (spans.len != n * (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "spans must be int64 pairs");
        goto release_spans;
    }
    if (!typed_buffer(oca, &ca, 0, sizeof(double), n, "ca"))
        goto release_spans;
    if (!typed_buffer(ocb, &cb, 0, sizeof(double), n, "cb"))
        goto release_ca;
    const int64_t *sp = (const int64_t *)spans.buf;
    if (check_spans(sp, n, dst.len / size_d)) {
        const double *p = (const double *)ca.buf, *q = (const double *)cb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = sp[2 * i], e = sp[2 * i + 1];
            if (size_d == 4)
                scaled_add_f32((float *)dst.buf + s, (const float *)a.buf + s, (const float *)b.buf + s,
                               e - s, p[i], q[i]);
            else
                scaled_add_f64((double *)dst.buf + s, (const double *)a.buf + s,
                               (const double *)b.buf + s, e - s, p[i], q[i]);
        }
        Py_END_ALLOW_THREADS
        ok = 1;
    }
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

static PyMethodDef methods[] = {
    {"dots", k_dots, METH_VARARGS,
     "dots(a, b, spans, out): out[i] = [a.b, a.a, b.b] over a[s:e], b[s:e] for spans[i] = (s, e), in "
     "float64.\n\na, b: contiguous float32 or float64 buffers of one dtype and length; spans: int64 (n, 2); "
     "out: writable float64 (n, 3)."},
    {"scaled_add", k_scaled_add, METH_VARARGS,
     "scaled_add(dst, a, b, spans, ca, cb): dst[s:e] = ca[i]*a[s:e] + cb[i]*b[s:e] for spans[i] = (s, e), "
     "computed in float64 and rounded once to dst's dtype. dst may be a."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "adasum._kernels",
    "Single-pass float64-accurate dot products and combine for float32/float64 buffers.", -1, methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    return PyModule_Create(&module);
}
