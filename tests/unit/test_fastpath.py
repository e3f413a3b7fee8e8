"""The C passes of per-key bookkeeping (kvxfer/_fastpath.c) against the Python passes they stand in for."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import kvxfer.index.block_index as block_index
import kvxfer.tiers.slots as slots_module
import kvxfer.validate as validate
from kvxfer.errors import InvalidArgument
from kvxfer.fastpath import FAST


class SubBytes(bytes):
    pass


def test_the_fast_path_is_built_and_loaded():
    assert FAST is not None, "kvxfer._fastpath is not built: apt-get install gcc libc6-dev, then reinstall"


def _both(monkeypatch, fn, *args):
    """fn's result (or InvalidArgument message) with the C pass, then with Python alone."""
    out = []
    for fast in (FAST, None):
        monkeypatch.setattr(validate, "FAST", fast)
        try:
            out.append(("ok", fn(*args)))
        except InvalidArgument as exc:
            out.append(("refused", str(exc)))
    return out


KEY_CASES = [[b"a", b"b"], [b"a", b"a"], [b""], [b"x" * 256], [b"x" * 257], [b"a", "b"], [b"a", bytearray(b"b")],
             [memoryview(b"a")], [b"a", None], [b"a", 5], [SubBytes(b"a")], [b"a", [b"b"]]]


@pytest.mark.parametrize("keys", KEY_CASES, ids=range(len(KEY_CASES)))
@pytest.mark.parametrize("unique", [True, False])
def test_key_checks_answer_as_the_python_pass_does(monkeypatch, keys, unique):
    with_c, python = _both(monkeypatch, lambda: validate.checked_keys(keys, unique=unique))
    assert with_c == python


SLOT_CASES = [[1, 2, 3], [9], [0], [-1], [10], [1, 1], [True], [np.int64(3)], [2**70], [1.0], ["1"], [3, 2, 9]]


@pytest.mark.parametrize("slots", SLOT_CASES, ids=range(len(SLOT_CASES)))
def test_slot_checks_answer_as_the_python_pass_does(monkeypatch, slots):
    with_c, python = _both(monkeypatch, lambda: validate.check_blocks(slots, 10))
    assert with_c == python


def test_insert_new_maps_all_or_changes_nothing():
    space = {b"old": 7}
    keys = [b"k%d" % i for i in range(5)]
    refs = [sys.getrefcount(k) for k in keys]
    assert FAST.insert_new(space, keys, 100, None) and space == {b"old": 7, **{k: 100 + i for i, k in enumerate(keys)}}
    space = {b"old": 7}
    assert FAST.insert_new(space, keys, 0, [4, 3, 2, 1, 0]) and [space[k] for k in keys] == [4, 3, 2, 1, 0]
    for bad in ([b"a", b"old", b"b"], [b"a", b"b", b"a"], [b"a", "str"]):  # held already, twice, not bytes
        space = {b"old": 7}
        assert FAST.insert_new(space, bad, 10, None) is False and space == {b"old": 7}
    assert [sys.getrefcount(k) for k in keys] == refs  # nothing kept that was given back
    with pytest.raises(ValueError):
        FAST.insert_new({}, keys, 0, [1, 2])


def test_find_pop_owned_and_ints_into():
    space = {b"a": 3, b"b": 5, b"c": 9}
    found = np.empty(4, dtype=np.int64)
    FAST.find(space, [b"c", b"zz", b"a", b"b"], found)
    assert found.tolist() == [9, -1, 3, 5]
    FAST.set_slots(space, [b"a", b"c"], 40)
    assert space == {b"a": 40, b"b": 5, b"c": 41}
    space[b"a"] = 3
    assert FAST.pop_owned(space, [b"a", b"b", b"zz"], np.array([3, 6, 1], dtype=np.int64)) == 1
    assert space == {b"b": 5, b"c": 41}  # b maps to another slot now: it stays
    with pytest.raises(ValueError):
        FAST.find(space, [b"a"], np.empty(2, dtype=np.int64))
    with pytest.raises(ValueError):
        FAST.pop_owned(space, [b"a"], np.empty(2, dtype=np.int64))
    out = np.empty(3, dtype=np.uint64)
    assert FAST.ints_into([0, 2**64 - 1, 5], out, False) and out.tolist() == [0, 2**64 - 1, 5]
    assert not FAST.ints_into([1, -1, 2], out, False) and not FAST.ints_into([1, 2**64, 2], out, False)
    signed = np.empty(2, dtype=np.int64)
    assert FAST.ints_into([-5, 2**63 - 1], signed, True) and signed.tolist() == [-5, 2**63 - 1]
    assert not FAST.ints_into([2**63, 1], signed, True) and not FAST.ints_into([None, 1], signed, True)


def test_int_array_falls_back_to_numpy_for_what_the_c_pass_does_not_take():
    assert slots_module.int_array([1, 2, 3], np.int64).tolist() == [1, 2, 3]
    assert slots_module.int_array(np.array([4, 5]), np.int64).tolist() == [4, 5]
    assert slots_module.int_array([np.int64(6)], np.int64).tolist() == [6]  # not an exact int: numpy converts
    with pytest.raises(TypeError):
        slots_module.int_array([None], np.uint64)  # complete_store tells failed stores by this


def test_no_references_leak_over_many_conflicting_inserts():
    keys = [b"n%d" % i for i in range(100)]
    values = [10_000 + i for i in range(100)]  # not small ints: each its own object
    space = {keys[50]: 1}
    before = [sys.getrefcount(k) for k in keys + values]
    for _ in range(1000):
        assert not FAST.insert_new(space, keys, 1000, None)
        assert not FAST.insert_new(space, keys, 0, values)
        found = np.empty(100, dtype=np.int64)
        FAST.find(space, keys, found)
    after = [sys.getrefcount(k) for k in keys + values]
    assert after == before and list(space.items()) == [(keys[50], 1)]


def test_the_index_runs_its_python_passes_alone_when_the_module_is_absent(monkeypatch):
    for module in (validate, block_index, slots_module):
        monkeypatch.setattr(module, "FAST", None)
    index = block_index.BlockIndex(block_index.TierKind.HOST, 3)
    plan = index.prepare_store("ns", [b"a", b"b"])
    index.complete_store(plan.slots, [11, 12])
    assert index.prepare_store("ns", [b"b", b"c", b"d"]).outcomes[0].value == "already_present"


def test_the_c_passes_under_address_sanitizer_and_ubsan(tmp_path):
    """Out-of-bounds accesses and undefined behaviour in the module, over random calls of every
    function (the sanitizer runtimes preloaded into an ordinary Python)."""
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler: apt-get install gcc libc6-dev")
    here = Path(__file__).parent
    module = tmp_path / "_fastpath.so"
    subprocess.run([compiler, "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fPIC",
                    "-shared", f"-I{sysconfig.get_paths()['include']}", str(here.parents[1] / "kvxfer" / "_fastpath.c"),
                    "-o", str(module)], check=True)
    runtimes = [subprocess.run([compiler, f"-print-file-name={lib}"], capture_output=True, text=True,
                               check=True).stdout.strip() for lib in ("libasan.so", "libubsan.so")]
    env = {**os.environ, "LD_PRELOAD": ":".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0",  # CPython's own
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    run = subprocess.run([sys.executable, str(here / "fastpath_stress.py"), str(module)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-4000:]


HOSTILE_KEY = """
import numpy as np
from kvxfer.fastpath import FAST

victims = []


class Evil(bytes):  # a library caller's key whose comparison empties the caller's list of keys
    __hash__ = bytes.__hash__

    def __eq__(self, other):
        for victim in victims:
            victim.clear()
        return bytes.__eq__(self, other)


def attempt(call):  # a changed list may end the pass with RuntimeError; it must never crash
    try:
        return call()
    except RuntimeError:
        return "refused"


keys = [b"k%d" % i for i in range(4000)]
victims.append(keys)
out = np.empty(len(keys), dtype=np.int64)
attempt(lambda: FAST.find({Evil(keys[0]): 1}, keys, out))
more = [b"k%d" % i for i in range(4000)]
victims[:] = [more]
assert attempt(lambda: FAST.insert_new({Evil(more[-1]): 1}, more, 10, None)) in (False, "refused")
owned = [b"k%d" % i for i in range(4000)]
victims[:] = [owned]
attempt(lambda: FAST.pop_owned({Evil(owned[0]): 0, **{k: i for i, k in enumerate(owned[1:], 1)}}, owned,
                               np.arange(len(owned), dtype=np.int64)))
slots = [b"k%d" % i for i in range(4000)]
victims[:] = [slots]
attempt(lambda: FAST.set_slots({Evil(slots[1]): 0}, slots, 5))
print("survived", int(out[0]))
"""


def test_a_key_whose_comparison_changes_the_callers_list_never_crashes_the_c_passes():
    proc = subprocess.run([sys.executable, "-c", HOSTILE_KEY], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and "survived 1" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_keys_of_bytes_subclasses_enter_the_index_as_exact_bytes(monkeypatch):
    for fast in (FAST, None):
        monkeypatch.setattr(validate, "FAST", fast)
        checked = validate.checked_keys([SubBytes(b"a"), b"b", bytearray(b"c")])
        assert checked == [b"a", b"b", b"c"] and {type(k) for k in checked} == {bytes}


def test_the_c_passes_and_the_key_space_choose_the_same_shard():
    """A namespace's keys in shards (kvxfer.index.keyspace): what C puts in, Python finds, and back."""
    from kvxfer.index.keyspace import KeySpace

    space = KeySpace(8)
    keys = [b"key-%d" % i for i in range(500)]
    assert FAST.insert_new(space.shards, keys[:250], 1000, None)
    for i, key in enumerate(keys[250:]):
        space[key] = 2000 + i
    found = np.empty(len(keys), dtype=np.int64)
    FAST.find(space.shards, keys, found)
    assert found.tolist() == [1000 + i for i in range(250)] + [2000 + i for i in range(250)]
    assert [space.get(k) for k in keys] == found.tolist()
    assert all(space.shards) and len(space) == 500  # spread over every shard
    assert FAST.pop_owned(space.shards, keys, found.copy()) == 500 and not space
    with pytest.raises(TypeError):
        FAST.find([{}, {}, {}], keys, found)  # three shards: not a key space
