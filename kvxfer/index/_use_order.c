/* kvxfer.index._use_order: the slots of a tier in the order of their last use, least recent first.
 *
 * A doubly linked list threaded through two arrays indexed by slot (8 bytes a slot): moving a
 * slot to the end or taking it out is O(1), so a batch costs O(batch) whatever the tier's size,
 * and nothing is ever compacted or rebuilt (a queue of uses needed both). Links are stored as
 * index + 1 so that 0 means "not in the list" and fresh (calloc) pages mean an empty list; node
 * ``capacity`` is the list's two ends. Every slot argument is checked before anything changes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity, count;
    uint32_t *prev, *next; /* capacity + 1 links each */
} UseOrder;

static int linked(const UseOrder *o, Py_ssize_t s) { return o->next[s] != 0; }

static void unlink_slot(UseOrder *o, Py_ssize_t s) {
    const uint32_t p = o->prev[s], n = o->next[s];
    o->next[p - 1] = n;
    o->prev[n - 1] = p;
    o->prev[s] = o->next[s] = 0;
    o->count--;
}

static void append_slot(UseOrder *o, Py_ssize_t s) {
    const Py_ssize_t end = o->capacity;
    const uint32_t last = o->prev[end];
    o->next[last - 1] = (uint32_t)s + 1;
    o->prev[s] = last;
    o->next[s] = (uint32_t)end + 1;
    o->prev[end] = (uint32_t)s + 1;
    o->count++;
}

/* The slots of an int64 buffer after checking each is in range; -1, released, with ValueError if not. */
static int checked_slots(UseOrder *o, Py_buffer *in) {
    const int64_t *slots = in->buf;
    const char *problem = in->len % 8 ? "takes 8-byte slots" : NULL;
    for (Py_ssize_t i = 0; problem == NULL && i < in->len / 8; i++)
        if (slots[i] < 0 || slots[i] >= o->capacity)
            problem = "got a slot out of range";
    if (problem == NULL)
        return 0;
    PyBuffer_Release(in);
    PyErr_Format(PyExc_ValueError, "a use order %s", problem);
    return -1;
}

static PyObject *UseOrder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t capacity;
    static char *names[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, &capacity))
        return NULL;
    if (capacity < 0 || capacity >= ((Py_ssize_t)1 << 32) - 1) {
        PyErr_SetString(PyExc_ValueError, "a use order holds 0 to 2**32 - 2 slots");
        return NULL;
    }
    UseOrder *o = (UseOrder *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->capacity = capacity;
    o->prev = calloc((size_t)capacity + 1, sizeof(uint32_t));
    o->next = calloc((size_t)capacity + 1, sizeof(uint32_t));
    if (o->prev == NULL || o->next == NULL) {
        Py_DECREF(o);
        return PyErr_NoMemory();
    }
    o->prev[capacity] = o->next[capacity] = (uint32_t)capacity + 1; /* the empty list: the ends meet */
    return (PyObject *)o;
}

static void UseOrder_dealloc(UseOrder *o) {
    free(o->prev);
    free(o->next);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

/* used(slots: int64 buffer): these slots, in this order, become the most recent. */
static PyObject *UseOrder_used(UseOrder *o, PyObject *args) {
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in) || checked_slots(o, &in) < 0)
        return NULL;
    const int64_t *slots = in.buf;
    for (Py_ssize_t i = 0; i < in.len / 8; i++) {
        if (linked(o, (Py_ssize_t)slots[i]))
            unlink_slot(o, (Py_ssize_t)slots[i]);
        append_slot(o, (Py_ssize_t)slots[i]);
    }
    PyBuffer_Release(&in);
    Py_RETURN_NONE;
}

/* discard(slots: int64 buffer) -> int: take these slots out of the order; how many were in it. */
static PyObject *UseOrder_discard(UseOrder *o, PyObject *args) {
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in) || checked_slots(o, &in) < 0)
        return NULL;
    const int64_t *slots = in.buf;
    const Py_ssize_t before = o->count;
    for (Py_ssize_t i = 0; i < in.len / 8; i++)
        if (linked(o, (Py_ssize_t)slots[i]))
            unlink_slot(o, (Py_ssize_t)slots[i]);
    PyBuffer_Release(&in);
    return PyLong_FromSsize_t(before - o->count);
}

/* peek(after: int, out: int64 buffer) -> int: fill out with the slots that follow ``after`` (-1: from
 * the least recent), in order; how many there were room for and left. ``after`` must be in the order. */
static PyObject *UseOrder_peek(UseOrder *o, PyObject *args) {
    Py_ssize_t after;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "nw*", &after, &out))
        return NULL;
    if (out.len % 8 || after < -1 || after >= o->capacity || (after >= 0 && !linked(o, after))) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "peek starts after a slot in the order, or at -1, into 8-byte slots");
        return NULL;
    }
    int64_t *slots = out.buf;
    Py_ssize_t k = 0;
    for (uint32_t s = o->next[after < 0 ? o->capacity : after]; k < out.len / 8 && s != o->capacity + 1;
         s = o->next[s - 1])
        slots[k++] = (int64_t)s - 1;
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(k);
}

static Py_ssize_t UseOrder_len(UseOrder *o) { return o->count; }

static PyMethodDef UseOrder_methods[] = {
    {"used", (PyCFunction)UseOrder_used, METH_VARARGS, "These slots, in this order, become the most recent."},
    {"discard", (PyCFunction)UseOrder_discard, METH_VARARGS, "Take these slots out of the order."},
    {"peek", (PyCFunction)UseOrder_peek, METH_VARARGS, "The slots that follow ``after`` (-1: from the start)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods UseOrder_sequence = {.sq_length = (lenfunc)UseOrder_len};

static PyTypeObject UseOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvxfer.index._use_order.UseOrder",
    .tp_basicsize = sizeof(UseOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "UseOrder(capacity): slots in the order of their last use, least recent first.",
    .tp_new = UseOrder_new,
    .tp_dealloc = (destructor)UseOrder_dealloc,
    .tp_methods = UseOrder_methods,
    .tp_as_sequence = &UseOrder_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.index._use_order",
                                    "Slots in the order of their last use (see _use_order.c).", -1, NULL, NULL,
                                    NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__use_order(void) {
    if (PyType_Ready(&UseOrderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "UseOrder", (PyObject *)&UseOrderType) < 0)
        Py_CLEAR(m);
    return m;
}
