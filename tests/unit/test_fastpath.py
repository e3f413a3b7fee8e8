"""The C checks of per-key bookkeeping (kvxfer/core/_fastpath.c) against the Python passes they stand in for;
all three C modules under the sanitizers."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import kvxfer.core.slots as slots_module
import kvxfer.core.validate as validate
import kvxfer.index.block_index as block_index
import kvxfer.index.eviction as eviction
import kvxfer.index.keytable as keytable
from kvxfer.core.c_modules import FAST
from kvxfer.core.errors import InvalidArgument
from kvxfer.index.eviction import USE_ORDER
from kvxfer.index.keytable import TABLES


class SubBytes(bytes):
    pass


def test_the_c_modules_are_built_and_loaded():
    for name, module in (("core._fastpath", FAST), ("index._tables", TABLES), ("index._use_order", USE_ORDER)):
        assert module is not None, f"kvxfer.{name} is not built: apt-get install gcc libc6-dev, then reinstall"


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


def test_ints_into():
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


def test_the_index_runs_its_python_passes_alone_when_the_modules_are_absent(monkeypatch):
    for module in (validate, slots_module):
        monkeypatch.setattr(module, "FAST", None)
    monkeypatch.setattr(keytable, "TABLES", None)
    monkeypatch.setattr(eviction, "USE_ORDER", None)
    index = block_index.BlockIndex(block_index.TierKind.HOST, 3)
    plan = index.prepare_store("ns", [b"a", b"b"])
    index.complete_store(plan.slots, [11, 12])
    assert index.prepare_store("ns", [b"b", b"c", b"d"]).outcomes[0].value == "already_present"


def test_the_c_modules_under_address_sanitizer_and_ubsan(tmp_path):
    """Out-of-bounds accesses and undefined behaviour in the modules, over random calls of every
    function (the sanitizer runtimes preloaded into an ordinary Python)."""
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler: apt-get install gcc libc6-dev")
    here = Path(__file__).parent
    for package, name in (("core", "_fastpath"), ("index", "_tables"), ("index", "_use_order")):
        subprocess.run([compiler, "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fPIC",
                        "-shared", f"-I{sysconfig.get_paths()['include']}",
                        str(here.parents[1] / "kvxfer" / package / f"{name}.c"),
                        "-o", str(tmp_path / f"{name}.so")], check=True)
    runtimes = [subprocess.run([compiler, f"-print-file-name={lib}"], capture_output=True, text=True,
                               check=True).stdout.strip() for lib in ("libasan.so", "libubsan.so")]
    env = {**os.environ, "LD_PRELOAD": ":".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0",  # CPython's own
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    run = subprocess.run([sys.executable, str(here / "fastpath_stress.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-4000:]


def test_keys_of_bytes_subclasses_enter_the_index_as_exact_bytes(monkeypatch):
    for fast in (FAST, None):
        monkeypatch.setattr(validate, "FAST", fast)
        checked = validate.checked_keys([SubBytes(b"a"), b"b", bytearray(b"c")])
        assert checked == [b"a", b"b", b"c"] and {type(k) for k in checked} == {bytes}
