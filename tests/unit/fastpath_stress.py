"""Random calls of every kvxfer._fastpath function, for a build under AddressSanitizer and UBSan
(tests/unit/test_fastpath.py runs it with the sanitizer runtime preloaded). argv[1]: the built module."""

import importlib.util
import sys

import numpy as np

spec = importlib.util.spec_from_file_location("kvxfer._fastpath", sys.argv[1])
FAST = importlib.util.module_from_spec(spec)
spec.loader.exec_module(FAST)
rng = np.random.default_rng(1)
for it in range(300):
    n = int(rng.integers(0, 200))
    keys = [b"k%d" % int(x) for x in rng.integers(0, 400, n)]
    FAST.keys_ok(keys, 256, True)
    FAST.keys_ok(keys + [b""], 256, False)
    slots = [int(x) for x in rng.integers(-3, 300, n)]
    FAST.slots_ok(slots, int(rng.integers(0, 300)))
    space = {b"k%d" % int(x): int(x) for x in rng.integers(0, 400, int(rng.integers(0, 50)))}
    uniq = list(dict.fromkeys(keys))
    shards = [dict() for _ in range(1 << int(rng.integers(0, 4)))]  # a KeySpace's shards
    for keyspace in (space, shards):
        FAST.insert_new(keyspace, uniq, int(rng.integers(0, 1000)), None)
        FAST.insert_new(keyspace, uniq, 0, list(range(len(uniq))))
        FAST.set_slots(keyspace, uniq, int(rng.integers(0, 1000)))
        FAST.set_slots(keyspace, uniq, 0, list(range(len(uniq) // 2)))
        out = np.empty(len(uniq), dtype=np.int64)
        FAST.find(keyspace, uniq, out)
        FAST.pop_owned(keyspace, uniq, out.copy())
    for bad in ([], [{}, {}, {}], [{}, []]):  # not a power of two, not dicts: refused
        try:
            FAST.find(bad, uniq, np.empty(len(uniq), dtype=np.int64))
        except TypeError:
            pass
    FAST.ints_into(slots, np.empty(len(slots), dtype=np.uint64), False)
    FAST.ints_into(slots, np.empty(len(slots), dtype=np.int64), True)
print("ok")
