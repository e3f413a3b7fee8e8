"""Random calls of every function of kvxfer's C modules, for a build under AddressSanitizer and UBSan
(tests/unit/test_fastpath.py runs it with the sanitizer runtime preloaded). argv[1]: the folder of the
built modules (_fastpath.so, _tables.so, _use_order.so)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np


def load(dotted: str):
    spec = importlib.util.spec_from_file_location(dotted, Path(sys.argv[1]) / f"{dotted.rsplit('.', 1)[1]}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAST, TABLES = load("kvxfer.core._fastpath"), load("kvxfer.index._tables")
USE_ORDER = load("kvxfer.index._use_order")
rng = np.random.default_rng(1)


def attempt(call):
    try:
        return call()
    except (ValueError, TypeError):
        return None


def int64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


for it in range(300):
    n = int(rng.integers(0, 200))
    keys = [b"k%d" % int(x) for x in rng.integers(0, 400, n)]
    FAST.keys_ok(keys, 256, True)
    FAST.keys_ok(keys + [b""], 256, False)
    slots = [int(x) for x in rng.integers(-3, 300, n)]
    FAST.slots_ok(slots, int(rng.integers(0, 300)))
    FAST.ints_into(slots, np.empty(len(slots), dtype=np.uint64), False)
    FAST.ints_into(slots, np.empty(len(slots), dtype=np.int64), True)

capacity = 64
table, order = TABLES.KeyTable(capacity), USE_ORDER.UseOrder(capacity)
for it in range(3000):
    ns = int(rng.integers(0, 3))
    n = int(rng.integers(0, 12))
    keys = list(dict.fromkeys(b"k%d" % int(x) * int(rng.integers(1, 30)) for x in rng.integers(0, 80, n)))  # long too
    slots = int64(rng.integers(-2, capacity + 2, len(keys)))
    attempt(lambda: table.insert_new(ns, keys, slots))
    out = np.empty(len(keys), dtype=np.int64)
    table.find(ns, keys, out)
    some = int64(rng.integers(-2, capacity + 2, int(rng.integers(0, 10))))
    attempt(lambda: table.keys_of(some))
    attempt(lambda: table.owners(some, np.empty(len(some), dtype=np.int32)))
    attempt(lambda: table.remove(np.unique(some)))
    attempt(lambda: table.find(ns, keys + ["str"], np.empty(len(keys) + 1, dtype=np.int64)))
    attempt(lambda: order.used(some))
    attempt(lambda: order.discard(some[:2]))
    attempt(lambda: order.peek(int(rng.integers(-2, capacity + 1)), np.empty(int(rng.integers(0, 9)), dtype=np.int64)))
table.remove(np.arange(capacity, dtype=np.int64))
assert len(table) == 0
print("ok")
