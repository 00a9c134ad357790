/*
 * The compiled small call: a whole small Adasum call by recursive doubling, as adasum.schedules.small_call.SmallCall
 * makes it, with no Python between its steps. It executes a program SmallCall derives from adasum/rule/tree.py
 * (the fold partner, and per level the partner, the two sides' rank counts and which side this rank
 * holds), so it sends the messages and makes the kernel calls of the general doubling schedule
 * (adasum/schedules/doubling.py) and ranks may mix the two.
 */
#include "_kernels.h"

/* The fields of small_doubling()'s program (int64), then four per level: partner, count_left,
 * count_right, upper. */
enum { P_COMM, P_BYTE, P_INT64, P_MAX, P_TAG, P_NBYTES, P_OUT, P_FOLD, P_FOLD_SELF, P_FOLD_OTHER, P_LEVELS,
       P_FIELDS };

/* The steps of small_doubling() (its docstring), on operands already acquired, without the GIL. */
static int
run_small(const int64_t *prog, long long digest, int64_t *scratch, double patience, const double *wait,
          const operand *buf,
          const operand *scr, const operand *src, const operand *dst, const int64_t *sp, Py_ssize_t n)
{
    intptr_t comm = (intptr_t)prog[P_COMM], byte = (intptr_t)prog[P_BYTE];
    int tag = (int)prog[P_TAG], count = (int)prog[P_NBYTES];
    long long status[16] = {0};
    int rc;
    if (patience >= 0) { /* a negative patience: the agreement is done (it went on in Python) */
        /* what adasum.runtime.agreement.load(scratch, digest, False, 0) writes */
        scratch[0] = digest, scratch[1] = -digest, scratch[2] = 0, scratch[3] = 0;
        rc = agree_spin(scratch, (intptr_t)prog[P_INT64], (intptr_t)prog[P_MAX], comm, patience, wait);
        if (rc == 1)
            return -2;
        if (rc)
            return rc;
    }
    if (!(scratch[6] == 0 && scratch[4] == -scratch[5])) /* adasum.runtime.agreement.agreed(scratch) */
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
 * small_doubling(buf, scr, src, dst, spans, program, digest, scratch, patience, spin, nap, nap_max): a small
 * Adasum call, whole, by recursive doubling, as adasum.schedules.small_call.SmallCall makes it (the same collective, messages
 * and kernel calls as the general schedule, so ranks may mix the two), with no Python in between: the
 * agreement allreduce of [digest, -digest, 0, 0] (agree_spin(), in scratch), packing src into buf, the
 * fold, one exchange and pair() per level, the result into dst. Returns 0, -1 if the ranks disagree
 * (nothing was sent; the caller explains), -2 if the agreement is still waiting after `patience` seconds
 * (its request in scratch[8]: the caller waits on, then calls again with a negative patience to skip the
 * agreement), or MPI's error code.
 */
PyObject *
k_small_doubling(PyObject *self, PyObject *args)
{
    PyObject *objs[4], *ospans, *oprog, *oscratch;
    long long digest;
    double patience, wait[3];
    static const char *names[] = {"buf", "scr", "dst", "src"};
    if (!PyArg_ParseTuple(args, "OOOOOOLOdddd:small_doubling", &objs[0], &objs[1], &objs[3], &objs[2], &ospans,
                          &oprog, &digest, &oscratch, &patience, &wait[0], &wait[1], &wait[2]))
        return NULL;
    Py_buffer prog, scratch;
    if (!mpi_ready("small_doubling") || !get_scratch(oscratch, &scratch, "small_doubling"))
        return NULL;
    if (PyObject_GetBuffer(oprog, &prog, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&scratch);
        return NULL;
    }
    const int64_t *p = (const int64_t *)prog.buf;
    Py_ssize_t fields = prog.len / (Py_ssize_t)sizeof(int64_t);
    if (fields < P_FIELDS || fields != P_FIELDS + 4 * p[P_LEVELS]) {
        PyBuffer_Release(&prog);
        PyBuffer_Release(&scratch);
        PyErr_SetString(PyExc_ValueError, "small_doubling: malformed program");
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
        rc = run_small(p, digest, (int64_t *)scratch.buf, patience, wait, &c.ops[0], &c.ops[1], &c.ops[3],
                       &c.ops[2], c.sp, c.n);
        Py_END_ALLOW_THREADS
    }
    release_call(&c);
    PyBuffer_Release(&prog);
    PyBuffer_Release(&scratch);
    if (!ok)
        return NULL;
    return PyLong_FromLong(rc);
}
