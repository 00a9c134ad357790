/*
 * adasum.kernels._kernels, one extension module built from several C files (setup.py lists them):
 *
 *   _kernels.c           the module: its method table and the small helpers of the Python side (layout,
 *                        address, key, use_isa)
 *   _kernels_loops.c     the two passes over a span, dots and scaled_add, in the one summation order, for
 *                        the portable, AVX2 and AVX-512 instruction sets; the choice among them
 *   _kernels_operands.c  the arguments of a kernel call: spans, and operands that are one buffer or one
 *                        buffer per span (the caller's tensors where they lie)
 *   _kernels_pair.c      the kernels over spans: dots, scaled_add, pair (the pairwise rule), copy
 *   _kernels_mpi.c       the MPI library's functions, bound at run time, and the agreement's wait
 *   _kernels_small.c     the compiled small calls: a whole small Adasum call by recursive doubling, and a
 *                        whole small sum or mean (the agreement and one allreduce of the packed tensors)
 *
 * This header holds what they share. Everything in it is internal to the module (hidden from other
 * shared objects), so the calls between the files cost what calls inside one file cost.
 */
#ifndef ADASUM_KERNELS_H
#define ADASUM_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define INTERNAL __attribute__((visibility("hidden")))
#else
#define INTERNAL
#endif

/* --- _kernels_loops.c --------------------------------------------------------------------------------- */

/*
 * The element types of the kernels: float32, float64, float16 (buffer format 'e') and bfloat16, which
 * Python has no buffer format for and which comes as its uint16 bits (format 'H'; torch's bfloat16 tensors
 * are reached through their uint16 views).
 */
enum { T_F32, T_F64, T_F16, T_BF16, T_COUNT };

/* out[0..2] = [a·b, a·a, b·b] over n elements, in float64. */
typedef void (*dots_fn)(const void *a, const void *b, Py_ssize_t n, double *out);
/* dst = ca·a + cb·b over n elements, in float64, rounded once to the element type. */
typedef void (*scaled_add_fn)(void *dst, const void *a, const void *b, Py_ssize_t n, double ca, double cb);

/* The loops in use per element type (chosen by select_isa()), and the name of their instruction set. */
extern INTERNAL dots_fn dots_of[T_COUNT];
extern INTERNAL scaled_add_fn scaled_add_of[T_COUNT];
extern INTERNAL const char *isa;

INTERNAL void select_isa(const char *cap);

/* The bytes [start, end) of one buffer, for layout() and the small calls' check; by_start orders them
 * (qsort) by start (_kernels.c). */
typedef struct {
    uintptr_t start, end;
} extent;
INTERNAL int by_start(const void *x, const void *y);
INTERNAL PyObject *k_sum_rows16(PyObject *self, PyObject *args);

/* --- _kernels_operands.c ------------------------------------------------------------------------------ */

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
    int type; /* T_F32, T_F64, T_F16 or T_BF16 */
} operand;

/* Where span i of the operand starts. */
static inline char *
operand_at(const operand *op, const int64_t *sp, Py_ssize_t i)
{
    return op->parts ? (char *)op->parts[i].buf : (char *)op->whole.buf + sp[2 * i] * op->itemsize;
}

/* The spans and the operands of one kernel call, acquired together and released together. */
typedef struct {
    Py_buffer spans;
    const int64_t *sp;
    Py_ssize_t n;
    operand ops[4];
    int count;
} call_args;

INTERNAL int typed_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, Py_ssize_t count,
                          const char *name);
INTERNAL int get_operand(PyObject *obj, operand *op, int writable, const char *name, const int64_t *sp,
                         Py_ssize_t n);
INTERNAL int same_type(const operand *ops, int count);
INTERNAL int acquire_call(call_args *c, PyObject *ospans, PyObject **objs, const char **names, int count,
                          int first_writable);
INTERNAL void release_call(call_args *c);

/* The elements of a call that only moves and sums them (the compiled small plain call): any numeric type,
 * known by the buffer format numpy exports for it and its size; `type` is T_F32 or T_F64 for the floats
 * (which a mean divides), -1 for integers. */
typedef struct {
    int type;
    char format;
    Py_ssize_t itemsize;
} element;

INTERNAL int get_tensor_parts(PyObject *obj, operand *op, int writable, const element *el, const int64_t *sp,
                              Py_ssize_t n, const char *name);
INTERNAL int get_element_whole(PyObject *obj, operand *op, const element *el, Py_ssize_t count, const char *name);

/* --- _kernels_pair.c ---------------------------------------------------------------------------------- */

INTERNAL void pair_spans(const operand *left, const operand *right, const operand *dst, const int64_t *sp,
                         Py_ssize_t n, long long count_left, long long count_right);
INTERNAL void copy_spans(const operand *dst, const operand *src, const int64_t *sp, Py_ssize_t n);

INTERNAL PyObject *k_dots(PyObject *self, PyObject *args);
INTERNAL PyObject *k_scaled_add(PyObject *self, PyObject *args);
INTERNAL PyObject *k_pair(PyObject *self, PyObject *args);
INTERNAL PyObject *k_copy(PyObject *self, PyObject *args);

/* --- _kernels_mpi.c ----------------------------------------------------------------------------------- */

/*
 * The MPI library of the process (the one mpi4py loaded), called directly. Handles (communicators,
 * datatypes, ops) are passed as integers the width of a pointer: MPICH's are ints and Open MPI's pointers,
 * and on the 64-bit ABIs this module binds on (x86-64, AArch64) an int argument is the low half of the
 * register or stack slot it travels in, so one prototype serves both.
 */
typedef int (*mpi_sendrecv_fn)(const void *, int, intptr_t, int, int, void *, int, intptr_t, int, int, intptr_t,
                               void *);
typedef int (*mpi_send_fn)(const void *, int, intptr_t, int, int, intptr_t);
typedef int (*mpi_recv_fn)(void *, int, intptr_t, int, int, intptr_t, void *);
typedef int (*mpi_iallreduce_fn)(const void *, void *, int, intptr_t, intptr_t, intptr_t, void *);
typedef int (*mpi_test_fn)(void *, int *, void *);
typedef struct {
    mpi_sendrecv_fn sendrecv;
    mpi_send_fn send;
    mpi_recv_fn recv;
    mpi_iallreduce_fn iallreduce;
    mpi_test_fn test;
} mpi_functions;
extern INTERNAL mpi_functions mpi;

/* The agreement's scratch: what this rank sends [0:4], what all saw [4:8], a request left waiting [8]. */
enum { AGREE_SCRATCH = 9 };

INTERNAL int mpi_ready(const char *caller);
INTERNAL int get_scratch(PyObject *obj, Py_buffer *view, const char *caller);
INTERNAL int wait_rule(void *const *reqs, Py_ssize_t n, double patience, const double *wait);
INTERNAL int agree_spin(int64_t *scratch, intptr_t int64, intptr_t max, intptr_t comm, double patience,
                        const double *wait);

INTERNAL PyObject *k_bind_mpi(PyObject *self, PyObject *args);
INTERNAL PyObject *k_agree(PyObject *self, PyObject *args);
INTERNAL PyObject *k_wait_requests(PyObject *self, PyObject *args);

/* --- _kernels_small.c --------------------------------------------------------------------------------- */

INTERNAL PyObject *k_small_doubling(PyObject *self, PyObject *args);
INTERNAL PyObject *k_small_plain(PyObject *self, PyObject *args);

#endif
