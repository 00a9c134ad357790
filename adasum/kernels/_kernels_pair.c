/*
 * The kernels over spans, each one call from Python with the GIL released (operands as in _kernels.h):
 *
 *   dots(a, b, spans, out)               out[i] = [a·b, a·a, b·b] over a[s:e], b[s:e] for spans[i] = (s, e)
 *   scaled_add(dst, a, b, spans, ca, cb)  dst[s:e] = ca[i]·a[s:e] + cb[i]·b[s:e]   (dst may be a or b)
 *   pair(left, right, dst, spans, nl, nr) dst[s:e] = Adasum(left[s:e], right[s:e]): dots, coefficients and
 *                                        combine in one call (also a step of the compiled small call)
 *   copy(dst, src, spans)                 dst[s:e] = src[s:e]   (packing tensors into a buffer and back)
 */
#include "_kernels.h"

#include <math.h>
#include <string.h>

/* dots(a, b, spans, out): out is writable float64, 3 per span (the method table in _kernels.c says more). */
PyObject *
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
    dots_fn dots = dots_of[c.ops[0].type];
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n; i++)
        dots(operand_at(&c.ops[0], c.sp, i), operand_at(&c.ops[1], c.sp, i), c.sp[2 * i + 1] - c.sp[2 * i],
             o + 3 * i);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    release_call(&c);
    Py_RETURN_NONE;
}

/* scaled_add(dst, a, b, spans, ca, cb): ca and cb hold one float64 per span. */
PyObject *
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
    scaled_add_fn scaled_add = scaled_add_of[c.ops[0].type];
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
 * underflowed (adasum.rule.combine.TINY). */
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
    /* subnormal data: 2^-k is beyond the range, so scale up in two steps (as adasum.rule.combine._scale_down) */
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
void
pair_spans(const operand *left, const operand *right, const operand *dst, const int64_t *sp, Py_ssize_t n,
           long long count_left, long long count_right)
{
    double total = (double)(count_left + count_right);
    double w_left = (double)count_left / total, w_right = (double)count_right / total;
    dots_fn dots = dots_of[dst->type];
    scaled_add_fn scaled_add = scaled_add_of[dst->type];
    for (Py_ssize_t i = 0; i < n; i++) {
        void *d = operand_at(dst, sp, i);
        const void *x = operand_at(left, sp, i), *y = operand_at(right, sp, i);
        Py_ssize_t len = sp[2 * i + 1] - sp[2 * i];
        double g[3];
        dots(x, y, len, g);
        if (dst->type == T_F64 && !(isfinite(g[0]) && isfinite(g[1]) && isfinite(g[2]) && g[1] >= TINY && g[2] >= TINY))
            rescaled_dots_f64((const double *)x, (const double *)y, len, g);
        double q_left = g[1] != 0.0 ? g[0] / g[1] : 0.0, q_right = g[2] != 0.0 ? g[0] / g[2] : 0.0;
        scaled_add(d, x, y, len, 1.0 - w_left * q_left, 1.0 - w_right * q_right);
    }
}

/*
 * pair(left, right, dst, spans, count_left, count_right): dst = Adasum(left, right) span by span, where
 * left and right stand for count_left and count_right ranks. The coefficients are those of
 * adasum.rule.combine.coefficients, computed with the same operations in the same order (so the same bits).
 */
PyObject *
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

/* dst = src span by span (the loop of copy(), below). */
void
copy_spans(const operand *dst, const operand *src, const int64_t *sp, Py_ssize_t n)
{
    size_t size = (size_t)dst->itemsize;
    for (Py_ssize_t i = 0; i < n; i++)
        memmove(operand_at(dst, sp, i), operand_at(src, sp, i), (size_t)(sp[2 * i + 1] - sp[2 * i]) * size);
}

/* copy(dst, src, spans): dst[s:e] = src[s:e] for each span (packing tensors into a buffer, or back). */
PyObject *
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
