"""The CUDA copy engine's logic on a CPU: marshalling, polling, errors, cancellation.

The driver is FakeCudaLibrary (tests/fake_cuda.py), a ctypes stand-in that performs
the copies on host memory; what only a GPU can show runs in ``kvxfer devcheck``.
"""

import json
import subprocess

import pytest
import torch

from kvxfer.devcheck.plot import plot
from kvxfer.errors import DeadlineExceeded, FailedPrecondition
from kvxfer.geometry.checksum import rows_checksums
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.memory.cuda_driver import (CU_MEMCPY_SRC_ACCESS_ORDER_ANY, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                                       CU_STREAM_NON_BLOCKING, CudaError, Driver, load_library)
from kvxfer.memory.cuda_mem import ipc_handle_from_torch
from kvxfer.memory.pool import Pool
from kvxfer.records import Outcome
from kvxfer.serving.batch import TransferBatch
from kvxfer.serving.manager import PoolManager
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.base import CopyBatch, Direction
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.plan import plan_copies
from tests.conftest import PYTHON, ROOT, python_env
from tests.fake_cuda import FakeCudaLibrary

SPEC = KVSpec(3, 24, 4, 2, 8, torch.float16)  # 768 B blocks


def _engine(layout: str, lib: FakeCudaLibrary, capacity: int = 16, **kw):
    pl = PoolLayout(SPEC, PRESETS[layout])
    pool = torch.randint(0, 256, (pl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    host = HostTier(capacity, pl.block_bytes)
    return pl, pool, host, CudaCopyEngine(pool.data_ptr(), pl, host, Driver(lib), **kw)


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "LHBNC"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "looped"])
def test_the_plan_reaches_the_driver_whole_and_moves_the_same_bytes(layout, batched):
    lib = FakeCudaLibrary(batched=batched)
    pl, pool, host, engine = _engine(layout, lib)
    blocks, slots = [7, 3, 4, 5, 20], [2, 9, 10, 11, 0]
    handle = engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots))
    handle.wait()
    reference = HostTier(16, pl.block_bytes)
    CpuCopyEngine(pool.clone(), pl, reference).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert torch.equal(host.buffer, reference.buffer)
    descriptors = len(plan_copies(pl, blocks, slots))
    copies = [c for c in lib.calls if c[0] in ("cuMemcpyBatchAsync", "cuMemcpyAsync")]
    if batched:  # one call carrying every descriptor, in stream order for live KV
        assert handle.calls == 1 and copies == [("cuMemcpyBatchAsync", copies[0][1], descriptors,
                                                 (CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,) * descriptors)]
    else:
        assert handle.calls == descriptors == len(copies)
    back = list(reversed(blocks))
    engine.submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    expected = pool.clone()
    CpuCopyEngine(expected, pl, reference).submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    assert torch.equal(pool, expected)
    streams = {c[1] for c in lib.calls if c[0] in ("cuMemcpyBatchAsync", "cuMemcpyAsync")}
    assert len(streams) == 2 and all(lib.streams[s] == CU_STREAM_NON_BLOCKING for s in streams)
    if batched:
        restored = len(plan_copies(pl, back, slots))
        assert lib.calls[-1][3] == (CU_MEMCPY_SRC_ACCESS_ORDER_ANY,) * restored  # the tier bytes are stable


def test_completion_is_polled_and_bounded_by_a_deadline():
    lib = FakeCudaLibrary(not_ready_polls=5)
    _, _, host, engine = _engine("BLHNC", lib)
    engine.submit(CopyBatch(Direction.TO_HOST, [1, 2], [0, 1])).wait()  # five NOT_READY, then done
    lib.not_ready_polls = 10**9
    _, _, _, slow = _engine("BLHNC", lib, deadline_s=0.05)
    with pytest.raises(DeadlineExceeded):
        slow.submit(CopyBatch(Direction.TO_HOST, [1], [0])).wait()


def test_a_sticky_error_takes_the_pool_out_of_service_and_never_hangs():
    lib = FakeCudaLibrary()
    _, _, _, engine = _engine("BLHNC", lib)
    handle = engine.submit(CopyBatch(Direction.TO_HOST, [1], [0]))
    lib.query_error = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
        handle.wait()
    lib.query_error = 0
    with pytest.raises(FailedPrecondition, match="out of service"):
        engine.submit(CopyBatch(Direction.TO_HOST, [2], [1]))
    lib2 = FakeCudaLibrary()
    _, _, _, other = _engine("BLHNC", lib2)
    lib2.batch_error = 1  # invalid value: this batch fails, the engine stays usable
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        other.submit(CopyBatch(Direction.TO_HOST, [1], [0]))
    lib2.batch_error = 0
    other.submit(CopyBatch(Direction.TO_HOST, [1], [0])).wait()


def test_offload_waits_for_the_engines_event_and_cancels_between_chunks(shm_dir):
    lib = FakeCudaLibrary(not_ready_polls=1)
    with Pool.create("g", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir) as pool:
        pool.storage.copy_(torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8))
        host = HostTier(20, pool.layout.block_bytes)
        from kvxfer.serving.group import CacheGroup

        group = CacheGroup("g", pool.layout, 20)
        group.host = host
        manager = PoolManager(pool, group, engine=CudaCopyEngine(pool.storage.data_ptr(), pool.layout, host,
                                                                  Driver(lib)))
        manager.copier.chunk = 2  # blocks per chunk
        event = bytes(range(64))
        batch = TransferBatch.build(TransferBatch.offload("ns", [(1, b"a")], 24).kind, "ns", [1, 2, 3, 4, 5],
                                    [b"a", b"b", b"c", b"d", b"e"], 24, ready_event=event)
        assert manager.run(batch).outcomes == [Outcome.DONE] * 5
        opened = [c for c in lib.calls if c[0] == "cuIpcOpenEventHandle"]
        assert opened == [("cuIpcOpenEventHandle", event)]  # once: later chunks follow on the same stream
        waits = [i for i, c in enumerate(lib.calls) if c[0] == "cuStreamWaitEvent"]
        first_copy = next(i for i, c in enumerate(lib.calls) if c[0] == "cuMemcpyBatchAsync")
        assert waits and waits[0] < first_copy
        answers = iter([False, True, True, True])
        cancelled = manager.offload("ns", [(6, b"f"), (7, b"g"), (8, b"h"), (9, b"i"), (10, b"j")],
                                    cancelled=lambda: next(answers))
        assert cancelled.outcomes == [Outcome.CANCELLED] * 5 and manager.lookup("ns", [b"f"]).hits == 0
        assert manager.index.stats().pinned == 0
        restored = manager.restore("ns", [(b"c", 20), (b"d", 21)])
        assert restored.outcomes == [Outcome.DONE] * 2
        assert torch.equal(pool.storage[20 * 768:22 * 768], pool.storage[3 * 768:5 * 768])


@pytest.mark.parametrize("hash_threads,on_device", [(1, False), (3, False), (1, True)],
                         ids=["host-1-thread", "host-3-threads", "device-xxh3"])
def test_checksums_of_a_dma_engines_copies_catch_corruption(shm_dir, monkeypatch, hash_threads, on_device):
    """Tier copies hashed on the engine's host threads, or blocks hashed by the device XXH3 behind
    their copies (under Triton's interpreter here, when the fake's copies have landed)."""
    with Pool.create("h", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir) as pool:
        pool.storage.copy_(torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8))
        from kvxfer.serving.group import CacheGroup

        group = CacheGroup("h", pool.layout, 20)
        engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, group.host, Driver(FakeCudaLibrary()),
                                pool=pool.storage if on_device else None, hash_threads=hash_threads)
        manager = PoolManager(pool, group, engine=engine)
        manager.copier.chunk = 4  # blocks per chunk: several chunks, one partial
        assert engine.hashes_copies is on_device
        rows = group.host.buffer.numpy()
        if on_device:  # no host pass at all
            monkeypatch.setattr(manager.copier, "_tier_checksums", None)
        keys = [b"k%d" % b for b in range(1, 11)]
        assert manager.offload("ns", list(zip(range(1, 11), keys))).outcomes == [Outcome.DONE] * 10
        slots = [manager.index.locate("ns", k) for k in keys]
        if not on_device:
            assert manager.copier._tier_checksums(slots) == rows_checksums(rows[s] for s in slots)
        rows[slots[6]][5] ^= 1  # a bit flips in the tier
        restored = manager.restore("ns", list(zip(keys, range(11, 21))))
        assert restored.outcomes == [Outcome.DONE] * 6 + [Outcome.DATA_LOSS] + [Outcome.DONE] * 3
        span = pool.layout.block_bytes
        assert torch.equal(pool.storage[11 * span:17 * span], pool.storage[span:7 * span])
        assert manager.lookup("ns", [keys[6]]).hits == 0  # the corrupt entry is dropped


def test_a_device_checksum_that_cannot_be_enqueued_fails_the_chunk_after_its_copies_land(shm_dir, monkeypatch):
    lib = FakeCudaLibrary()
    with Pool.create("f", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir) as pool:
        from kvxfer.serving.group import CacheGroup

        group = CacheGroup("f", pool.layout, 8)
        engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, group.host, Driver(lib), pool=pool.storage)
        manager = PoolManager(pool, group, engine=engine)

        def out_of_memory(stream, blocks):
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(manager.engine._hasher, "enqueue", out_of_memory)
        assert manager.offload("ns", [(1, b"a"), (2, b"b")]).outcomes == [Outcome.FAILED] * 2
        assert not any(lib.pending.values())  # the chunk's copies landed before the error was raised
        assert manager.lookup("ns", [b"a"]).hits == 0 and manager.index.stats().pinned == 0


def test_torchs_shared_storage_handle_yields_the_cuda_ipc_handle():
    """torch 2.x prefixes a version and a type byte (seen on an H200: 66 bytes from torch 2.11)."""
    handle = bytes(range(64))
    assert ipc_handle_from_torch(handle) == handle  # older torch: the bare handle
    for version in (1, 2, 3):
        assert ipc_handle_from_torch(bytes([version]) + b"c" + handle) == handle
    with pytest.raises(FailedPrecondition, match="expandable_segments:False"):
        ipc_handle_from_torch(b"\x02e" + bytes(100))
    with pytest.raises(FailedPrecondition, match="does not know"):
        ipc_handle_from_torch(b"\x02x" + handle)


def test_pinning_registers_in_place_and_checks_the_memory_type():
    lib = FakeCudaLibrary()
    driver = Driver(lib)
    buffer = torch.zeros(1000, dtype=torch.uint8)
    driver.pin(buffer.data_ptr(), 1000)
    assert lib.registered == {buffer.data_ptr(): 1000}  # exactly the size asked for: no rounding up
    driver.unpin(buffer.data_ptr())
    assert lib.registered == {}


def test_no_driver_no_device_is_a_clear_error():
    with pytest.raises(FailedPrecondition, match="no CUDA driver"):
        load_library("libcuda-not-here.so.1")


def test_devcheck_without_a_gpu_says_so_and_exits_3(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "kvxfer.devcheck", "--out", str(tmp_path)], env=python_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1 and "no GPU" in proc.stdout


def test_a_cuda_handle_and_its_gpu_uuid_survive_the_wire():
    from kvxfer import wire
    from kvxfer.memory.pool import PoolDescriptor, PoolHandle
    from kvxfer.records import Medium

    handle = PoolHandle(Medium.CUDA, ipc_handle=bytes(range(64)), device=3, offset=4096,
                        device_uuid="GPU-6f1d2c3b-0000-1111-2222-333344445555")
    desc = PoolDescriptor("gpu0", SPEC, PRESETS["BLHNC"], handle, epoch=77, owned=False)
    back = wire.descriptor_from_pb(wire.pb.PoolInfo.FromString(wire.pool_info(desc).SerializeToString()))
    assert back == desc and back.handle.device_uuid.startswith("GPU-")


@pytest.mark.parametrize("layout", sorted(PRESETS))
def test_gpu_views_have_the_cpu_views_strides_and_offsets(layout):
    """The views an engine builds over a CUDA pool (checked on the meta device: same code path,
    no memory) have exactly the shapes, strides and offsets of the CPU pool's views."""
    pl = PoolLayout(SPEC, PRESETS[layout])
    cpu = pl.views(torch.zeros(pl.nbytes, dtype=torch.uint8))
    meta = pl.views(torch.empty(pl.nbytes, dtype=torch.uint8, device="meta"))
    for (kc, vc), (km, vm) in zip(cpu, meta):
        for c, m in ((kc, km), (vc, vm)):
            assert (c.shape, c.stride(), c.storage_offset(), c.dtype) == (m.shape, m.stride(), m.storage_offset(),
                                                                        m.dtype)


def test_devcheck_plots_a_recorded_run(tmp_path):
    report = json.loads((ROOT / "docs" / "devcheck" / "2026-11-30-3-device-checksums.json").read_text())
    assert plot(report, str(tmp_path / "bandwidth.png"))
    assert (tmp_path / "bandwidth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot({"stages": []}, str(tmp_path / "none.png"))  # the bandwidth stage did not run
