"""The key table in C (kvxfer/index/_tables.c) against its Python twin and a dict model: full tables,
long keys, many namespaces, removals that shift runs back, and arguments it must refuse. The C
module must be built (no skip: test_fastpath.py says how to build it)."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvxfer.index.keytable as keytable
from kvxfer.index.keytable import TABLES, KeyTable

CAPACITY = 16
key_st = st.binary(min_size=1, max_size=3) | st.binary(min_size=38, max_size=60)  # inline and long
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.sampled_from("abc"), st.lists(key_st, max_size=6, unique=True)),
    st.tuples(st.just("remove"), st.just(""), st.lists(st.integers(0, CAPACITY - 1), max_size=6, unique=True)),
), max_size=60)


def tables(monkeypatch):
    native = KeyTable(CAPACITY)
    monkeypatch.setattr(keytable, "TABLES", None)
    return native, KeyTable(CAPACITY)


@settings(max_examples=200, deadline=None)
@given(steps=ops)
def test_the_c_table_answers_as_its_python_twin_and_the_model(steps):
    with pytest.MonkeyPatch.context() as monkeypatch:
        native, twin = tables(monkeypatch)
    assert isinstance(native._table, TABLES.KeyTable) and isinstance(twin._table, keytable.PyKeys)
    model: dict[int, tuple[str, bytes]] = {}  # slot -> (namespace, key)
    for op, ns, arg in steps:
        if op == "insert":
            free = [s for s in range(CAPACITY) if s not in model][:len(arg)]
            keys = arg[:len(free)]
            held = {(n, k) for n, k in model.values()}
            expected = not any((ns, k) in held for k in keys)
            assert native.insert_new(ns, keys, free) == twin.insert_new(ns, keys, free) == expected
            if expected:
                model.update({s: (ns, k) for s, k in zip(free, keys)})
        else:
            slots = np.array(arg, dtype=np.int64)
            native.remove(slots)
            twin.remove(slots)
            for slot in arg:
                model.pop(slot, None)
        every = np.arange(CAPACITY, dtype=np.int64)
        expected_keys = [model[s][1] if s in model else None for s in range(CAPACITY)]
        assert native.keys_of(every) == twin.keys_of(every) == expected_keys
        for name in "abc":
            probe = [k for n, k in model.values()] + [b"absent"]
            want = [next((s for s, (n, k) in model.items() if n == name and k == key), -1) for key in probe]
            assert native.find(name, probe).tolist() == twin.find(name, probe).tolist() == want
        assert len(native) == len(twin) == len(model)
        owners = [native.name(i) if i >= 0 else None for i in native.owner_ids(every).tolist()]
        assert owners == [model[s][0] if s in model else None for s in range(CAPACITY)]


def test_a_full_table_finds_every_key_after_random_removals_and_reinserts():
    capacity = 5000
    table = KeyTable(capacity)
    rng = np.random.default_rng(7)
    keys = [b"key-%d" % i for i in range(capacity)]
    assert table.insert_new("ns", keys, np.arange(capacity))
    slot_of = dict(zip(keys, range(capacity)))
    for round_ in range(20):  # runs are shifted back on every removal: nothing is lost, nothing stale stays
        gone = rng.choice(capacity, 400, replace=False)
        table.remove(gone)
        for slot in gone.tolist():
            del slot_of[keys[slot]]
        fresh = [b"r%d-%d" % (round_, s) for s in gone.tolist()]
        assert table.insert_new("ns", fresh, gone)
        for slot, key in zip(gone.tolist(), fresh):
            keys[slot] = key
            slot_of[key] = slot
        assert table.find("ns", keys).tolist() == list(range(capacity))
        assert table.find("other", keys[:100]).tolist() == [-1] * 100
    table.remove(np.array([0]))
    assert len(table) == capacity - 1 and table.insert_new("ns", [keys[3]], [0]) is False  # held at slot 3


def test_bad_arguments_are_refused_and_change_nothing():
    table = TABLES.KeyTable(8)
    assert table.insert_new(0, [b"a", b"b"], np.array([1, 2], dtype=np.int64))
    for slots in ([3, 3], [8, 4], [-1, 4], [2, 4]):  # twice, out of range, holds a key
        with pytest.raises(ValueError, match="slot"):
            table.insert_new(0, [b"c", b"d"], np.array(slots, dtype=np.int64))
    for keys in ([b"c", "d"], [b"c", bytearray(b"d")], [b"c", None]):  # exact bytes only: no Python __eq__ runs
        with pytest.raises(TypeError):
            table.insert_new(0, keys, np.array([3, 4], dtype=np.int64))
    assert table.insert_new(0, [b"c", b"a"], np.array([3, 4], dtype=np.int64)) is False  # a is held
    with pytest.raises(ValueError):
        table.insert_new(0, [b"c"], np.array([3, 4], dtype=np.int64))  # one slot a key
    with pytest.raises(ValueError):
        table.insert_new(-1, [b"c"], np.array([3], dtype=np.int64))
    with pytest.raises(ValueError, match="out of range"):
        table.remove(np.array([1, 9], dtype=np.int64))
    with pytest.raises(ValueError):
        table.find(0, [b"a"], np.empty(2, dtype=np.int64))
    out = np.empty(4, dtype=np.int64)
    table.find(0, [b"a", b"b", b"c", b"d"], out)
    assert out.tolist() == [1, 2, -1, -1] and len(table) == 2  # unchanged
    for capacity in (-1, 2**31 + 1):
        with pytest.raises(ValueError):
            TABLES.KeyTable(capacity)


def test_no_reference_leaks_over_many_refused_and_long_key_inserts():
    table = TABLES.KeyTable(300)
    keys = [b"L" * 50 + b"%d" % i for i in range(100)]  # long: kept as objects
    assert table.insert_new(0, keys[50:51], np.array([299], dtype=np.int64))
    before = [sys.getrefcount(k) for k in keys]
    for _ in range(300):
        assert table.insert_new(0, keys, np.arange(100, dtype=np.int64)) is False  # keys[50] held: undone
    assert [sys.getrefcount(k) for k in keys] == before and len(table) == 1
    assert table.insert_new(1, keys, np.arange(100, dtype=np.int64))
    assert table.keys_of(np.arange(100, dtype=np.int64)) == keys
    table.remove(np.arange(100, dtype=np.int64))
    assert [sys.getrefcount(k) for k in keys] == before and len(table) == 1
