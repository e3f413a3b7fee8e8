"""The key table against a dict: any interleaving of batched inserts, removals (tombstones,
rebuilds) and lookups finds exactly what the dict holds, also when every hash collides."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.index import keytable
from kvxfer.index.keytable import KeyTable

KEYS = [b"k%d" % i for i in range(40)]
op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 3), st.lists(st.sampled_from(KEYS), max_size=12, unique=True)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.lists(st.sampled_from(KEYS), max_size=12, unique=True)),
    st.tuples(st.just("find"), st.integers(0, 3), st.lists(st.sampled_from(KEYS), max_size=20)))


def run_model(capacity: int, ops: list) -> None:
    owner_ns, owner_key = np.zeros(capacity, dtype=np.int32), np.empty(capacity, dtype=object)
    table = KeyTable(capacity, owner_ns, owner_key)
    model: dict[tuple[int, bytes], int] = {}
    free = list(range(capacity))
    for kind, ns, keys in ops:
        if kind == "insert":
            keys = [k for k in keys if (ns, k) not in model][:len(free)]
            slots = [free.pop() for _ in keys]
            owner_ns[slots], owner_key[slots] = ns, keys  # the index writes its owners first
            table.insert(ns, keys, np.array(slots, dtype=np.int64))
            model.update({(ns, k): s for k, s in zip(keys, slots)})
        elif kind == "remove":
            slots = [model.pop((ns, k)) for k in keys if (ns, k) in model]
            table.remove(np.array(slots, dtype=np.int64))
            owner_key[slots] = None
            free += slots
        got = table.find(ns, keys).tolist() if keys else []
        assert got == [model.get((ns, k), -1) for k in keys]
    for ns in range(4):
        assert table.find(ns, KEYS).tolist() == [model.get((ns, k), -1) for k in KEYS]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.lists(op, max_size=60))
def test_the_table_finds_what_a_dict_holds(capacity, ops):
    run_model(capacity, ops)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.lists(op, max_size=60))
def test_colliding_hashes_never_hand_out_another_keys_slot(capacity, ops):
    with pytest.MonkeyPatch.context() as mp:  # every key of a namespace in one of two cells
        mp.setattr(keytable, "_hashes", lambda ns, keys: np.array([hash(k) & 1 for k in keys], dtype=np.int64))
        run_model(capacity, ops)


def test_churn_stays_bounded_and_exact():
    capacity = 1000
    owner_ns, owner_key = np.zeros(capacity, dtype=np.int32), np.empty(capacity, dtype=object)
    table = KeyTable(capacity, owner_ns, owner_key)
    for round_ in range(50):  # 50,000 inserts and removals through 1,000 slots: many rebuilds
        keys = [b"r%d-%d" % (round_, i) for i in range(capacity)]
        slots = np.arange(capacity)
        owner_key[:] = keys
        table.insert(0, keys, slots)
        assert (table.find(0, keys) == slots).all()
        table.remove(slots)
        assert (table.find(0, keys) == -1).all()
    assert table._gone <= (table._mask + 1) // 4
