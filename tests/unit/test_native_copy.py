"""The C copy loop (kvxfer/transfer/_fused.c through kvxfer.transfer.native): built, the same
checksum as python-xxhash, safe with several callers at once and after fork, refused when off.
Its results for every layout are checked in tests/property/test_cpu_engine_props.py."""

import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer.core.errors import Internal
from kvxfer.geometry.block_checksum import block_checksum, rows_checksums
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import CopyBatch, Direction, native
from kvxfer.transfer.cpu import CpuCopyEngine
from tests.helpers import read_block


def test_the_c_loop_is_built_and_loaded():
    assert native.load() is not None, (
        "kvxfer/transfer/_fused.c was not built: install a C compiler (apt-get install gcc libc6-dev) "
        "and reinstall (make install); the log above says why it did not load")


def test_off_when_the_environment_says_so(monkeypatch):
    monkeypatch.setenv(native.ENV_DISABLE, "0")
    assert native.load.__wrapped__() is None


def _rig(num_blocks: int = 64, capacity: int = 64):
    pl = PoolLayout(KVSpec(2, num_blocks, 4, 2, 64, torch.float16), PRESETS["BLHNC"])
    pool = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    return pl, pool, HostTier(capacity, pl.block_bytes)


@pytest.mark.parametrize("layout, head_size", [("BLHNC", 400), ("LBHNC", 400), ("LBHNC", 1600)])
def test_blocks_larger_than_a_piece_are_hashed_piece_by_piece_to_the_same_checksum(layout, head_size):
    """Blocks over 128 KiB are copied and hashed in pieces (XXH3's streaming API): one row cut
    into pieces and a partial last piece (BLHNC: one 200 KiB row), rows under a piece (LBHNC:
    4 rows of 50 KiB) and rows over one (4 of 200 KiB); both directions, scattered slots."""
    pl = PoolLayout(KVSpec(4, 9, 4, 4, head_size, torch.float32), PRESETS[layout])
    assert pl.block_bytes > 128 << 10
    pool = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    host = HostTier(6, pl.block_bytes)
    engine = CpuCopyEngine(pool, pl, host, threads=2)
    blocks, slots = [3, 1, 7, 5], [4, 0, 2, 5]
    sums = engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert sums == host.checksums(slots)
    assert sums == [block_checksum(read_block(pool, pl, b).numpy()) for b in blocks]
    back = [2, 8, 4, 6]
    assert engine.submit(CopyBatch(Direction.TO_POOL, back, slots)).wait() == sums
    assert all(torch.equal(read_block(pool, pl, b), host.buffer[s]) for b, s in zip(back, slots))


def test_concurrent_callers_each_get_their_own_bytes_and_checksums():
    """Batches from several Python threads (the daemon serves several requests at once), with
    different thread counts: the C loop runs one batch at a time and no step is lost or mixed."""
    pl, pool, host = _rig(num_blocks=257, capacity=256)
    engines = [CpuCopyEngine(pool, pl, host, threads=t) for t in (1, 2, 4, 3)]
    rows = pool.numpy().reshape(pl.spec.num_blocks, pl.block_bytes)

    def offload(i: int) -> bool:
        blocks = list(range(1 + i * 64, 1 + (i + 1) * 64))
        slots = list(range(i * 64, (i + 1) * 64))
        ok = True
        for _ in range(20):
            engine = engines[i]
            engine._step = 1 + i  # steps of 1-4 blocks: many claims per batch
            sums = engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
            ok &= sums == rows_checksums(rows[b] for b in blocks)
            ok &= bool((host.buffer.numpy()[slots] == rows[blocks]).all())
        return ok

    with ThreadPoolExecutor(4) as pool_threads:
        assert all(pool_threads.map(offload, range(4)))


def _comm(task: Path) -> str:
    """A thread's name; "" for one that ended between the listing and the read (another test's thread)."""
    try:
        return (task / "comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_helper_threads_are_named_and_block_every_signal_but_sigbus():
    pl, pool, host = _rig()
    engine = CpuCopyEngine(pool, pl, host, threads=3)
    engine._step = 1  # 40 steps: the helpers start
    engine.submit(CopyBatch(Direction.TO_HOST, list(range(1, 41)), list(range(40)))).wait()
    deadline = time.monotonic() + 5
    while True:  # a helper names itself once it runs, maybe after the batch is done
        helpers = [task for task in Path("/proc/self/task").iterdir() if _comm(task) == "kvxfer-copy"]
        if len(helpers) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(helpers) >= 2
    for task in helpers:
        blocked = next(line for line in (task / "status").read_text().splitlines() if line.startswith("SigBlk:"))
        unblockable = (1 << 8) | (1 << 18) | (1 << 31) | (1 << 32)  # SIGKILL, SIGSTOP, glibc's internal two
        sigbus = 1 << (signal.SIGBUS - 1)  # a guarded copy's fault: blocked, the kernel would kill the process
        mask = int(blocked.split()[1], 16)
        assert mask | unblockable | sigbus == (1 << 64) - 1 and not mask & sigbus, blocked


def test_a_forked_child_copies_without_its_parents_helper_threads():
    pl, pool, host = _rig()
    engine = CpuCopyEngine(pool, pl, host, threads=2)
    engine.submit(CopyBatch(Direction.TO_HOST, [1, 2], [0, 1])).wait()  # the parent's helper is running
    pid = os.fork()
    if pid == 0:  # the child: its helper threads are gone; the loop starts new ones
        try:
            blocks = list(range(1, 41))
            sums = engine.submit(CopyBatch(Direction.TO_HOST, blocks, list(range(40)))).wait()
            rows = pool.numpy().reshape(pl.spec.num_blocks, pl.block_bytes)
            os._exit(0 if sums == rows_checksums(rows[b] for b in blocks) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("span", [4096, 300_000])  # under and over a piece
def test_hash_only_batches_checksum_each_span_on_every_thread_count(span):
    rows = np.random.default_rng(span).integers(0, 256, (24, span), dtype=np.uint8)
    spans = np.array([5, 0, 23, 7, 7, 12, 3, 19, 1], dtype=np.int64)
    expected = [block_checksum(rows[s]) for s in spans]
    for threads in (1, 2, 3):
        for step in (1, 2, 10):
            assert native.load().hash_spans(rows, spans, step, threads) == expected
    with pytest.raises(Internal):
        native.load().hash_spans(rows[:, ::2], spans, 1, 2)


def test_mismatched_arrays_are_refused_before_any_copy():
    copier = native.load()
    dst, src = np.zeros((4, 64), dtype=np.uint8), np.ones((4, 32), dtype=np.uint8)
    rows = np.arange(4, dtype=np.int64)
    with pytest.raises(Internal, match="mismatched"):
        copier.copy_hash(dst, src, rows, rows, dst, rows, 1, 2)
    with pytest.raises(Internal, match="mismatched"):
        copier.copy_hash(dst, dst, rows.astype(np.int32), rows, dst, rows, 1, 2)
    assert not dst.any()
    assert copier.copy_hash(dst, dst, rows[:0], rows[:0], dst, rows[:0], 1, 2) == []


SANITIZERS = {"thread": {"TSAN_OPTIONS": "die_after_fork=0 halt_on_error=1"},  # the child calls no sanitizer-unsafe code
              "address,undefined": {"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "halt_on_error=1"}}


@pytest.mark.parametrize("sanitizer", list(SANITIZERS))
def test_the_c_loop_under_sanitizers(sanitizer, tmp_path):
    """Data races (ThreadSanitizer), out-of-bounds accesses, leaks and undefined behaviour
    (AddressSanitizer, UBSan) in the loop, its helper threads and its fork handler; built to stream
    batches of 256 bytes or more, so the stress's batches take the streamed path too."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler: apt-get install gcc libc6-dev")
    here = Path(__file__).parent
    binary = tmp_path / "stress"
    loop = here.parents[1] / "kvxfer" / "transfer"
    subprocess.run([compiler, "-O1", "-g", f"-fsanitize={sanitizer}", "-pthread", f"-I{loop}", "-DSTREAM_MIN_BYTES=256",
                    str(here / "native_stress.c"),
                    str(loop / "_fused.c"), str(loop / "_guard.c"), "-o", str(binary)], check=True)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **SANITIZERS[sanitizer]})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-4000:]
