/*
 * The MPI library of the process (the one mpi4py loaded), bound at run time by bind_mpi() (its function
 * types are in _kernels.h), the waiting rule (wait_rule(), which adasum.runtime.waiting.wait_all calls) and
 * the agreement's wait.
 *
 * The agreement is the first collective of every call: an MPI_Iallreduce(MAX) of four int64 (their meaning
 * is adasum/call/agreement.py's), waited for here without the GIL, as a blocking allreduce would wait, for a
 * patience the stall inspector (adasum/runtime/stall.py) sets; a wait that runs out of patience hands its request
 * to the inspector, which goes on waiting and names the ranks that have not arrived. Python's waits go
 * through the same rule (wait_requests()); where MPI cannot be bound they wait through mpi4py by a copy
 * of it (tests/core/test_stall.py pins the two alike).
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
 * The waiting rule of adasum.runtime.waiting, the one implementation of it: test the `n` requests whose
 * handles lie at `reqs[i]` (MPI_Test sets a completed one to MPI_REQUEST_NULL there) until all are complete,
 * without the GIL. `wait` is (spin, first nap, longest nap) in seconds: it tests without pause for `spin`
 * seconds, then between sleeps that double from the first nap to the longest, so that a thread computing
 * beside this one keeps the core; a longest nap of 0 tests without sleeping. After `patience` seconds (> 0)
 * it stops waiting and returns 1; 0 when all are complete, or MPI's error code (> 1).
 */
int
wait_rule(void *const *reqs, Py_ssize_t n, double patience, const double *wait)
{
    long long status[16] = {0};
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double nap = wait[1];
    Py_ssize_t first = 0; /* requests before it are complete */
    for (unsigned long spins = 1;; spins++) {
        int flag = 1, rc;
        while (first < n) {
            if ((rc = mpi.test(reqs[first], &flag, status)))
                return rc;
            if (!flag)
                break;
            first++;
        }
        if (first == n)
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
        if (patience > 0 && ((spins & 1023) == 0 || wait[2] > 0) && waited >= patience)
            return 1;
    }
}

/*
 * The agreement of a call: MPI_Iallreduce(MAX) of scratch[0:4] into scratch[4:8] on comm, waited for by
 * wait_rule(). After `patience` seconds (> 0) it stops waiting: 1 is returned and the request's handle is
 * left in scratch[8] for the caller to go on waiting and tell who has not arrived. 0 when complete, or
 * MPI's error code (> 1). scratch must outlive the request.
 */
int
agree_spin(int64_t *scratch, intptr_t int64, intptr_t max, intptr_t comm, double patience, const double *wait)
{
    intptr_t req = 0; /* MPICH's handle is an int: its upper half stays 0 */
    int rc = mpi.iallreduce(scratch, scratch + 4, 4, int64, max, comm, &req);
    if (rc)
        return rc;
    void *reqs[1] = {&req};
    rc = wait_rule(reqs, 1, patience, wait);
    if (rc == 1)
        scratch[8] = (int64_t)req;
    return rc;
}

/*
 * wait_requests(addresses, patience, spin, nap, nap_max) -> 0 (all complete), 1 (still waiting after
 * patience seconds, > 0; 0 waits for ever) or MPI's error code: wait_rule() on the requests whose handles
 * lie at the int64 `addresses` (mpi4py's MPI._addressof of its Request objects, which then read as
 * complete), without the GIL. adasum.runtime.waiting.wait_all waits through it.
 */
PyObject *
k_wait_requests(PyObject *self, PyObject *args)
{
    PyObject *oaddr;
    double patience, wait[3];
    if (!PyArg_ParseTuple(args, "Odddd:wait_requests", &oaddr, &patience, &wait[0], &wait[1], &wait[2]))
        return NULL;
    Py_buffer b;
    if (!mpi_ready("wait_requests") || PyObject_GetBuffer(oaddr, &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (b.len % (Py_ssize_t)sizeof(int64_t) || b.itemsize != (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "wait_requests: addresses must be int64");
        return NULL;
    }
    Py_ssize_t n = b.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *addr = (const int64_t *)b.buf;
    void *small[8], **reqs = n <= 8 ? small : PyMem_Malloc((size_t)n * sizeof(void *));
    if (reqs == NULL) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        reqs[i] = (void *)(intptr_t)addr[i];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = wait_rule(reqs, n, patience, wait);
    Py_END_ALLOW_THREADS
    if (reqs != small)
        PyMem_Free(reqs);
    PyBuffer_Release(&b);
    return PyLong_FromLong(rc);
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
