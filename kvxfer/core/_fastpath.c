/* kvxfer.core._fastpath: per-key passes of a request's checks, in C through the CPython API.
 *
 * Each function does in one pass what Python does in several (a type pass, a length
 * pass, a set), and answers only the common case: it returns False where something is
 * off and leaves the rest (which key or slot is wrong, and the message) to the Python
 * code beside it (kvxfer/core/validate.py, kvxfer/tiers/slots.py), which also runs alone
 * where this module is not built. Only exact bytes and exact ints are handled as keys
 * and slots, so no Python code runs during a pass.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* 0 if ``buffer`` holds n 8-byte ints; else -1, the buffer released and ValueError set. */
static int holds_n_words(Py_buffer *buffer, Py_ssize_t n, const char *what) {
    if (buffer->len == n * (Py_ssize_t)sizeof(int64_t))
        return 0;
    PyBuffer_Release(buffer);
    PyErr_Format(PyExc_ValueError, "%s takes one 8-byte int per item", what);
    return -1;
}

/* keys_ok(keys: list, max_bytes: int, unique: bool) -> bool: every key exact bytes of
 * 1..max_bytes, and (unique) no key twice. Hashes each key once (bytes keep their hash). */
static PyObject *keys_ok(PyObject *self, PyObject *args) {
    PyObject *keys;
    Py_ssize_t max_bytes;
    int unique;
    if (!PyArg_ParseTuple(args, "O!np", &PyList_Type, &keys, &max_bytes, &unique))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) < 1 || PyBytes_GET_SIZE(key) > max_bytes)
            Py_RETURN_FALSE;
    }
    if (!unique)
        Py_RETURN_TRUE;
    PyObject *seen = PySet_New(NULL);
    if (seen == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PySet_Add(seen, PyList_GET_ITEM(keys, i)) < 0) {
            Py_DECREF(seen);
            return NULL;
        }
    const int distinct = PySet_GET_SIZE(seen) == n;
    Py_DECREF(seen);
    return PyBool_FromLong(distinct);
}

/* slots_ok(slots: list, num_blocks: int) -> bool: every slot an exact int in [1, num_blocks)
 * (never the null block 0), none twice. */
static PyObject *slots_ok(PyObject *self, PyObject *args) {
    PyObject *slots;
    Py_ssize_t num_blocks;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &slots, &num_blocks))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(slots);
    if (n == 0)
        Py_RETURN_TRUE;
    if (num_blocks < 2)
        Py_RETURN_FALSE;
    uint8_t *seen = calloc((size_t)num_blocks / 8 + 1, 1); /* one bit a block */
    if (seen == NULL)
        return PyErr_NoMemory();
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *slot = PyList_GET_ITEM(slots, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(slot) ? PyLong_AsLongLongAndOverflow(slot, &overflow) : -1;
        if (overflow || v < 1 || v >= num_blocks || (seen[v >> 3] >> (v & 7)) & 1)
            ok = 0;
        else
            seen[v >> 3] |= (uint8_t)(1u << (v & 7));
    }
    free(seen);
    return PyBool_FromLong(ok);
}

/* ints_into(values: list, out: writable 8-byte buffer, signed: bool) -> bool: out[i] = values[i]
 * (int64 or uint64) where every value is an exact int in range; else False (out partly written).
 * numpy's own conversion of a list of ints costs ~13 ns an item. */
static PyObject *ints_into(PyObject *self, PyObject *args) {
    PyObject *values;
    Py_buffer buffer;
    int is_signed;
    if (!PyArg_ParseTuple(args, "O!w*p", &PyList_Type, &values, &buffer, &is_signed))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(values);
    if (holds_n_words(&buffer, n, "ints_into") < 0)
        return NULL;
    uint64_t *out = buffer.buf;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *value = PyList_GET_ITEM(values, i);
        if (!PyLong_CheckExact(value)) {
            ok = 0;
        } else if (is_signed) {
            int overflow = 0;
            const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
            ok = !overflow;
            out[i] = (uint64_t)v;
        } else {
            const unsigned long long v = PyLong_AsUnsignedLongLong(value); /* negative or too big: error */
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                ok = 0;
            }
            out[i] = v;
        }
    }
    PyBuffer_Release(&buffer);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"keys_ok", keys_ok, METH_VARARGS, "Whether every key is bytes of 1..max_bytes (and, if unique, distinct)."},
    {"slots_ok", slots_ok, METH_VARARGS, "Whether every slot is an int in [1, num_blocks), none twice."},
    {"ints_into", ints_into, METH_VARARGS, "out[i] = values[i] as int64 or uint64, if every value fits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.core._fastpath",
                                    "Per-key checks in C (see _fastpath.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&module); }
