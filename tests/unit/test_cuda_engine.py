"""The CUDA copy engine on the CUDA simulator (tests/cudasim): streams that really run later, an
engine in another process writing KV on its own stream, events, contexts of two GPUs.

What only a GPU can show (bandwidth, the device XXH3 as compiled) runs in ``kvxfer devcheck``.
"""

import threading
import time

import pytest
import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import PRESETS, KVSpec
from kvxfer.memory import cuda_driver
from kvxfer.memory.cuda_abi import CU_MEMCPY_SRC_ACCESS_ORDER_ANY, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
from kvxfer.memory.cuda_driver import Driver
from kvxfer.memory.pool import Pool
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.plan import plan_copies
from tests.cudasim.engine import SimEngine

SPEC = KVSpec(3, 24, 4, 2, 8, torch.float16)  # 768 B blocks
SPAN = 768


def gpu_pool(name: str, device: int = 0, layout: str = "BLHNC", capacity: int = 16, on_device: bool = False,
             deadline_s: float = 30.0, staged: bool = False) -> PoolManager:
    """A daemon-owned pool on simulated GPU ``device`` with its pinned host tier, as the registry builds it
    (``on_device``: block-major blocks hashed by the device XXH3; ``staged``: layouts of short runs
    through staging buffers)."""
    pool = Pool.create(name, SPEC, PRESETS[layout], device=f"cuda:{device}")
    group = CacheGroup(name, pool.layout, capacity, pin_device=device)
    engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, group.host, cuda_driver.driver(device),
                            deadline_s=deadline_s, pool=pool.storage if on_device or staged else None,
                            device_checksums=on_device)
    return PoolManager(pool, group, engine=engine)


def fill(manager: PoolManager, seed: int = 3) -> torch.Tensor:
    """Random KV in the whole pool (written before any copy is enqueued)."""
    data = torch.randint(0, 256, (manager.pool.layout.nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    manager.pool.storage.copy_(data)
    return data


def offload(manager: PoolManager, blocks: list[int], keys: list[bytes], event: bytes = b"") -> list[Outcome]:
    batch = TransferBatch.build(TransferKind.OFFLOAD, "ns", blocks, keys, SPEC.num_blocks, ready_event=event)
    return manager.run(batch).outcomes


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "LHBNC"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "looped"])
def test_the_plan_reaches_the_driver_whole_and_moves_the_same_bytes(cuda_sim, layout, batched):
    pool = Pool.create("p", SPEC, PRESETS[layout], device="cuda:0")
    data = torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8)
    pool.storage.copy_(data)
    host = HostTier(16, pool.layout.block_bytes, pin_device=0)
    engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, host, Driver(cuda_sim, use_batch=batched))
    blocks, slots = [7, 3, 4, 5, 20], [2, 9, 10, 11, 0]
    cuda_sim.calls.clear()
    handle = engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots))
    handle.wait()
    reference = HostTier(16, pool.layout.block_bytes)
    CpuCopyEngine(data.clone(), pool.layout, reference).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert torch.equal(host.buffer, reference.buffer)
    descriptors = len(plan_copies(pool.layout, blocks, slots))
    copies = [c for c in cuda_sim.calls if c in ("cuMemcpyBatchAsync", "cuMemcpyAsync")]
    assert copies == (["cuMemcpyBatchAsync"] if batched else ["cuMemcpyAsync"] * descriptors)
    assert handle.calls == (1 if batched else descriptors)
    back = list(reversed(blocks))
    engine.submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    expected = data.clone()
    CpuCopyEngine(expected, pool.layout, reference).submit(CopyBatch(Direction.TO_POOL, back, slots)).wait()
    assert torch.equal(pool.storage, expected)
    assert cuda_sim.pageable_copies == 0 and not cuda_sim.violations  # pinned tier, no legacy stream
    assert CU_MEMCPY_SRC_ACCESS_ORDER_STREAM != CU_MEMCPY_SRC_ACCESS_ORDER_ANY


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC"], ids=["dma", "staged"])
def test_an_offload_waits_for_the_engines_event_and_without_it_reads_old_bytes(cuda_sim, layout, monkeypatch):
    """Not a stub: the engine (another process) writes the pool on its stream 0.3 s late. Without its
    event the daemon's copy (or its staging kernel) captures the old bytes (the bug every GPU engine
    would hit); with it, the new."""
    from kvxfer.transfer import staging

    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 4 * SPAN)
    manager = gpu_pool("g", layout=layout, staged=True)
    assert (manager.engine._stager is not None) is (layout == "LBHNC")
    engine = SimEngine(cuda_sim.region.path)
    try:
        engine("open", handle=manager.pool.descriptor.handle.ipc_handle.hex())
        everything = manager.pool.layout.nbytes  # every run of every block
        engine.forward(0, everything, 0x5A, delay_s=0.3)  # the forward pass, still running
        assert offload(manager, [3], [b"early"]) == [Outcome.DONE]
        assert bool((manager.host.buffer[manager.group.index.locate("ns", b"early")] == 0).all())  # stale KV stored
        event = engine.forward(0, everything, 0x6B, delay_s=0.3)
        assert offload(manager, [4], [b"late"], event) == [Outcome.DONE]
        assert bool((manager.host.buffer[manager.group.index.locate("ns", b"late")] == 0x6B).all())
        assert not cuda_sim.violations
    finally:
        engine.close()


def test_two_gpus_served_by_the_same_threads_keep_their_contexts(cuda_sim):
    """A pool per GPU, used alternately from one thread, with a torch-like device switch between."""
    first, second = gpu_pool("a", device=0), gpu_pool("b", device=1)
    data = [fill(first, 1), fill(second, 2)]
    other = cuda_driver.driver(1)
    for round_ in range(3):
        for i, manager in enumerate((first, second)):
            cuda_sim.cuCtxSetCurrent(other._ctx if i == 0 else cuda_driver.driver(0)._ctx)  # torch.cuda.set_device
            key = b"k%d" % round_
            assert offload(manager, [1 + round_], [key]) == [Outcome.DONE]
            assert manager.restore("ns", [(key, 10 + round_)]).outcomes == [Outcome.DONE]
            got = manager.pool.storage[(10 + round_) * SPAN:(11 + round_) * SPAN]
            assert torch.equal(got, data[i][(1 + round_) * SPAN:(2 + round_) * SPAN])
    assert not cuda_sim.violations and first.engine.driver.lost is None


@pytest.mark.parametrize("on_device", [False, True], ids=["host-hash", "device-xxh3"])
def test_checksums_of_a_dma_engines_copies_catch_corruption(cuda_sim, on_device, monkeypatch):
    """Tier copies hashed on the host, or blocks hashed by the device XXH3 behind their copies (Triton's
    interpreter here, once the simulated copies have run)."""
    manager = gpu_pool("h", capacity=20, on_device=on_device)
    data = fill(manager)
    manager.copier.chunk = 4  # blocks per chunk: several chunks in flight, one partial
    assert manager.engine.hashes_copies is on_device
    if on_device:  # no host pass at all
        monkeypatch.setattr(manager.copier, "tier_checksums", None)
    keys = [b"k%d" % b for b in range(1, 11)]
    cuda_sim.calls.clear()
    assert offload(manager, list(range(1, 11)), keys) == [Outcome.DONE] * 10
    if on_device:  # hashed on a side stream joined by an event a chunk: the copy stream never waits for it
        assert manager.engine._streams[Direction.TO_HOST].side is not None
        assert cuda_sim.calls.count("cuStreamWaitEvent") == 3  # three chunks
    slots = [manager.group.index.locate("ns", k) for k in keys]
    manager.host.buffer[slots[6], 5] ^= 1  # a bit flips in the tier
    restored = manager.restore("ns", list(zip(keys, range(11, 21))))
    assert restored.outcomes == [Outcome.DONE] * 6 + [Outcome.DATA_LOSS] + [Outcome.DONE] * 3
    assert torch.equal(manager.pool.storage[11 * SPAN:17 * SPAN], data[SPAN:7 * SPAN])
    assert manager.lookup("ns", [keys[6]]).hits == 0  # the corrupt entry is dropped


def test_a_device_checksum_that_cannot_be_enqueued_fails_the_chunk_after_its_copies_land(cuda_sim, monkeypatch):
    manager = gpu_pool("f", on_device=True)

    def out_of_memory(stream, blocks):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(manager.engine._hasher, "enqueue", out_of_memory)
    assert offload(manager, [1, 2], [b"a", b"b"]) == [Outcome.FAILED] * 2
    # The chunk's copies ran before the error came back: the copy stream's last operation (the event the
    # guard waited for) has run; the stream counts it done a moment after (a hang guard, not a timing).
    copies = cuda_sim.streams[manager.engine._streams[Direction.TO_HOST].handle.value]
    assert copies.done >= copies.enqueued - 1
    for _ in range(3000):
        if copies.idle():
            break
        time.sleep(0.01)
    assert copies.idle()
    assert manager.lookup("ns", [b"a"]).hits == 0 and manager.group.index.stats().pinned == 0


def test_cancellation_between_chunks_publishes_nothing(cuda_sim):
    manager = gpu_pool("c", capacity=20)
    fill(manager)
    manager.copier.chunk = 2
    answers = iter([False, True, True, True])
    result = manager.offload("ns", [(6, b"f"), (7, b"g"), (8, b"h"), (9, b"i"), (10, b"j")],
                             cancelled=lambda: next(answers))
    assert result.outcomes == [Outcome.CANCELLED] * 5 and manager.lookup("ns", [b"f"]).hits == 0
    assert manager.group.index.stats().pinned == 0


def test_a_bad_event_handle_fails_its_request_alone(cuda_sim):
    manager, other = gpu_pool("x"), gpu_pool("y")
    fill(manager)
    engine = SimEngine(cuda_sim.region.path)
    try:
        engine("open", handle=manager.pool.descriptor.handle.ipc_handle.hex())
        stale = engine.forward(0, SPAN, 1)
        engine("sync")
        engine("destroy")  # its creator destroyed the event: INVALID_HANDLE, not a broken device
    finally:
        engine.close()
    for bad in (bytes(64), stale):  # not a handle the driver knows; a stale one
        with pytest.raises(InvalidArgument, match="engine's CUDA event"):
            offload(manager, [1], [b"a"], bad)
    assert manager.lookup("ns", [b"a"]).hits == 0 and manager.group.index.stats().pinned == 0
    assert offload(manager, [1], [b"a"]) == [Outcome.DONE]  # the pool serves on
    assert offload(other, [1], [b"a"]) == [Outcome.DONE]
    assert manager.engine.driver.lost is None


def test_an_offload_behind_a_hung_engine_stream_submits_nothing_and_blocks_no_other_pool(cuda_sim):
    """The engine's stream hangs (an NCCL peer that never arrives): the offload's job ends in
    DEADLINE_EXCEEDED at its deadline without a copy submitted (its event is polled, never waited on by
    a stream), and another pool serves meanwhile."""
    manager, other = gpu_pool("hung", deadline_s=0.5), gpu_pool("fine", device=1)
    fill(manager)
    engine = SimEngine(cuda_sim.region.path)
    try:
        engine("open", handle=manager.pool.descriptor.handle.ipc_handle.hex())
        event = engine.forward(2 * SPAN, SPAN, 0x11, hang=True)
        submitted = []
        real_submit = manager.engine.submit
        manager.engine.submit = lambda batch: submitted.append(batch) or real_submit(batch)
        result: list = []
        worker = threading.Thread(target=lambda: result.append(offload(manager, [2], [b"h"], event)))
        worker.start()
        assert offload(other, [5], [b"o"]) == [Outcome.DONE]  # while the first waits for the engine
        worker.join(timeout=30)
        assert result == [[Outcome.DEADLINE_EXCEEDED]] and submitted == []
        assert offload(manager, [3], [b"next"]) == [Outcome.DONE] and len(submitted) == 1  # the pool serves on
        engine("release")
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
def test_layouts_of_short_runs_move_through_staging_one_descriptor_a_block(cuda_sim, layout, monkeypatch):
    """Gathered by a kernel in stream order into two staging buffers used in turn (3 blocks each here,
    so a batch takes several rounds), then one descriptor a block: the same tier bytes as the copy
    plan, and back into other blocks bit-exact, under the simulator's random stream delays."""
    from kvxfer.transfer import staging

    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 3 * SPAN)
    manager = gpu_pool("s", layout=layout, capacity=20, staged=True)
    data = fill(manager)
    assert manager.engine.describe().startswith("CudaCopyEngine (runs: staged") and manager.engine._stager.rows == 3
    blocks, keys = [7, 3, 4, 5, 20, 11, 1, 9], [b"s%d" % i for i in range(8)]
    cuda_sim.calls.clear()
    assert offload(manager, blocks, keys) == [Outcome.DONE] * 8
    assert cuda_sim.calls.count("cuLaunchHostFunc") == 3  # three rounds of at most three blocks
    assert cuda_sim.calls.count("cuMemAlloc_v2") == 2  # the buffers, made in the first submit ...
    assert "cuStreamSynchronize" not in cuda_sim.calls  # ... without a host synchronisation (not zeroed)
    slots = [manager.group.index.locate("ns", k) for k in keys]
    reference = HostTier(20, manager.pool.layout.block_bytes)
    CpuCopyEngine(data.clone(), manager.pool.layout, reference).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert torch.equal(manager.host.buffer[slots], reference.buffer[slots])  # the tier format is the plan's

    targets = [21, 2, 8, 6, 10, 12, 13, 15]
    assert manager.restore("ns", list(zip(keys, targets))).outcomes == [Outcome.DONE] * 8
    expected = data.clone()
    CpuCopyEngine(expected, manager.pool.layout, reference).submit(CopyBatch(Direction.TO_POOL, targets, slots)).wait()
    assert torch.equal(manager.pool.storage, expected)
    assert cuda_sim.pageable_copies == 0 and not cuda_sim.violations  # staging is device memory, in stream order
    assert len(manager.engine._streams[Direction.TO_HOST].staging) == 2


def test_a_staging_kernel_that_cannot_be_enqueued_fails_the_chunk_after_its_copies_land(cuda_sim, monkeypatch):
    from kvxfer.transfer import staging

    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 2 * SPAN)
    manager = gpu_pool("k", layout="LBHNC", staged=True)
    fill(manager)
    real, launches = manager.engine._stager.enqueue, []

    def fail_the_second(*args, **kwargs):
        launches.append(1)
        if len(launches) == 2:
            raise RuntimeError("Triton: launch failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(manager.engine._stager, "enqueue", fail_the_second)
    assert offload(manager, [1, 2, 3, 4], [b"a", b"b", b"c", b"d"]) == [Outcome.FAILED] * 4
    assert all(s.idle() for s in cuda_sim.streams.values())  # the first round's copies ran before the error
    assert manager.lookup("ns", [b"a"]).hits == 0 and manager.group.index.stats().pinned == 0


def test_without_device_memory_for_staging_blocks_move_run_by_run(cuda_sim, monkeypatch):
    from kvxfer.transfer import staging

    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 1 << 40)  # more than any device has
    manager = gpu_pool("m", layout="LBHNC", staged=True)
    data = fill(manager)
    assert offload(manager, [1, 2, 3], [b"a", b"b", b"c"]) == [Outcome.DONE] * 3
    assert manager.engine._stager is None and "cuLaunchHostFunc" not in cuda_sim.calls
    assert manager.restore("ns", [(b"c", 9)]).outcomes == [Outcome.DONE]
    for run in manager.pool.layout.block_runs(9):
        source = manager.pool.layout.block_runs(3)[manager.pool.layout.block_runs(9).index(run)]
        assert torch.equal(manager.pool.storage[run.offset:run.end], data[source.offset:source.end])


def test_a_long_plan_goes_to_the_driver_in_sub_batches(cuda_sim, monkeypatch):
    """The copies of one call start while the next is submitted; a call that fails after others
    were enqueued lets them land before the chunk fails."""
    from kvxfer.transfer import cuda

    monkeypatch.setattr(cuda, "SUB_BATCH", 3)
    manager = gpu_pool("b", layout="LBHNC", capacity=20)  # no pool tensor: DMA, one descriptor a run
    data = fill(manager)
    blocks, keys = [1, 5, 9, 13], [b"b%d" % i for i in range(4)]
    runs = len(plan_copies(manager.pool.layout, blocks, list(range(4))))
    cuda_sim.calls.clear()
    assert offload(manager, blocks, keys) == [Outcome.DONE] * 4
    assert cuda_sim.calls.count("cuMemcpyBatchAsync") == -(-runs // 3)
    assert manager.restore("ns", list(zip(keys, [2, 6, 10, 14]))).outcomes == [Outcome.DONE] * 4
    for source, target in zip(blocks, [2, 6, 10, 14]):
        for a, b in zip(manager.pool.layout.block_runs(source), manager.pool.layout.block_runs(target)):
            assert torch.equal(manager.pool.storage[b.offset:b.end], data[a.offset:a.end])

    real, made = manager.engine.driver.copy, []

    def fail_the_second(*args):
        made.append(1)
        if len(made) == 2:
            raise cuda_driver.CudaError("cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE", 1)
        return real(*args)

    monkeypatch.setattr(manager.engine.driver, "copy", fail_the_second)
    assert offload(manager, [3, 7, 11], [b"x", b"y", b"z"]) == [Outcome.FAILED] * 3
    assert all(s.idle() for s in cuda_sim.streams.values())  # the first call's copies ran before the error
    assert manager.lookup("ns", [b"x"]).hits == 0 and manager.group.index.stats().pinned == 0
    assert not cuda_sim.violations


def test_the_device_checks_staging_stage_runs_on_the_simulator(cuda_sim, monkeypatch):
    """``kvxfer devcheck``'s staging stage (what a lent GPU will run) compares staged and plain DMA to
    the byte: here on the simulator, small, so that the prepared run does not fail on a typo."""
    from kvxfer.devcheck import interference
    from kvxfer.transfer import staging

    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 4 * 1024)
    result = interference.staging_on_the_gpu({"staging_blocks": 6, "staging_spec": {
        "num_layers": 4, "block_size": 2, "num_kv_heads": 2, "head_size": 32}})
    assert result["bit_identical"] and result["runs_per_block"] == 4 and result["blocks"] == 6
    assert {"staged_d2h_gbps", "staged_h2d_gbps", "dma_d2h_gbps", "dma_h2d_gbps"} <= result.keys()
