"""Block keys: the documented chain, deterministic across processes and hash seeds."""

import hashlib
import struct
import subprocess

import pytest

from kvxfer.core.errors import InvalidArgument
from kvxfer.geometry.keys import block_keys
from tests.conftest import PYTHON, python_env


def test_matches_the_documented_definition():
    tokens = list(range(100, 110))
    salt, extra = b"tenant-a", b"lora:math"
    h = hashlib.sha256(b"kvxfer-block-key-v1" + struct.pack("<I", len(salt)) + salt).digest()
    want = []
    for i in range(2):  # two full blocks of 4; the trailing 2 tokens have no key
        block = tokens[4 * i:4 * i + 4]
        h = hashlib.sha256(h + struct.pack("<I", 4) + struct.pack("<4I", *block) + struct.pack("<I", len(extra))
                           + extra).digest()
        want.append(h)
    assert block_keys(tokens, 4, extra=extra, salt=salt) == want


def test_golden_value_never_changes():
    """Keys stored by one version must be found by the next: this value is fixed forever."""
    assert block_keys([1, 2, 3, 4], 4)[0].hex() == "4439a135b59c2551dddc3e9b2abd20a96854e6bc1269e46e47fb8bfe217b40b6"


def test_prefix_chaining_and_isolation():
    a = block_keys(list(range(12)), 4)
    b = block_keys(list(range(8)) + [99, 99, 99, 99], 4)
    assert a[:2] == b[:2] and a[2] != b[2]  # shared prefix, then diverge
    assert block_keys(list(range(8)), 4, salt=b"t1") != block_keys(list(range(8)), 4, salt=b"t2")
    assert block_keys(list(range(8)), 4, extra=[b"x", b"y"]) != block_keys(list(range(8)), 4, extra=b"x")
    assert block_keys(list(range(4, 8)), 4, parent=a[0]) == a[1:2]  # continue a chain


def test_same_keys_in_other_processes_whatever_the_hash_seed():
    code = "from kvxfer.geometry.keys import block_keys; print(block_keys(list(range(64)), 16, salt=b's')[-1].hex())"
    outs = {subprocess.run([PYTHON, "-c", code], env={**python_env(), "PYTHONHASHSEED": seed}, capture_output=True,
                           text=True, check=True).stdout.strip() for seed in ("0", "1", "random")}
    assert outs == {block_keys(list(range(64)), 16, salt=b"s")[-1].hex()}


@pytest.mark.parametrize("bad", [dict(token_ids=[-1, 0], block_size=2), dict(token_ids=[2**32], block_size=1),
                                 dict(token_ids=[1, 2], block_size=0), dict(token_ids=[1, 2], block_size=1, extra=[b"x"])])
def test_bad_input(bad):
    with pytest.raises(InvalidArgument):
        block_keys(**bad)
