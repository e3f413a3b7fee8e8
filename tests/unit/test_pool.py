"""Pool storage: zero-copy mapping from another process, permissions, and cleanup on every exit path."""

import os
import signal
import stat
import subprocess
import textwrap
import time

import pytest
import torch

from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.core.records import Medium
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.memory import shm
from kvxfer.memory.pool import Pool, PoolDescriptor, PoolHandle
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire import messages as wire
from tests.conftest import PYTHON, python_env

SPEC = KVSpec(num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", textwrap.dedent(code), *args], env=python_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "flash_attn"])
def test_second_process_maps_and_sees_bytes(shm_dir, layout):
    with Pool.create("p0", SPEC, PRESETS[layout], shm_dir=shm_dir) as pool:
        k, v = pool.views()[1]
        k[3].copy_(torch.arange(k[3].numel(), dtype=torch.float32).reshape(k[3].shape))
        v[5].fill_(-2.5)
        child = run_child("""
            import sys, torch
            from kvxfer.wire import messages as wire
            from kvxfer.memory.pool import Pool
            from kvxfer.v1 import kvxfer_pb2 as pb
            pool = Pool.attach(wire.descriptor_from_pb(pb.PoolInfo.FromString(bytes.fromhex(sys.argv[1]))))
            k, v = pool.views()[1]
            assert torch.equal(k[3].float().reshape(-1), torch.arange(k[3].numel(), dtype=torch.float32)), "K differs"
            assert bool((v[5] == -2.5).all()), "V differs"
            pool.views()[2][0][7].fill_(1.0)   # and write back
            print("ok")
        """, wire.pool_info(pool.descriptor).SerializeToString().hex())
        assert child.returncode == 0, child.stderr
        assert bool((pool.views()[2][0][7] == 1.0).all())
    assert list(shm_dir.iterdir()) == []


def test_mode_and_descriptor(shm_dir):
    pool = Pool.create("p1", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir, mode=0o640, unix_group=os.getgid())
    path = pool.descriptor.handle.path
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()
    assert st.st_size == SPEC.nbytes
    assert pool.descriptor.handle.medium is Medium.SHM
    desc = wire.descriptor_from_pb(pb.PoolInfo.FromString(wire.pool_info(pool.descriptor).SerializeToString()))
    assert desc == pool.descriptor
    assert pool.storage.eq(0).all()  # a new pool is zeroed, the null block included
    other = Pool.create("p1", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir)
    assert other.descriptor.epoch != pool.descriptor.epoch  # a new epoch each time
    pool.close()
    other.close()
    assert not os.path.exists(path)
    with pytest.raises(InvalidArgument):
        pool.views()


def test_bad_inputs(shm_dir):
    with pytest.raises(InvalidArgument):
        Pool.create("bad/name", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir)
    with pytest.raises(InvalidArgument):
        Pool.create("p", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir, unix_group="no-such-group-kvxfer")
    with pytest.raises(InvalidArgument):
        Pool.create("p", SPEC, PRESETS["BLHNC"], device="meta")
    with pytest.raises(FailedPrecondition):
        Pool.create("p", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir / "missing")
    assert list(shm_dir.iterdir()) == []


def test_registered_pool_maps_someone_elses_file(shm_dir):
    """A file an engine allocated itself, at an offset, described by its geometry."""
    pl = PoolLayout(SPEC, PRESETS["LBHNC"])
    path = shm_dir / "engine-kv"
    path.write_bytes(b"\xff" * 4096 + bytes(pl.nbytes))
    desc = PoolDescriptor("engine", SPEC, PRESETS["LBHNC"], PoolHandle(Medium.SHM, str(path), offset=4096),
                          owned=False)
    pool = Pool.attach(desc)
    pool.views()[0][0][1].fill_(3.0)
    raw = path.read_bytes()
    assert raw[:4096] == b"\xff" * 4096  # nothing before the offset touched
    assert any(raw[4096:])
    pool.close()
    assert path.exists()  # not ours to remove
    too_big = PoolDescriptor("engine", KVSpec(3, 64, 4, 2, 8, torch.bfloat16), PRESETS["LBHNC"],
                             PoolHandle(Medium.SHM, str(path)), owned=False)
    with pytest.raises(InvalidArgument, match="does not fit"):
        Pool.attach(too_big)
    with pytest.raises(FailedPrecondition):
        Pool.attach(PoolDescriptor("x", SPEC, PRESETS["LBHNC"], PoolHandle(Medium.SHM, str(shm_dir / "nope"))))


OWNER = """
    import sys, time
    from pathlib import Path
    import torch
    from kvxfer.geometry.layout import PRESETS, KVSpec
    from kvxfer.memory.pool import Pool, exit_on_signals
    exit_on_signals()
    pool = Pool.create("owner", KVSpec(2, 4, 4, 2, 8, torch.float16), PRESETS["BLHNC"], shm_dir=sys.argv[1])
    print(pool.descriptor.handle.path, flush=True)
    how = sys.argv[2]
    if how == "raise":
        raise RuntimeError("boom")
    if how in ("wait", "kill"):
        time.sleep(60)
"""


@pytest.mark.parametrize("how,expect_rc", [("exit", 0), ("raise", 1)])
def test_no_file_left_after_exit_or_exception(shm_dir, how, expect_rc):
    child = run_child(OWNER, str(shm_dir), how)
    assert child.returncode == expect_rc, child.stderr
    assert child.stdout.strip().startswith(str(shm_dir))
    assert list(shm_dir.iterdir()) == []


def _start_owner(shm_dir, how):
    proc = subprocess.Popen([PYTHON, "-c", textwrap.dedent(OWNER), str(shm_dir), how], env=python_env(),
                            stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert os.path.exists(path)
    return proc, path


def test_no_file_left_after_sigterm(shm_dir):
    proc, path = _start_owner(shm_dir, "wait")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not os.path.exists(path)


def test_file_of_a_killed_owner_is_swept(shm_dir):
    proc, path = _start_owner(shm_dir, "kill")
    assert shm.sweep_stale(shm_dir) == []  # alive: its lock is held
    proc.kill()
    proc.wait(timeout=30)
    time.sleep(0.1)
    assert os.path.exists(path)  # SIGKILL runs nothing
    with Pool.create("next", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir) as pool:
        assert not os.path.exists(path)  # swept at the next create
        assert [p.name for p in shm_dir.iterdir()] == [os.path.basename(pool.descriptor.handle.path)]
