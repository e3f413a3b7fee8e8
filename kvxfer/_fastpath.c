/* kvxfer._fastpath: per-key passes of a request's bookkeeping, in C through the CPython API.
 *
 * Each function does in one pass what Python does in several (a type pass, a length
 * pass, a set; a lookup and a pop), and answers only the common case: it returns
 * False where something is off and leaves the rest (which key or slot is wrong, and
 * the message) to the Python code beside it (kvxfer/validate.py,
 * kvxfer/index/block_index.py), which also runs alone where this module is not built.
 * Only exact bytes and exact ints are handled as keys and slots. A key already held in a
 * dict may be of a bytes subclass (a library caller's), whose __eq__ runs Python code that
 * can change the caller's lists: so each item is held while the dict looks at it, and the
 * list's length is read again before each item (a list that shrank ends the pass with
 * RuntimeError, never a read past its end).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* items[i] with a reference of its own, or NULL with RuntimeError if the list is now shorter. */
static PyObject *hold_item(PyObject *items, Py_ssize_t i) {
    if (i >= PyList_GET_SIZE(items)) {
        PyErr_SetString(PyExc_RuntimeError, "a list changed during a bookkeeping pass");
        return NULL;
    }
    PyObject *item = PyList_GET_ITEM(items, i);
    Py_INCREF(item);
    return item;
}

/* 0 if ``buffer`` holds n 8-byte ints; else -1, the buffer released and ValueError set. */
static int holds_n_words(Py_buffer *buffer, Py_ssize_t n, const char *what) {
    if (buffer->len == n * (Py_ssize_t)sizeof(int64_t))
        return 0;
    PyBuffer_Release(buffer);
    PyErr_Format(PyExc_ValueError, "%s takes one 8-byte int per item", what);
    return -1;
}

/* 0 if ``shards`` is a dict, or a non-empty list of exact dicts whose length is a power of two
 * (a namespace's key map, kvxfer/index/keyspace.py); else -1 with TypeError. */
static int check_shards(PyObject *shards) {
    if (PyDict_Check(shards))
        return 0;
    const Py_ssize_t n = PyList_Check(shards) ? PyList_GET_SIZE(shards) : 0;
    int ok = n > 0 && (n & (n - 1)) == 0;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = PyDict_CheckExact(PyList_GET_ITEM(shards, i));
    if (!ok)
        PyErr_SetString(PyExc_TypeError, "a key space is a list of 2**k dicts");
    return ok ? 0 : -1;
}

/* The dict of ``shards`` that holds ``key``, with a reference of its own (a held key's __eq__ may
 * change the list while the dict looks), chosen by the top bits of its hash (the dicts use the low
 * bits): the same choice as KeySpace.shard in Python. NULL with an error set if the key cannot be
 * hashed or the list no longer holds a dict there. */
static PyObject *shard_of(PyObject *shards, PyObject *key) {
    if (PyDict_Check(shards)) {
        Py_INCREF(shards); /* one dict: the key's hash is taken by the dict itself */
        return shards;
    }
    const Py_hash_t hash = PyObject_Hash(key);
    const Py_ssize_t n = PyList_GET_SIZE(shards);
    if (hash == -1)
        return NULL;
    if (n < 1 || (n & (n - 1)) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "a key space changed during a bookkeeping pass");
        return NULL;
    }
    PyObject *shard = PyList_GET_ITEM(shards, (Py_ssize_t)(((Py_uhash_t)hash >> 48) & (Py_uhash_t)(n - 1)));
    if (!PyDict_CheckExact(shard)) {
        PyErr_SetString(PyExc_RuntimeError, "a key space changed during a bookkeeping pass");
        return NULL;
    }
    Py_INCREF(shard);
    return shard;
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

/* pop_owned(space: dict | list of dicts, keys: list, slots: int64 buffer) -> int: remove keys[i] from space
 * where it maps to slots[i] (a key stored again since, under another slot, stays); returns
 * how many were removed. */
static PyObject *pop_owned(PyObject *self, PyObject *args) {
    PyObject *space, *keys;
    Py_buffer buffer;
    if (!PyArg_ParseTuple(args, "OO!y*", &space, &PyList_Type, &keys, &buffer))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    Py_ssize_t removed = 0;
    if (holds_n_words(&buffer, n, "pop_owned") < 0)
        return NULL;
    if (check_shards(space) < 0) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    const int64_t *slots = buffer.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = hold_item(keys, i);
        if (key == NULL)
            goto error;
        if (!PyBytes_CheckExact(key)) {
            Py_DECREF(key);
            continue; /* a slot without a key: nothing maps to it */
        }
        PyObject *shard = shard_of(space, key);
        PyObject *held = shard == NULL ? NULL : PyDict_GetItemWithError(shard, key); /* borrowed */
        int overflow = 0;
        const long long slot = held != NULL && PyLong_CheckExact(held) ? PyLong_AsLongLongAndOverflow(held, &overflow)
                                                                      : -1;
        const int gone = !PyErr_Occurred() && held != NULL && !overflow && slot == slots[i] &&
                         PyDict_DelItem(shard, key) == 0;
        Py_XDECREF(shard);
        Py_DECREF(key);
        if (PyErr_Occurred())
            goto error;
        removed += gone;
    }
    PyBuffer_Release(&buffer);
    return PyLong_FromSsize_t(removed);
error:
    PyBuffer_Release(&buffer);
    return NULL;
}

/* insert_new(space: dict | list of dicts, keys: list, first: int, slots: list | None) -> bool: map keys[i] to
 * slots[i] (or first + i where slots is None) if space holds none of the keys, in one probe a
 * key; otherwise (a key is held already, or named twice) leave space as it was: False. */
static PyObject *insert_new(PyObject *self, PyObject *args) {
    PyObject *space, *keys, *slots;
    long long first;
    if (!PyArg_ParseTuple(args, "OO!LO", &space, &PyList_Type, &keys, &first, &slots))
        return NULL;
    if (check_shards(space) < 0)
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    if (slots != Py_None && (!PyList_Check(slots) || PyList_GET_SIZE(slots) != n)) {
        PyErr_SetString(PyExc_ValueError, "insert_new takes one slot per key, or a first slot");
        return NULL;
    }
    Py_ssize_t i;
    int conflict = 0;
    for (i = 0; i < n; i++) {
        PyObject *key = hold_item(keys, i);
        if (key == NULL)
            break;
        if (!PyBytes_CheckExact(key)) {
            Py_DECREF(key);
            conflict = 1; /* not a validated key: the Python path decides */
            break;
        }
        PyObject *value = slots == Py_None ? PyLong_FromLongLong(first + i) : hold_item(slots, i);
        if (value == NULL) {
            Py_DECREF(key);
            break;
        }
        PyObject *shard = shard_of(space, key);
        if (shard == NULL) {
            Py_DECREF(value);
            Py_DECREF(key);
            break;
        }
        const Py_ssize_t size = PyDict_GET_SIZE(shard);
        PyObject *held = PyDict_SetDefault(shard, key, value); /* borrowed */
        const int inserted = PyDict_GET_SIZE(shard) == size + 1;
        Py_DECREF(shard);
        Py_DECREF(value); /* space holds it now, if it took it */
        Py_DECREF(key);
        if (held == NULL)
            break;
        if (!inserted) { /* the key was there: nothing inserted */
            conflict = 1;
            break;
        }
    }
    if (i == n)
        Py_RETURN_TRUE;
    PyObject *error_type, *error_value, *error_traceback; /* undo: the keys before i were new */
    PyErr_Fetch(&error_type, &error_value, &error_traceback);
    for (Py_ssize_t j = 0; j < i && j < PyList_GET_SIZE(keys); j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        Py_INCREF(key);
        PyObject *shard = shard_of(space, key); /* (exact bytes, hashed before: cannot fail) */
        if (shard == NULL || PyDict_DelItem(shard, key) < 0)
            PyErr_Clear(); /* gone already: a held key's __eq__ changed the dict or the list */
        Py_XDECREF(shard);
        Py_DECREF(key);
    }
    PyErr_Restore(error_type, error_value, error_traceback);
    if (conflict)
        Py_RETURN_FALSE;
    return NULL;
}

/* set_slots(space: dict | list of dicts, keys: list, first: int, slots: list | None) -> None:
 * space[keys[i]] = slots[i] (as far as both lists go), or first + i where slots is None (keys
 * the caller has just put in: a full tier's batch, whose slots are known only after eviction). */
static PyObject *set_slots(PyObject *self, PyObject *args) {
    PyObject *space, *keys, *slots = Py_None;
    long long first;
    if (!PyArg_ParseTuple(args, "OO!L|O", &space, &PyList_Type, &keys, &first, &slots))
        return NULL;
    if (check_shards(space) < 0)
        return NULL;
    if (slots != Py_None && !PyList_Check(slots)) {
        PyErr_SetString(PyExc_TypeError, "set_slots takes a list of slots, or a first slot");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys); /* pairs up to the shorter list, as zip does */
    if (slots != Py_None && PyList_GET_SIZE(slots) < n)
        n = PyList_GET_SIZE(slots);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = hold_item(keys, i);
        PyObject *value = key == NULL ? NULL : slots == Py_None ? PyLong_FromLongLong(first + i) : hold_item(slots, i);
        PyObject *shard = value == NULL ? NULL : shard_of(space, key);
        const int failed = shard == NULL || PyDict_SetItem(shard, key, value) < 0;
        Py_XDECREF(shard);
        Py_XDECREF(value);
        Py_XDECREF(key);
        if (failed)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* find(space: dict | list of dicts, keys: list, out: writable int64 buffer) -> None: out[i] = the slot keys[i]
 * maps to in space, or -1. */
static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *space, *keys;
    Py_buffer buffer;
    if (!PyArg_ParseTuple(args, "OO!w*", &space, &PyList_Type, &keys, &buffer))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    if (holds_n_words(&buffer, n, "find") < 0)
        return NULL;
    if (check_shards(space) < 0) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    int64_t *out = buffer.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = hold_item(keys, i);
        if (key == NULL) {
            PyBuffer_Release(&buffer);
            return NULL;
        }
        PyObject *shard = PyBytes_CheckExact(key) ? shard_of(space, key) : NULL;
        PyObject *held = shard != NULL ? PyDict_GetItemWithError(shard, key) : NULL; /* borrowed */
        int overflow = 0;
        out[i] = held != NULL && PyLong_CheckExact(held) ? PyLong_AsLongLongAndOverflow(held, &overflow) : -1;
        Py_XDECREF(shard); /* (after its value is read) */
        Py_DECREF(key);
        if (PyErr_Occurred()) {
            PyBuffer_Release(&buffer);
            return NULL;
        }
        if (overflow)
            out[i] = -1;
    }
    PyBuffer_Release(&buffer);
    Py_RETURN_NONE;
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
    {"pop_owned", pop_owned, METH_VARARGS, "Remove keys[i] from space where it maps to slots[i]."},
    {"insert_new", insert_new, METH_VARARGS, "Map keys to slots if space holds none of them; else change nothing."},
    {"set_slots", set_slots, METH_VARARGS, "space[keys[i]] = slots[i], or first + i."},
    {"find", find, METH_VARARGS, "out[i] = the slot keys[i] maps to, or -1."},
    {"ints_into", ints_into, METH_VARARGS, "out[i] = values[i] as int64 or uint64, if every value fits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer._fastpath",
                                    "Per-key bookkeeping passes in C (see _fastpath.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&module); }
