/*
 * The arguments of a kernel call, acquired from Python objects and checked before any data is touched:
 * spans (int64 pairs 0 <= s <= e), and operands that are one buffer of floats (float32, float64, float16, or
 * bfloat16 as uint16 bits) every span indexes or a
 * sequence of buffers, one per span (the operand type is in _kernels.h). On any error an exception is set
 * and nothing stays held.
 */
#include "_kernels.h"

#include <string.h>

/* The element type of a buffer format: float32 'f', float64 'd', float16 'e', bfloat16 as uint16 bits 'H';
 * -1 for any other. */
static int
type_of(char code, Py_ssize_t itemsize)
{
    if (code == 'f' && itemsize == 4)
        return T_F32;
    if (code == 'd' && itemsize == 8)
        return T_F64;
    if (code == 'e' && itemsize == 2)
        return T_F16;
    if (code == 'H' && itemsize == 2)
        return T_BF16;
    return -1;
}

/* A C-contiguous buffer of one of the element types; returns the item size (its type in *type), or 0 with
 * an exception set. */
static int
float_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name, int *type)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return 0;
    const char *fmt = view->format ? view->format : "B";
    if ((*type = type_of(fmt[strlen(fmt) - 1], view->itemsize)) >= 0)
        return (int)view->itemsize;
    PyErr_Format(PyExc_TypeError,
                 "%s: expected a float32 or float64 buffer, or float16, or bfloat16 as its uint16 bits; got format "
                 "'%s'", name, fmt);
    PyBuffer_Release(view);
    return 0;
}

/* A C-contiguous buffer of exactly `count` items of `itemsize` bytes; 1, or 0 with an exception set. */
int
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

/* Releases what get_operand() acquired. */
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

/* One buffer that every span indexes: each span must lie inside it. */
static int
whole_operand(PyObject *obj, operand *op, int writable, const char *name, const int64_t *sp, Py_ssize_t n)
{
    if (!(op->itemsize = float_buffer(obj, &op->whole, writable, name, &op->type)))
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

/* One buffer per span (the sequence `seq`), each exactly as long as its span, all of one type. */
static int
parts_operand(PyObject *seq, operand *op, int writable, const char *name, const int64_t *sp, Py_ssize_t n)
{
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd parts (one per span), got %zd", name, n,
                     PySequence_Fast_GET_SIZE(seq));
        return 0;
    }
    if (!(op->parts = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer)))) {
        PyErr_NoMemory();
        return 0;
    }
    op->itemsize = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int type = -1;
        int size = float_buffer(PySequence_Fast_GET_ITEM(seq, i), &op->parts[i], writable, name, &type);
        int ok = size && !(op->itemsize && type != op->type) &&
                 op->parts[i].len == (sp[2 * i + 1] - sp[2 * i]) * size;
        if (size && !ok) {
            PyErr_Format(PyExc_ValueError, "%s: part %zd: expected %lld elements of %d bytes, got %zd bytes", name,
                         i, (long long)(sp[2 * i + 1] - sp[2 * i]), op->itemsize ? op->itemsize : size,
                         op->parts[i].len);
            PyBuffer_Release(&op->parts[i]);
        }
        if (!ok) {
            op->n = i; /* release the parts acquired before this one */
            release_operand(op);
            return 0;
        }
        op->itemsize = size;
        op->type = type;
    }
    if (!op->itemsize) { /* no spans: any float type will do */
        op->itemsize = 4;
        op->type = T_F32;
    }
    return 1;
}

/* Acquires `obj` as an operand over `n` spans of one element type; 1 on success, 0 with an exception set. */
int
get_operand(PyObject *obj, operand *op, int writable, const char *name, const int64_t *sp, Py_ssize_t n)
{
    op->parts = NULL;
    op->n = n;
    if (PyObject_CheckBuffer(obj))
        return whole_operand(obj, op, writable, name, sp, n);
    PyObject *seq = PySequence_Fast(obj, "an operand must be a buffer or a sequence of buffers");
    if (!seq)
        return 0;
    int ok = parts_operand(seq, op, writable, name, sp, n);
    Py_DECREF(seq);
    return ok;
}

/* 1 if the operands have one element type (an operand of no parts has none); else 0 with ValueError. */
int
same_type(const operand *ops, int count)
{
    for (int k = 1; k < count; k++) {
        if (ops[k].type != ops[0].type && !(ops[k].parts && ops[k].n == 0) &&
            !(ops[0].parts && ops[0].n == 0)) {
            PyErr_SetString(PyExc_ValueError, "all operands must have the same dtype");
            return 0;
        }
    }
    return 1;
}

/* Releases what acquire_call() acquired. */
void
release_call(call_args *c)
{
    while (c->count > 0)
        release_operand(&c->ops[--c->count]);
    PyBuffer_Release(&c->spans);
}

/* Acquires the spans and `count` operands (operand 0 writable if `first_writable`) of one dtype; 1 on
 * success, 0 with an exception set and nothing held. */
int
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

/* An address given as a Python int, or NULL with an exception set. */
static void *
address_of(PyObject *obj, const char *name)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "%s: a null address", name);
    return p;
}

/* A C-contiguous buffer of elements of `el` in the machine's byte order; 1, or 0 with an exception set. */
static int
element_buffer(PyObject *obj, Py_buffer *view, int writable, const element *el, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return 0;
    const char *fmt = view->format ? view->format : "B";
    size_t len = strlen(fmt);
    if (len && fmt[len - 1] == el->format && (len == 1 || (len == 2 && (fmt[0] == '@' || fmt[0] == '='))) &&
        view->itemsize == el->itemsize)
        return 1;
    PyErr_Format(PyExc_ValueError, "%s: expected a buffer of format '%c', got '%s'", name, el->format, fmt);
    PyBuffer_Release(view);
    return 0;
}

/*
 * The tensors of a call as an operand of one part per span, each a C-contiguous buffer of elements of
 * `el` (a numpy array) or an int, the address of such memory (a contiguous torch tensor's data_ptr(),
 * which costs a small fraction of a numpy view of it); an address must hold its span's elements for as long
 * as the operand is held (its caller holds the tensors). 1, or 0 with an exception set and nothing held.
 */
int
get_tensor_parts(PyObject *obj, operand *op, int writable, const element *el, const int64_t *sp, Py_ssize_t n,
                 const char *name)
{
    PyObject *seq = PySequence_Fast(obj, "the tensors must be a sequence");
    if (!seq)
        return 0;
    op->n = n;
    op->type = el->type;
    op->itemsize = el->itemsize;
    op->parts = NULL;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd parts (one per span), got %zd", name, n,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return 0;
    }
    if (!(op->parts = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer)))) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_buffer *v = &op->parts[i];
        Py_ssize_t len = (sp[2 * i + 1] - sp[2 * i]) * op->itemsize;
        int ok;
        if (PyLong_Check(item)) {
            ok = (v->buf = address_of(item, name)) != NULL;
            v->len = len, v->obj = NULL;
        } else {
            ok = element_buffer(item, v, writable, el, name);
            if (ok && v->len != len) {
                PyErr_Format(PyExc_ValueError, "%s: part %zd: expected %zd bytes, got %zd", name, i, len, v->len);
                PyBuffer_Release(v);
                ok = 0;
            }
        }
        if (!ok) {
            op->n = i; /* release the parts acquired before this one */
            release_operand(op);
            Py_DECREF(seq);
            return 0;
        }
    }
    Py_DECREF(seq);
    return 1;
}

/* One writable buffer of at least `count` elements of `el`, or the address of one (an int); 1, or 0 with
 * an exception set and nothing held. */
int
get_element_whole(PyObject *obj, operand *op, const element *el, Py_ssize_t count, const char *name)
{
    op->parts = NULL;
    op->n = 0;
    op->type = el->type;
    op->itemsize = el->itemsize;
    if (PyLong_Check(obj)) {
        op->whole.obj = NULL;
        op->whole.len = count * op->itemsize;
        return (op->whole.buf = address_of(obj, name)) != NULL;
    }
    if (!element_buffer(obj, &op->whole, 1, el, name))
        return 0;
    if (op->whole.len >= count * op->itemsize)
        return 1;
    PyErr_Format(PyExc_ValueError, "%s: expected at least %zd elements", name, count);
    PyBuffer_Release(&op->whole);
    return 0;
}
