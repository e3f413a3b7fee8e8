/* kvxfer.index._tables: a tier index's keys, compact and without rebuilds.
 *
 * KeyTable maps (namespace id, key) to a slot. A key's bytes live with its slot (up to WIDTH
 * inline; longer keys, which no engine uses, in a dict by slot), and one open-addressing table
 * of 8-byte buckets (the hash's top 32 bits, slot + 1) finds them, sized once for the tier's
 * capacity at 1.25 buckets a slot: it never grows, and a removal shifts the run after it back
 * (no tombstones), so no call ever rebuilds it. About 10 + 45 bytes a block, where a dict of
 * bytes objects took about 150. Hashes are Python's own (SipHash, seeded per process), so
 * clients cannot choose keys that collide.
 *
 * Arguments are checked (types, lengths, slot ranges) and a bad one raises without changing
 * anything the caller can see. Keys are exact bytes (the request edge converts the others).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WIDTH 40 /* inline key bytes a slot: a 32-byte hash, or vLLM's 36-byte offload key */
#define MAX_CAPACITY ((Py_ssize_t)1 << 31)

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity, nbuckets, count;
    uint64_t *buckets; /* 0: empty; else tag << 32 | (slot + 1) */
    uint8_t *keys;     /* WIDTH bytes a slot */
    uint8_t *lengths;  /* a key's length if inline, 0 if in long_keys */
    uint32_t *owners;  /* namespace id + 1 of the slot's key; 0: the slot holds none */
    PyObject *long_keys;
} KeyTable;

static uint64_t mix(Py_hash_t hash, uint32_t ns) { /* hash and namespace, spread (murmur3's finaliser) */
    uint64_t x = (uint64_t)hash ^ ((uint64_t)(ns + 1) * 0x9E3779B97F4A7C15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static Py_ssize_t home(const KeyTable *t, uint64_t tag) { return (Py_ssize_t)((tag * (uint64_t)t->nbuckets) >> 32); }

static Py_ssize_t next_bucket(const KeyTable *t, Py_ssize_t b) { return b + 1 == t->nbuckets ? 0 : b + 1; }

/* The stored key of a slot that holds one (borrowed from long_keys, or NULL and *inline set). */
static PyObject *long_key(KeyTable *t, Py_ssize_t slot) {
    PyObject *index = PyLong_FromSsize_t(slot);
    PyObject *key = index == NULL ? NULL : PyDict_GetItemWithError(t->long_keys, index);
    Py_XDECREF(index);
    if (key == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "a long key is missing from its table");
    return key;
}

/* 1 if slot holds key in namespace ns, 0 if not, -1 with an error set. */
static int holds(KeyTable *t, Py_ssize_t slot, uint32_t ns, const char *bytes, Py_ssize_t size) {
    if (t->owners[slot] != ns + 1)
        return 0;
    if (t->lengths[slot])
        return t->lengths[slot] == size && memcmp(t->keys + slot * WIDTH, bytes, (size_t)size) == 0;
    if (size <= WIDTH)
        return 0;
    PyObject *key = long_key(t, slot);
    if (key == NULL)
        return -1;
    return PyBytes_GET_SIZE(key) == size && memcmp(PyBytes_AS_STRING(key), bytes, (size_t)size) == 0;
}

/* The slot of (ns, key) or -1 (not there), or -2 with an error set; *bucket: where it is or may go. */
static Py_ssize_t lookup(KeyTable *t, uint32_t ns, PyObject *key, uint64_t *tag_out, Py_ssize_t *bucket) {
    if (!PyBytes_CheckExact(key)) {
        PyErr_SetString(PyExc_TypeError, "keys are bytes");
        return -2;
    }
    const Py_hash_t hash = PyObject_Hash(key); /* (kept by the bytes object) */
    if (hash == -1)
        return -2;
    const uint64_t tag = mix(hash, ns) >> 32;
    Py_ssize_t b = home(t, tag);
    for (;; b = next_bucket(t, b)) {
        const uint64_t entry = t->buckets[b];
        if (entry == 0)
            break;
        if (entry >> 32 != tag)
            continue;
        const Py_ssize_t slot = (Py_ssize_t)(entry & 0xFFFFFFFFu) - 1;
        const int same = holds(t, slot, ns, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        if (same < 0)
            return -2;
        if (same) {
            *bucket = b;
            return slot;
        }
    }
    *tag_out = tag;
    *bucket = b;
    return -1;
}

/* Empty bucket b and shift back the entries after it that would no longer be found. */
static void remove_bucket(KeyTable *t, Py_ssize_t b) {
    Py_ssize_t hole = b;
    for (Py_ssize_t i = next_bucket(t, b);; i = next_bucket(t, i)) {
        const uint64_t entry = t->buckets[i];
        if (entry == 0)
            break;
        const Py_ssize_t want = home(t, entry >> 32);
        /* the entry may move to the hole if its home is not cyclically in (hole, i] */
        const int between = hole <= i ? (hole < want && want <= i) : (hole < want || want <= i);
        if (!between) {
            t->buckets[hole] = entry;
            hole = i;
        }
    }
    t->buckets[hole] = 0;
}

/* 0 if buffer holds n items of itemsize bytes; else -1, released, with ValueError. */
static int sized(Py_buffer *buffer, Py_ssize_t n, Py_ssize_t itemsize, const char *what) {
    if (buffer->len == n * itemsize)
        return 0;
    PyBuffer_Release(buffer);
    PyErr_Format(PyExc_ValueError, "%s takes %zd bytes an item", what, itemsize);
    return -1;
}

static Py_ssize_t changed(void) { /* a finaliser run by a collection shrank the list */
    PyErr_SetString(PyExc_RuntimeError, "a list changed during a key table pass");
    return -2;
}

static int checked_ns(long long ns) {
    if (ns >= 0 && ns < 0xFFFFFFFFll)
        return 0;
    PyErr_SetString(PyExc_ValueError, "a namespace id is in [0, 2**32 - 1)");
    return -1;
}

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t capacity;
    static char *names[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, &capacity))
        return NULL;
    if (capacity < 0 || capacity > MAX_CAPACITY) {
        PyErr_SetString(PyExc_ValueError, "a key table holds 0 to 2**31 slots");
        return NULL;
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->capacity = capacity;
    t->nbuckets = capacity + capacity / 4 + 1; /* at least one empty bucket ends every probe */
    /* calloc: fresh pages are zero and take memory only when first written */
    t->buckets = calloc((size_t)t->nbuckets, sizeof(uint64_t));
    t->keys = calloc((size_t)capacity + 1, WIDTH);
    t->lengths = calloc((size_t)capacity + 1, 1);
    t->owners = calloc((size_t)capacity + 1, sizeof(uint32_t));
    t->long_keys = PyDict_New();
    if (!t->buckets || !t->keys || !t->lengths || !t->owners || !t->long_keys) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void KeyTable_dealloc(KeyTable *t) {
    free(t->buckets);
    free(t->keys);
    free(t->lengths);
    free(t->owners);
    Py_XDECREF(t->long_keys);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* find(ns, keys: list, out: int64 buffer): out[i] = the slot of keys[i], or -1. */
static PyObject *KeyTable_find(KeyTable *t, PyObject *args) {
    long long ns;
    PyObject *keys;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "LO!w*", &ns, &PyList_Type, &keys, &out))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    if (sized(&out, n, 8, "find") < 0)
        return NULL;
    int64_t *slots = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t tag;
        Py_ssize_t bucket;
        PyObject *key = i < PyList_GET_SIZE(keys) ? Py_NewRef(PyList_GET_ITEM(keys, i)) : NULL;
        slots[i] = key == NULL ? changed() : checked_ns(ns) < 0 ? -2 : lookup(t, (uint32_t)ns, key, &tag, &bucket);
        Py_XDECREF(key);
        if (slots[i] == -2) {
            PyBuffer_Release(&out);
            return NULL;
        }
    }
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static void forget_slot(KeyTable *t, Py_ssize_t slot);

/* insert_new(ns, keys: list, slots: int64 buffer) -> bool: keys[i] -> slots[i] if none of the
 * keys is held (and none named twice); else False and nothing changed. Each slot must be free. */
static PyObject *KeyTable_insert_new(KeyTable *t, PyObject *args) {
    long long ns;
    PyObject *keys;
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "LO!y*", &ns, &PyList_Type, &keys, &in))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    if (sized(&in, n, 8, "insert_new") < 0)
        return NULL;
    const int64_t *slots = in.buf;
    Py_ssize_t i = 0;
    int conflict = 0;
    if (checked_ns(ns) < 0)
        goto undo;
    for (; i < n; i++) {
        const int64_t slot = slots[i];
        if (slot < 0 || slot >= t->capacity || t->owners[slot]) {
            PyErr_Format(PyExc_ValueError, "slot %lld is out of range or holds a key", (long long)slot);
            goto undo;
        }
        if (i >= PyList_GET_SIZE(keys)) {
            changed();
            goto undo;
        }
        PyObject *key = Py_NewRef(PyList_GET_ITEM(keys, i)); /* held: a collection may run a finaliser */
        uint64_t tag;
        Py_ssize_t bucket;
        const Py_ssize_t found = lookup(t, (uint32_t)ns, key, &tag, &bucket);
        int failed = found == -2;
        conflict = found >= 0;
        const Py_ssize_t size = failed || conflict ? 0 : PyBytes_GET_SIZE(key);
        if (size > WIDTH) {
            PyObject *index = PyLong_FromSsize_t((Py_ssize_t)slot);
            failed = index == NULL || PyDict_SetItem(t->long_keys, index, key) < 0;
            Py_XDECREF(index);
            t->lengths[slot] = 0;
        } else if (size) {
            memcpy(t->keys + slot * WIDTH, PyBytes_AS_STRING(key), (size_t)size);
            t->lengths[slot] = (uint8_t)size;
        }
        Py_DECREF(key);
        if (failed || conflict)
            goto undo;
        t->owners[slot] = (uint32_t)ns + 1;
        t->buckets[bucket] = tag << 32 | (uint64_t)(slot + 1);
        t->count++;
    }
    PyBuffer_Release(&in);
    Py_RETURN_TRUE;
undo:; /* the keys before i went in: take them out, keeping any error set */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (Py_ssize_t j = 0; j < i; j++)
        forget_slot(t, (Py_ssize_t)slots[j]);
    PyErr_Restore(type, value, traceback);
    PyBuffer_Release(&in);
    if (conflict)
        Py_RETURN_FALSE;
    return NULL;
}

/* Remove a slot's key. Errors are cleared: a slot's own long key is always there, and the entry is
 * found by its slot number, not by comparing keys. */
static void forget_slot(KeyTable *t, Py_ssize_t slot) {
    if (!t->owners[slot])
        return;
    PyObject *key = t->lengths[slot] ? NULL : long_key(t, slot);
    const Py_hash_t hash = t->lengths[slot] ? _Py_HashBytes(t->keys + slot * WIDTH, t->lengths[slot])
                                            : key != NULL ? PyObject_Hash(key) : -1;
    const uint64_t tag = mix(hash, t->owners[slot] - 1) >> 32;
    Py_ssize_t bucket = home(t, tag);
    while (t->buckets[bucket] && t->buckets[bucket] != ((tag << 32) | (uint64_t)(slot + 1)))
        bucket = next_bucket(t, bucket);
    if ((t->buckets[bucket] & 0xFFFFFFFFu) != (uint64_t)(slot + 1)) /* (a hash that failed) look at all */
        for (bucket = 0; bucket < t->nbuckets && (t->buckets[bucket] & 0xFFFFFFFFu) != (uint64_t)(slot + 1);)
            bucket++;
    if (bucket < t->nbuckets)
        remove_bucket(t, bucket);
    if (!t->lengths[slot]) {
        PyObject *index = PyLong_FromSsize_t(slot);
        if (index == NULL || PyDict_DelItem(t->long_keys, index) < 0)
            PyErr_Clear();
        Py_XDECREF(index);
    }
    PyErr_Clear();
    t->owners[slot] = 0;
    t->lengths[slot] = 0;
    t->count--;
}

/* Each slot of an int64 buffer, checked in range first; -1 with ValueError if one is not. */
static int slots_in_range(KeyTable *t, Py_buffer *in, const char *what) {
    if (in->len % 8) {
        PyBuffer_Release(in);
        PyErr_Format(PyExc_ValueError, "%s takes 8-byte slots", what);
        return -1;
    }
    const int64_t *slots = in->buf;
    for (Py_ssize_t i = 0; i < in->len / 8; i++)
        if (slots[i] < 0 || slots[i] >= t->capacity) {
            PyBuffer_Release(in);
            PyErr_Format(PyExc_ValueError, "slot %lld is out of range", (long long)slots[i]);
            return -1;
        }
    return 0;
}

/* remove(slots: int64 buffer) -> int: forget the keys these slots hold; how many did. */
static PyObject *KeyTable_remove(KeyTable *t, PyObject *args) {
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in) || slots_in_range(t, &in, "remove") < 0)
        return NULL;
    const int64_t *slots = in.buf;
    const Py_ssize_t before = t->count;
    for (Py_ssize_t i = 0; i < in.len / 8; i++)
        forget_slot(t, (Py_ssize_t)slots[i]);
    PyBuffer_Release(&in);
    return PyLong_FromSsize_t(before - t->count);
}

/* keys_of(slots: int64 buffer) -> list: each slot's key, None where it holds none. */
static PyObject *KeyTable_keys_of(KeyTable *t, PyObject *args) {
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in) || slots_in_range(t, &in, "keys_of") < 0)
        return NULL;
    const int64_t *slots = in.buf;
    PyObject *out = PyList_New(in.len / 8);
    for (Py_ssize_t i = 0; out != NULL && i < in.len / 8; i++) {
        const Py_ssize_t s = (Py_ssize_t)slots[i];
        PyObject *key = !t->owners[s] ? Py_NewRef(Py_None)
                        : t->lengths[s] ? PyBytes_FromStringAndSize((const char *)t->keys + s * WIDTH, t->lengths[s])
                                        : Py_XNewRef(long_key(t, s));
        if (key == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, key);
    }
    PyBuffer_Release(&in);
    return out;
}

/* owners(slots: int64 buffer, out: int32 buffer): the namespace id of each slot's key, -1 for none. */
static PyObject *KeyTable_owners(KeyTable *t, PyObject *args) {
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "y*w*", &in, &out))
        return NULL;
    if (slots_in_range(t, &in, "owners") < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (sized(&out, in.len / 8, 4, "owners") < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    const int64_t *slots = in.buf;
    int32_t *ids = out.buf;
    for (Py_ssize_t i = 0; i < in.len / 8; i++)
        ids[i] = (int32_t)t->owners[slots[i]] - 1;
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->count; }

static PyMethodDef KeyTable_methods[] = {
    {"find", (PyCFunction)KeyTable_find, METH_VARARGS, "out[i] = the slot of keys[i] in namespace ns, or -1."},
    {"insert_new", (PyCFunction)KeyTable_insert_new, METH_VARARGS,
     "keys[i] -> slots[i] if none of the keys is held; else False, nothing changed."},
    {"remove", (PyCFunction)KeyTable_remove, METH_VARARGS, "Forget the keys these slots hold; how many did."},
    {"keys_of", (PyCFunction)KeyTable_keys_of, METH_VARARGS, "Each slot's key, or None."},
    {"owners", (PyCFunction)KeyTable_owners, METH_VARARGS, "out[i] = the namespace id of slots[i]'s key, or -1."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyTable_sequence = {.sq_length = (lenfunc)KeyTable_len};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvxfer.index._tables.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyTable(capacity): (namespace id, key) -> slot, the key's bytes kept with its slot.",
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_methods = KeyTable_methods,
    .tp_as_sequence = &KeyTable_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvxfer.index._tables",
                                    "A tier index's key table in C (see _tables.c).", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tables(void) {
    if (PyType_Ready(&KeyTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KeyTable", (PyObject *)&KeyTableType) < 0 ||
        PyModule_AddIntConstant(m, "WIDTH", WIDTH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
