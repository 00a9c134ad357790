/*
 * The MPI library of the process (the one mpi4py loaded), bound at run time by bind_mpi() (its function
 * types are in _kernels.h), and the agreement's wait.
 *
 * The agreement is the first collective of every call: an MPI_Iallreduce(MAX) of four int64 (their meaning
 * is adasum/call/agreement.py's), waited for here without the GIL, as a blocking allreduce would wait, for a
 * patience the stall inspector (adasum/runtime/stall.py) sets; a wait that runs out of patience hands its request
 * to the inspector, which goes on waiting and names the ranks that have not arrived. The Python side waits
 * the same way through mpi4py where MPI cannot be bound (tests/core/test_stall.py pins the two alike).
 */
#include "_kernels.h"

#include <sched.h>
#include <time.h>

mpi_functions mpi;

/* bind_mpi(sendrecv, send, recv, iallreduce, test): the functions' addresses; False where not bound. */
PyObject *
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
 * until it completes, without holding the GIL, by the rule of adasum.runtime.waiting: `wait` is (spin, first nap,
 * longest nap) in seconds. It tests without pause for `spin` seconds, then between sleeps that double
 * from the first nap to the longest, so that a thread computing beside this one keeps the core; a longest
 * nap of 0 tests without sleeping. After `patience` seconds (> 0) it stops waiting: 1 is returned and the
 * request's handle is left in scratch[8] for the caller to go on waiting and tell who has not arrived. 0
 * when complete, or MPI's error code (> 1). scratch must outlive the request.
 */
int
agree_spin(int64_t *scratch, intptr_t int64, intptr_t max, intptr_t comm, double patience, const double *wait)
{
    long long status[16] = {0};
    intptr_t req = 0; /* MPICH's handle is an int: its upper half stays 0 */
    int flag = 0, rc = mpi.iallreduce(scratch, scratch + 4, 4, int64, max, comm, &req);
    if (rc)
        return rc;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double nap = wait[1];
    for (unsigned long spins = 1;; spins++) {
        if ((rc = mpi.test(&req, &flag, status)))
            return rc;
        if (flag)
            return 0;
        double waited = (spins & 15) == 0 || wait[2] > 0 ? seconds_since(&t0) : 0.0;
        if (wait[2] > 0 && waited >= wait[0]) {
            struct timespec d = {0, (long)(nap * 1e9)};
            nanosleep(&d, NULL);
            nap = nap * 2 < wait[2] ? nap * 2 : wait[2];
        } else if ((spins & 15) == 0) {
            /* Hand the core over now and then: with more ranks than cores (oversubscribed, as on a laptop
             * or a CI machine) the rank being waited for may need it. At 4 ranks on 2 cores a pure spin
             * took a 4 ms agreement, against 13-20 us with this and 31-44 us for a blocking MPI_Allreduce. */
            sched_yield();
        }
        if (patience > 0 && ((spins & 1023) == 0 || wait[2] > 0) && waited >= patience) {
            scratch[8] = (int64_t)req;
            return 1;
        }
    }
}

/* 1 if bind_mpi() bound the MPI library; else 0 with RuntimeError naming the `caller`. */
int
mpi_ready(const char *caller)
{
    if (mpi.iallreduce)
        return 1;
    PyErr_Format(PyExc_RuntimeError, "%s: bind_mpi() was not called", caller);
    return 0;
}

/* The agreement's scratch (writable int64, AGREE_SCRATCH of them); 1, or 0 with an exception set. */
int
get_scratch(PyObject *obj, Py_buffer *view, const char *caller)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return 0;
    if (view->len >= AGREE_SCRATCH * (Py_ssize_t)sizeof(int64_t))
        return 1;
    PyBuffer_Release(view);
    PyErr_Format(PyExc_ValueError, "%s: scratch must hold %d int64", caller, AGREE_SCRATCH);
    return 0;
}

/* agree(scratch, comm, int64, max, patience, spin, nap, nap_max) -> 0 (done), 1 (still waiting: the
 * request is in scratch[8]) or MPI's error code; see agree_spin(). */
PyObject *
k_agree(PyObject *self, PyObject *args)
{
    PyObject *oscratch;
    long long comm, int64, max;
    double patience, wait[3];
    if (!PyArg_ParseTuple(args, "OLLLdddd:agree", &oscratch, &comm, &int64, &max, &patience, &wait[0], &wait[1],
                          &wait[2]))
        return NULL;
    Py_buffer b;
    if (!mpi_ready("agree") || !get_scratch(oscratch, &b, "agree"))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = agree_spin((int64_t *)b.buf, (intptr_t)int64, (intptr_t)max, (intptr_t)comm, patience, wait);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromLong(rc);
}
