/*
 * adasum.kernels._kernels: the compiled part of adasum, for float32 and float64 host buffers (the Python side is
 * adasum/kernels/native.py; where this module was not built, the numpy kernels of adasum/adapters do the same work):
 *
 *   dots, scaled_add, pair, copy   the passes over every span of every layer (_kernels_pair.c, with the
 *                                  loops of _kernels_loops.c)
 *   bind_mpi, agree, wait_requests the MPI library, bound at run time, the waiting rule and the agreement's
 *                                  wait (_kernels_mpi.c)
 *   small_doubling, small_plain    a whole small Adasum call, or a whole small sum or mean, in one call
 *                                  (_kernels_small.c)
 *   sum_rows16                     the rounded float32 sum of 16-bit rows, for 16-bit sums (_kernels_loops.c)
 *   layout, address, key, use_isa  small helpers of the Python side (here)
 *   finite                         whether every element of tensors in memory is finite: one read (here)
 *
 * Any operand may be one buffer that the spans index or a list of buffers, one per span: the caller's own
 * tensors, read and written where they lie instead of being packed into one buffer first. layout() tells
 * whether tensors lie back to back, apart, or overlapping. _kernels.h lists the files and what they share.
 */
#include "_kernels.h"

#include <stdlib.h>
#include <string.h>

int
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

/*
 * finite(addresses, counts, width): whether every element of the buffers at `addresses` (counts[i] elements
 * of `width` bytes each: 8 float64, 4 float32, 2 float16 or bfloat16 as `mask` says) is finite. Reads only:
 * an element is not finite when its exponent bits are all ones. The loops are branch-free within a block, so
 * the compiler vectorises them; a block that found one stops the pass.
 */
#define FINITE_BLOCK 4096
#define FINITE_LOOP(T, p, n, mask)                                                                             \
    for (Py_ssize_t s = 0; s < (n); s += FINITE_BLOCK) {                                                       \
        Py_ssize_t e = s + FINITE_BLOCK < (n) ? s + FINITE_BLOCK : (n);                                        \
        T bad = 0;                                                                                             \
        for (Py_ssize_t j = s; j < e; j++)                                                                     \
            bad |= (T)(((p)[j] & (mask)) == (mask));                                                           \
        if (bad)                                                                                               \
            return 0;                                                                                          \
    }

static int
all_finite_at(const void *buf, Py_ssize_t n, int width, uint64_t mask)
{
    if (width == 8) {
        const uint64_t *p = buf;
        FINITE_LOOP(uint64_t, p, n, mask)
    } else if (width == 4) {
        const uint32_t *p = buf;
        uint32_t m = (uint32_t)mask;
        FINITE_LOOP(uint32_t, p, n, m)
    } else {
        const uint16_t *p = buf;
        uint16_t m = (uint16_t)mask;
        FINITE_LOOP(uint16_t, p, n, m)
    }
    return 1;
}

static PyObject *
k_finite(PyObject *self, PyObject *args)
{
    PyObject *oaddr, *ocount;
    int width;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "OOiK:finite", &oaddr, &ocount, &width, &mask))
        return NULL;
    if (width != 2 && width != 4 && width != 8)
        return PyErr_Format(PyExc_ValueError, "finite: width must be 2, 4 or 8 bytes, got %d", width);
    PyObject *addrs = PySequence_Fast(oaddr, "finite needs a sequence of addresses");
    if (!addrs)
        return NULL;
    PyObject *counts = PySequence_Fast(ocount, "finite needs a sequence of counts");
    if (!counts) {
        Py_DECREF(addrs);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(addrs);
    int ok = 1;
    if (PySequence_Fast_GET_SIZE(counts) != n) {
        PyErr_SetString(PyExc_ValueError, "finite: as many counts as addresses");
        ok = -1;
    }
    for (Py_ssize_t i = 0; ok == 1 && i < n; i++) {
        void *at = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(addrs, i));
        Py_ssize_t count = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(counts, i));
        if (PyErr_Occurred()) {
            ok = -1;
            break;
        }
        if (count > 0) {
            Py_BEGIN_ALLOW_THREADS
            ok = all_finite_at(at, count, width, mask);
            Py_END_ALLOW_THREADS
        }
    }
    Py_DECREF(addrs);
    Py_DECREF(counts);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
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

/* use_isa(cap): see the method table. */
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
     "agree(scratch, comm, int64, max, patience, spin, nap, nap_max) -> 0, 1 or an MPI error code: "
     "MPI_Iallreduce(MAX) of scratch[0:4] into scratch[4:8], waited for without the GIL by the rule of "
     "adasum.runtime.waiting (nap_max 0: without sleeping); 1 if it is still waiting after patience seconds (> 0; 0 "
     "waits for ever), its request handle in scratch[8]."},
    {"wait_requests", k_wait_requests, METH_VARARGS,
     "wait_requests(addresses, patience, spin, nap, nap_max) -> 0, 1 or an MPI error code: the requests whose "
     "handles lie at the int64 addresses (MPI._addressof of mpi4py's Requests) tested until all are complete, "
     "without the GIL, by the rule of adasum.runtime.waiting; 1 if some is still waiting after patience "
     "seconds (> 0; 0 waits for ever)."},
    {"small_doubling", k_small_doubling, METH_VARARGS,
     "small_doubling(buf, scr, src, dst, spans, program, digest, scratch, patience, spin, nap, nap_max) -> 0, "
     "-1 (the ranks "
     "disagree), -2 (still waiting for the agreement after patience seconds; its request in scratch[8]) or an "
     "MPI error code: a small Adasum call by recursive doubling, agreement included, without Python in "
     "between (see the source for the program's fields)."},
    {"small_plain", k_small_plain, METH_VARARGS,
     "small_plain(buf, tensors, spans, program, digest, scratch, patience, stage, inplace, spin, nap, nap_max) "
     "-> (status, layout): a small sum or mean of float32 or float64 tensors (or sum of integers), agreement "
     "included, as one "
     "MPI_Iallreduce(SUM) of them packed into buf (in place and back to back: where they lie), without Python "
     "in between. tensors: numpy arrays or the addresses of contiguous tensors, one per span; layout: as "
     "layout() says. status: 0, -1 (the ranks disagree), -2 (still waiting for the agreement after patience "
     "seconds), -3 (still waiting for the allreduce; both with the request in scratch[8]), -4 (in place on "
     "overlapping tensors: not taken, nothing sent) or an MPI error code (see the source for the program's "
     "fields and the stages)."},
    {"sum_rows16", k_sum_rows16, METH_VARARGS,
     "sum_rows16(rows, out, type, divisor) -> whether a NaN came out: the sum of the rows of a 2-D uint16 "
     "array of float16 (type 0) or bfloat16 (type 1) bits, in float32 in row order, divided by divisor, "
     "rounded once into out (the rule of adasum/rule/sum16.py, bit for bit on every value but NaN)."},
    {"copy", k_copy, METH_VARARGS,
     "copy(dst, src, spans): dst[s:e] = src[s:e] for each span; operands as for dots."},
    {"finite", k_finite, METH_VARARGS,
     "finite(addresses, counts, width, mask): whether no element of the buffers at addresses (counts[i] "
     "elements of width bytes) has all the exponent bits of mask set (NaN or Inf). Reads only."},
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
    PyModuleDef_HEAD_INIT, "adasum.kernels._kernels",
    "Single-pass float64-accurate dot products and combine for float32/float64 buffers.", -1, methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    select_isa("auto");
    return PyModule_Create(&module);
}
