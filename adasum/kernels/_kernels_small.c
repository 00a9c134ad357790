/*
 * The compiled small calls, each a whole call with no Python between its steps.
 *
 * small_doubling: a small Adasum call by recursive doubling, as adasum.schedules.small_call.SmallCall makes
 * it. It executes a program SmallCall derives from adasum/rule/tree.py (the fold partner, and per level the
 * partner, the two sides' rank counts and which side this rank holds), so it sends the messages and makes
 * the kernel calls of the general doubling schedule (adasum/schedules/doubling.py) and ranks may mix the two.
 *
 * small_plain: a small sum or mean (below), as adasum.call.small_plain.SmallPlain makes it.
 */
#include "_kernels.h"

/* The fields of small_doubling()'s program (int64), then four per level: partner, count_left,
 * count_right, upper. */
enum { P_COMM, P_BYTE, P_INT64, P_MAX, P_TAG, P_NBYTES, P_OUT, P_FOLD, P_FOLD_SELF, P_FOLD_OTHER, P_LEVELS,
       P_FIELDS };

/* Whether two non-empty parts of `op` overlap, pair by pair (for a few parts). */
static int
parts_overlap_pairwise(const operand *op)
{
    for (Py_ssize_t i = 0; i < op->n; i++) {
        uintptr_t s = (uintptr_t)op->parts[i].buf, e = s + (uintptr_t)op->parts[i].len;
        for (Py_ssize_t j = i + 1; j < op->n; j++) {
            uintptr_t s2 = (uintptr_t)op->parts[j].buf, e2 = s2 + (uintptr_t)op->parts[j].len;
            if (s < e && s2 < e2 && s < e2 && s2 < e)
                return 1;
        }
    }
    return 0;
}

/* How the parts of `op` lie, as layout() tells it: 2 back to back in order, 1 apart, 0 overlapping. */
static int
parts_layout(const operand *op)
{
    Py_ssize_t n = op->n, live = 0;
    const char *next = NULL;
    int adjacent = 1;
    for (Py_ssize_t i = 0; i < n && adjacent; i++) {
        const Py_buffer *v = &op->parts[i];
        if (v->len == 0)
            continue;
        if (next && (const char *)v->buf != next)
            adjacent = 0;
        next = (const char *)v->buf + v->len;
    }
    if (adjacent)
        return 2;
    extent *ext = n > 32 ? malloc((size_t)n * sizeof(extent)) : NULL;
    if (!ext) /* a few tensors (or no memory for the sort): every pair */
        return parts_overlap_pairwise(op) ? 0 : 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (op->parts[i].len > 0) {
            ext[live].start = (uintptr_t)op->parts[i].buf;
            ext[live].end = ext[live].start + (uintptr_t)op->parts[i].len;
            live++;
        }
    }
    qsort(ext, (size_t)live, sizeof(extent), by_start);
    int result = 1;
    for (Py_ssize_t i = 1; i < live && result; i++)
        if (ext[i].start < ext[i - 1].end)
            result = 0;
    free(ext);
    return result;
}

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
 * fold, one exchange and pair() per level, the result into dst. `src` and `dst` (the tensors, one part per
 * span: numpy arrays or the addresses of contiguous torch tensors, see get_tensor_parts()) may be one object:
 * in place; overlapping tensors are then not taken (-4, nothing sent: the Python path writes each result
 * back in turn). Returns 0, -1 if the ranks disagree (nothing was sent; the caller explains), -2 if the
 * agreement is still waiting after `patience` seconds (its request in scratch[8]: the caller waits on,
 * then calls again with a negative patience to skip the agreement), -4 as above, or MPI's error code.
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
        if (k >= 2 && PyTuple_Check(objs[k]) && PyTuple_GET_SIZE(objs[k]) > 0 &&
            PyLong_Check(PyTuple_GET_ITEM(objs[k], 0))) { /* addresses of tensors of buf's element type */
            element el = {c.ops[0].type, c.ops[0].type == T_F64 ? 'd' : 'f', c.ops[0].itemsize};
            ok = get_tensor_parts(objs[k], &c.ops[k], k < 3, &el, c.sp, c.n, names[k]);
        } else {
            ok = get_operand(objs[k], &c.ops[k], k < 3, names[k], c.sp, c.n);
        }
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
    if (ok && objs[2] == objs[3] && c.ops[3].parts && parts_layout(&c.ops[3]) == 0) {
        rc = -4; /* in place on overlapping tensors */
    } else if (ok) {
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

/*
 * The compiled small plain call: a whole sum or mean of one host group (float32, float64, or integers for a
 * sum), as adasum.call.small_plain.SmallPlain makes it, with the collectives of the Python path
 * (adasum/call/plain.py) for the same call: the agreement, then one MPI_Iallreduce(SUM) of the group packed
 * into one buffer, in place. So ranks may mix the two paths.
 */

/* The fields of small_plain()'s program (int64): the handles of the library's communicator, MPI_INT64_T,
 * MPI_MAX, the group's datatype and MPI_SUM, the value of MPI_IN_PLACE, the group's element count, the
 * mean's divisor (0: a sum), the elements (the element type T_F32, T_F64 or -1 for integers, the buffer
 * format numpy exports for them and their size) and the vote of tensors that lie back to back. */
enum { Q_COMM, Q_INT64, Q_MAX, Q_TYPE, Q_SUM, Q_IN_PLACE, Q_COUNT, Q_DIVISOR, Q_ELEMENT, Q_FORMAT, Q_ITEMSIZE,
       Q_VOTE, Q_FIELDS };

/* x[0:count] /= divisor in the element type (float32 or float64), as numpy's np.divide(x, divisor, out=x)
 * rounds it; by a power of two as the product with its reciprocal, which is exact and so the same value. */
static void
divide_by(void *x, int type, Py_ssize_t count, long long divisor)
{
    int power = (divisor & (divisor - 1)) == 0;
    if (type == T_F32) {
        float *p = (float *)x, d = (float)divisor, r = 1.0f / d;
        if (power)
            for (Py_ssize_t i = 0; i < count; i++)
                p[i] = p[i] * r;
        else
            for (Py_ssize_t i = 0; i < count; i++)
                p[i] = p[i] / d;
    } else {
        double *p = (double *)x, d = (double)divisor, r = 1.0 / d;
        if (power)
            for (Py_ssize_t i = 0; i < count; i++)
                p[i] = p[i] * r;
        else
            for (Py_ssize_t i = 0; i < count; i++)
                p[i] = p[i] / d;
    }
}

/* The steps of small_plain() (its docstring), on operands already acquired, without the GIL. `work` is
 * where the reduction happens: `buf`'s memory, or the tensors' own where buf is NULL. */
static int
run_plain(const int64_t *prog, long long digest, long long vote, int64_t *scratch, double patience, int stage,
          const double *wait, const operand *buf, const operand *tensors, int write_back, void *work,
          const int64_t *sp, Py_ssize_t n)
{
    intptr_t comm = (intptr_t)prog[Q_COMM];
    intptr_t req = 0; /* MPICH's handle is an int: its upper half stays 0 */
    void *reqs[1] = {&req};
    int rc;
    if (stage == 0) {
        /* agree_spin(), with the packing done while the agreement travels: buf is this call's own, so
         * packing it sends nothing, whatever the agreement finds */
        /* what adasum.runtime.agreement.load(scratch, digest, False, vote) writes */
        scratch[0] = digest, scratch[1] = -digest, scratch[2] = 0, scratch[3] = vote;
        if ((rc = mpi.iallreduce(scratch, scratch + 4, 4, (intptr_t)prog[Q_INT64], (intptr_t)prog[Q_MAX], comm,
                                 &req)))
            return rc;
        if (buf)
            copy_spans(buf, tensors, sp, n);
        rc = wait_rule(reqs, 1, patience, wait);
        if (rc == 1) {
            scratch[8] = (int64_t)req;
            return -2;
        }
        if (rc)
            return rc;
    }
    if (stage <= 1) {
        if (!(scratch[6] == 0 && scratch[4] == -scratch[5])) /* adasum.runtime.agreement.agreed(scratch) */
            return -1;
        rc = mpi.iallreduce((const void *)(intptr_t)prog[Q_IN_PLACE], work, (int)prog[Q_COUNT],
                            (intptr_t)prog[Q_TYPE], (intptr_t)prog[Q_SUM], comm, &req);
        if (rc)
            return rc;
        rc = wait_rule(reqs, 1, patience, wait);
        if (rc == 1) {
            scratch[8] = (int64_t)req;
            return -3;
        }
        if (rc)
            return rc;
    }
    if (prog[Q_DIVISOR] > 0)
        divide_by(work, tensors->type, (Py_ssize_t)prog[Q_COUNT], prog[Q_DIVISOR]);
    if (buf && write_back)
        copy_spans(tensors, buf, sp, n);
    return 0;
}

/*
 * small_plain(buf, tensors, spans, program, digest, scratch, patience, stage, inplace, spin, nap, nap_max)
 * -> (status, layout): a small sum or mean, whole, as adasum.call.small_plain.SmallPlain makes it, with no
 * Python in between. `tensors`: one part per span (get_tensor_parts(): numpy arrays, or the addresses of
 * contiguous torch tensors); `buf`: a buffer (or the address of one) of at least `count` elements.
 *
 * The steps: how the tensors lie (`layout`, as layout() says it); in place, overlapping tensors are not
 * taken (status -4, nothing sent: the Python path writes each result back in turn). Then the agreement
 * allreduce of [digest, -digest, 0, vote] (agree_spin(), in scratch; the vote is the program's where the
 * tensors lie back to back in place, else 0), the tensors packed into buf while it travels (not where they
 * lie back to back in place: they are reduced where they lie), MPI_Iallreduce(MPI_IN_PLACE, SUM) of its
 * `count` elements waited for by wait_rule(), the mean's division in the element type, and in place the
 * result copied into the tensors. Status: 0, -1 if the ranks disagree (nothing was sent; the caller
 * explains), -2 if the agreement is still waiting after `patience` seconds, -3 if the allreduce is (both:
 * the request in scratch[8]; the caller waits on, then calls again with stage 1 after the agreement, 2
 * after the allreduce), -4 (not taken), or MPI's error code.
 */
PyObject *
k_small_plain(PyObject *self, PyObject *args)
{
    PyObject *obuf, *otensors, *ospans, *oprog, *oscratch;
    long long digest;
    double patience, wait[3];
    int stage, inplace;
    if (!PyArg_ParseTuple(args, "OOOOLOdipddd:small_plain", &obuf, &otensors, &ospans, &oprog, &digest, &oscratch,
                          &patience, &stage, &inplace, &wait[0], &wait[1], &wait[2]))
        return NULL;
    if (stage < 0 || stage > 2) {
        PyErr_Format(PyExc_ValueError, "small_plain: stage must be 0, 1 or 2, got %d", stage);
        return NULL;
    }
    Py_buffer prog, scratch;
    if (!mpi_ready("small_plain") || !get_scratch(oscratch, &scratch, "small_plain"))
        return NULL;
    if (!typed_buffer(oprog, &prog, 0, sizeof(int64_t), Q_FIELDS, "small_plain: program")) {
        PyBuffer_Release(&scratch);
        return NULL;
    }
    const int64_t *p = (const int64_t *)prog.buf;
    element el = {(int)p[Q_ELEMENT], (char)p[Q_FORMAT], (Py_ssize_t)p[Q_ITEMSIZE]};
    Py_ssize_t count = (Py_ssize_t)p[Q_COUNT];
    call_args c;
    int ok = (el.type == T_F32 || el.type == T_F64 || (el.type == -1 && p[Q_DIVISOR] == 0)) && el.itemsize > 0 &&
             count >= 1 && count <= INT32_MAX;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "small_plain: malformed program");
    else
        ok = acquire_call(&c, ospans, NULL, NULL, 0, 0);
    if (!ok) {
        PyBuffer_Release(&prog);
        PyBuffer_Release(&scratch);
        return NULL;
    }
    ok = get_tensor_parts(otensors, &c.ops[0], inplace, &el, c.sp, c.n, "tensors");
    if (ok) {
        c.count = 1;
        ok = get_element_whole(obuf, &c.ops[1], &el, count, "buf");
        if (ok)
            c.count = 2;
    }
    for (Py_ssize_t i = 0; ok && i <= c.n; i++) { /* the spans tile [0, count) */
        if (i == c.n ? c.n < 1 || c.sp[2 * i - 1] != count : c.sp[2 * i] != (i ? c.sp[2 * i - 1] : 0)) {
            PyErr_SetString(PyExc_ValueError, "small_plain: the spans must follow each other from 0 to count");
            ok = 0;
        }
    }
    int rc = 0, layout = 0;
    if (ok) {
        layout = parts_layout(&c.ops[0]);
        int adjacent = inplace && layout == 2;
        if (inplace && layout == 0) {
            rc = -4;
        } else {
            void *work = adjacent ? c.ops[0].parts[0].buf : c.ops[1].whole.buf;
            Py_BEGIN_ALLOW_THREADS
            rc = run_plain(p, digest, adjacent ? p[Q_VOTE] : 0, (int64_t *)scratch.buf, patience, stage, wait,
                           adjacent ? NULL : &c.ops[1], &c.ops[0], inplace, work, c.sp, c.n);
            Py_END_ALLOW_THREADS
        }
    }
    release_call(&c);
    PyBuffer_Release(&prog);
    PyBuffer_Release(&scratch);
    if (!ok)
        return NULL;
    return Py_BuildValue("(ii)", rc, layout);
}
