"""The GPU path's failures on the CUDA simulator: late copies, sticky errors, lifetimes of
registered pools, streams and pinned memory. Each test fails on the code before issue 25."""

import os
import time

import pytest
import torch

from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.core.records import Medium, Outcome
from kvxfer.geometry.layout import PRESETS
from kvxfer.memory import cuda_driver, cuda_mem
from kvxfer.memory.cuda_driver import CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE
from kvxfer.memory.pool import PoolHandle
from kvxfer.serving.pool_registry import Limits, PoolRegistry
from kvxfer.tiers.host import HostTier
from tests.cudasim.engine import SimEngine
from tests.unit.test_cuda_engine import SPAN, SPEC, fill, gpu_pool, offload


def _until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_slots_of_an_offload_past_its_deadline_stay_reserved_until_its_copy_lands(cuda_sim):
    """A late copy cannot be recalled: were its tier slots reused, it would overwrite a later job's bytes."""
    manager = gpu_pool("q", capacity=4, deadline_s=0.3)
    data = fill(manager)
    cuda_sim.stall_copies()  # the offload's copy stalls on its stream
    assert offload(manager, [1, 2], [b"a", b"b"]) == [Outcome.DEADLINE_EXCEEDED] * 2
    assert manager.group.index.stats().pinned == 2  # held, invisible
    assert offload(manager, [5, 6], [b"c", b"d"]) == [Outcome.DONE] * 2  # the two other slots, on a fresh stream
    free = {manager.group.index.locate("ns", k) for k in (b"c", b"d")}
    assert offload(manager, [7], [b"e"]) == [Outcome.DONE]  # evicts c: never a held slot
    assert manager.group.index.locate("ns", b"e") in free
    cuda_sim.stall.set()  # the late copy lands in the held slots
    assert _until(lambda: manager.engine.reap() == 0)
    assert manager.group.index.stats().pinned == 0 and manager.lookup("ns", [b"a"]).hits == 0
    assert manager.restore("ns", [(b"d", 20), (b"e", 21)]).outcomes == [Outcome.DONE] * 2
    assert torch.equal(manager.pool.storage[20 * SPAN:22 * SPAN], data[6 * SPAN:8 * SPAN])
    assert offload(manager, [8, 9], [b"f", b"g"]) == [Outcome.DONE] * 2  # the held slots are free again
    assert manager.group.index.stats().ready == 4 and manager.lookup("ns", [b"d", b"e"]).hits == 2


def test_no_stream_waits_on_an_engines_event_so_its_death_hangs_nothing(cuda_sim):
    """Issue 47 item 4: a stream waited on the engine's event. Had the engine died first, that stream
    waited for ever, its offload's slots stayed held, and every implicitly synchronising call in the
    context (cuMemFree: the simulator's waits behind every stream, as CUDA's does) hung behind it. The
    event is polled from the job's thread now: at the deadline nothing was enqueued, nothing is held."""
    import threading

    manager = gpu_pool("dead", capacity=4, deadline_s=0.5)
    data = fill(manager)
    engine = SimEngine(cuda_sim.region.path)
    try:
        engine("open", handle=manager.pool.descriptor.handle.ipc_handle.hex())
        event = engine.forward(1 * SPAN, SPAN, 0x77, hang=True)  # the engine's stream hangs, then it dies
        assert offload(manager, [1, 2], [b"a", b"b"], event) == [Outcome.DEADLINE_EXCEEDED] * 2
        assert manager.group.index.stats().pinned == 0 and manager.engine.reap() == 0  # nothing held, nothing late
        engine.kill()
        gpu = cuda_driver.driver(0)
        freed = threading.Thread(target=lambda: gpu.free(gpu.alloc(4096, zeroed=False)), daemon=True)
        freed.start()
        freed.join(60)  # a hang guard: behind a stream waiting on the dead engine's event it never returns
        assert not freed.is_alive()
        assert offload(manager, [3], [b"c"]) == [Outcome.DONE]
        assert manager.restore("ns", [(b"c", 9)]).outcomes == [Outcome.DONE]
        assert torch.equal(manager.pool.storage[9 * SPAN:10 * SPAN], data[3 * SPAN:4 * SPAN])
    finally:
        engine.close()


def test_a_restore_past_its_deadline_takes_the_pool_out_of_service_until_it_lands(cuda_sim):
    manager = gpu_pool("r", capacity=4, deadline_s=0.3)
    data = fill(manager)
    assert offload(manager, [1], [b"a"]) == [Outcome.DONE]
    cuda_sim.dma.clear()  # the copy engine stalls
    assert manager.restore("ns", [(b"a", 9)]).outcomes == [Outcome.DEADLINE_EXCEEDED]
    assert manager.restore("ns", [(b"a", 10)]).outcomes == [Outcome.FAILED]  # out of service
    assert manager.group.index.stats().pinned == 1  # the source slot is still read by the late copy
    cuda_sim.dma.set()
    assert _until(lambda: manager.engine.reap() == 0)
    assert manager.restore("ns", [(b"a", 10)]).outcomes == [Outcome.DONE]
    assert torch.equal(manager.pool.storage[10 * SPAN:11 * SPAN], data[SPAN:2 * SPAN])
    assert manager.group.index.stats().pinned == 0


def test_a_sticky_error_loses_the_device_and_every_pool_on_it_but_not_another_gpu(cuda_sim):
    first, second, elsewhere = gpu_pool("a"), gpu_pool("b"), gpu_pool("c", device=1)
    for m in (first, second, elsewhere):
        fill(m)
    told = []
    unsubscribe = cuda_driver.on_device_lost(lambda device, error: told.append((device, error.cuda_code)))
    try:
        cuda_sim.inject_async(700)  # a kernel faults on device 0: CUDA_ERROR_ILLEGAL_ADDRESS
        assert offload(first, [1], [b"a"]) == [Outcome.FAILED]
        assert offload(second, [1], [b"a"]) == [Outcome.FAILED]  # the whole device, at once
        assert offload(elsewhere, [1], [b"a"]) == [Outcome.DONE]
        assert told == [(0, 700)]
        with pytest.raises(FailedPrecondition, match="sticky error.*exits to be restarted"):
            first.engine._check_usable()
    finally:
        unsubscribe()


def _register_engines_pool(registry: PoolRegistry, engine: SimEngine):
    """The simulated engine's GPU memory registered as pool "eng", as its process hands it over."""
    handle = bytes.fromhex(engine("alloc", nbytes=SPEC.nbytes)["handle"])
    pool_handle = PoolHandle(Medium.CUDA, ipc_handle=handle, device_uuid=cuda_mem.device_uuid(0))
    token = registry.handoffs.accept_identity(os.getuid(), engine.proc.pid)
    return registry.register("eng", SPEC, PRESETS["BLHNC"], pool_handle, token, host_capacity_mib=1)


def test_a_registered_gpu_pool_ends_with_the_process_that_registered_it(cuda_sim):
    """The daemon closes its IPC mapping when the engine dies, so the engine's memory can be freed."""
    registry = PoolRegistry(Limits(checksum_on_device=False))
    engine = SimEngine(cuda_sim.region.path)
    try:
        served, _ = _register_engines_pool(registry, engine)
        assert len(cuda_sim.mappings) == 1 and served.manager.run is not None
        engine.kill()
        assert _until(lambda: not registry.served())
        assert _until(lambda: not cuda_sim.mappings)  # unmapped: the dead engine's memory is released
    finally:
        engine.close()
        registry.close()


def test_memory_that_cannot_be_shared_is_refused_with_what_to_change(cuda_sim, monkeypatch):
    registry = PoolRegistry(Limits(checksum_on_device=False))
    try:
        gpu = cuda_driver.driver(0)
        dead = gpu.alloc(SPEC.nbytes)
        handle = gpu.export(dead)
        gpu.free(dead)
        token = registry.handoffs.accept_identity(os.getuid(), os.getpid())
        freed = PoolHandle(Medium.CUDA, ipc_handle=handle, device_uuid=cuda_mem.device_uuid(0))
        with pytest.raises(InvalidArgument, match="IPC memory handle"):
            registry.register("gone", SPEC, PRESETS["BLHNC"], freed, token)
    finally:
        registry.close()

    class VirtualMemory:  # what torch says of memory from cuMemCreate/cuMemMap (vLLM's sleep mode)
        def untyped_storage(self):
            return self

        def _share_cuda_(self):
            raise RuntimeError("CUDA error: invalid argument")

    with pytest.raises(FailedPrecondition, match="cuMemCreate"):
        cuda_mem.share_tensor(VirtualMemory())


def test_host_tiers_own_their_pages_and_are_registered_portable_and_mapped(cuda_sim):
    tiers = [HostTier(1, 100, pin_device=0), HostTier(1, 100, pin_device=0)]  # two small tiers
    assert all(t.buffer.data_ptr() % 4096 == 0 for t in tiers)
    flags = {f for _, _, f in cuda_sim.registered.values()}
    assert len(cuda_sim.registered) == 2 and flags == {CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP}
    del tiers
    assert not cuda_sim.registered  # unregistered with the tier


def test_an_engines_streams_go_with_it_and_pools_are_zeroed_on_a_stream(cuda_sim):
    before = cuda_sim.live_streams()
    manager = gpu_pool("s")
    assert bool((manager.pool.storage == 0).all()) and not cuda_sim.violations  # zeroed, no legacy stream
    assert cuda_sim.live_streams() == before + 2
    manager.close()
    assert cuda_sim.live_streams() == before


def test_two_reapers_at_once_release_a_late_copy_once_and_neither_fails():
    """Issue 47 item 2: the job thread's idle sweep and an inline submit both reaped: both found one event
    done, both destroyed it, and the loser raised ValueError at the late list (the job thread's loser
    stopped the pool's queue for good). They take turns now."""
    import threading

    from kvxfer.transfer.cuda import CudaCopyEngine, CudaHandle
    from kvxfer.transfer.quarantine import Quarantine

    both_inside = threading.Barrier(2)

    class Driver:
        lost = None
        destroyed: list = []

        def done(self, event):
            try:
                both_inside.wait(timeout=1.0)  # two reapers meet here (unless they take turns)
            except threading.BrokenBarrierError:
                pass
            return True

        def destroy(self, event):
            self.destroyed.append(event)

    engine = object.__new__(CudaCopyEngine)  # its late-copy bookkeeping alone: no device
    engine.driver, engine._late = Driver(), Quarantine()
    handle = object.__new__(CudaHandle)
    handle._engine, handle._event = engine, "event-1"
    released = []
    engine._late.add([handle], lambda: released.append(1), False)
    errors, results = [], []

    def reap():
        try:
            results.append(engine.reap())
        except Exception as exc:  # what the job thread met
            errors.append(exc)

    threads = [threading.Thread(target=reap) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and results == [0, 0]
    assert released == [1] and Driver.destroyed == ["event-1"]  # released once, the event destroyed once


def test_a_copy_goes_late_at_its_jobs_deadline_not_after_the_gpu_copy_deadline(cuda_sim):
    """Issue 47 item 5: a chunk waited ``gpu_copy_deadline_s`` (30 s) whatever its job's deadline (vLLM's is
    5 s): one stalled store held the pool's queue for 30 s. It is late at the job's deadline + LANDING_S."""
    from kvxfer.serving.batch import TransferBatch, TransferKind
    from kvxfer.transfer.copy_engine import LANDING_S, CopyBatch, Direction

    manager = gpu_pool("d", capacity=4, deadline_s=30.0)
    fill(manager)
    cuda_sim.dma.clear()  # the copy engine stalls
    deadline = time.monotonic() + 0.2
    handle = manager.engine.submit(CopyBatch(Direction.TO_HOST, [1], [0], deadline=deadline))
    assert handle._deadline <= deadline + LANDING_S  # (it was now + 30 s)
    cuda_sim.dma.set()
    handle.wait()
    cuda_sim.dma.clear()
    batch = TransferBatch.build(TransferKind.OFFLOAD, "ns", [2], [b"late"], SPEC.num_blocks,
                                deadline=time.monotonic() + 0.2)
    assert manager.run(batch).outcomes == [Outcome.DEADLINE_EXCEEDED]
    cuda_sim.dma.set()
    assert _until(lambda: manager.engine.reap() == 0)
    assert offload(manager, [3], [b"after"]) == [Outcome.DONE]  # the pool serves on


def test_a_looped_copy_failing_midway_holds_its_slots_until_the_copies_before_it_land(cuda_sim):
    """Issue 47 item 8: without the batched call each descriptor is its own cuMemcpyAsync; one failing
    midway left the copies before it in flight with no handle while their slots were freed. It goes
    through the enqueue-or-land guard now: the slots stay held until those copies land."""
    from kvxfer.memory.cuda_driver import Driver
    from kvxfer.memory.pool import Pool
    from kvxfer.serving.group import CacheGroup
    from kvxfer.serving.pool_manager import PoolManager
    from kvxfer.transfer.cuda import CudaCopyEngine
    from tests.cudasim.rules import INVALID_VALUE

    pool = Pool.create("loop", SPEC, PRESETS["BLHNC"], device="cuda:0")
    group = CacheGroup("loop", pool.layout, 4, pin_device=0)
    engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, group.host, Driver(cuda_sim, use_batch=False),
                            deadline_s=0.3)
    manager = PoolManager(pool, group, engine=engine)
    cuda_sim.dma.clear()  # the first copy is enqueued and waits ...
    cuda_sim.inject("cuMemcpyAsync", INVALID_VALUE, after=1)  # ... the second cannot be enqueued
    assert offload(manager, [1, 5], [b"a", b"b"]) == [Outcome.DEADLINE_EXCEEDED] * 2
    assert manager.group.index.stats().pinned == 2  # held: the first copy may still land in one of them
    cuda_sim.dma.set()
    assert _until(lambda: manager.engine.reap() == 0)
    assert manager.group.index.stats().pinned == 0 and offload(manager, [2, 6], [b"c", b"d"]) == [Outcome.DONE] * 2


def test_restores_read_in_stream_order_and_checksums_come_back_through_pinned_memory(cuda_sim):
    """Issue 47 item 8: restores asked the driver for access order ANY (it may then read out of stream
    order) and ``pool_checksums`` copied into pageable memory (a hidden host wait with no deadline)."""
    from kvxfer.memory.cuda_abi import CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    manager = gpu_pool("o", capacity=4)
    fill(manager)
    assert offload(manager, [1, 5], [b"a", b"b"]) == [Outcome.DONE] * 2
    assert manager.restore("ns", [(b"a", 9), (b"b", 3)]).outcomes == [Outcome.DONE] * 2
    assert cuda_sim.access_orders and set(cuda_sim.access_orders) == {CU_MEMCPY_SRC_ACCESS_ORDER_STREAM}
    before = cuda_sim.pageable_copies
    sums = manager.engine.pool_checksums([1, 5])
    assert sums == manager.engine.pool_checksums([1, 5]) and cuda_sim.pageable_copies == before == 0


def test_finding_a_gpu_by_uuid_retains_no_context_and_serving_one_retains_only_its_own(cuda_sim):
    """Issue 47 item 7: the driver retained a primary context on every visible GPU just to read UUIDs (a few
    hundred MiB each, and a failure on a GPU an engine has filled)."""
    uuid = cuda_mem.device_uuid(1)
    assert cuda_mem.device_by_uuid(uuid) == 1 and cuda_sim.retained == set()
    manager = gpu_pool("one", device=1, capacity=4)  # a pool served on GPU 1
    fill(manager)
    assert offload(manager, [1], [b"a"]) == [Outcome.DONE]
    assert cuda_sim.retained == {1}


def test_an_unregistered_pool_keeps_its_mapping_until_its_late_copy_lands(cuda_sim):
    """Issue 47 item 3: unregistering a pool (or its engine dying) freed the IPC mapping while a copy that
    missed its deadline could still run: a use after unmap (a sticky fault, the daemon exits). What the copy
    touches is freed once it has landed."""
    from kvxfer.core.records import PoolRef
    from kvxfer.serving.batch import TransferBatch, TransferKind

    registry = PoolRegistry(Limits(checksum_on_device=False, gpu_copy_deadline_s=0.3))
    engine = SimEngine(cuda_sim.region.path)
    try:
        served, registration = _register_engines_pool(registry, engine)
        cuda_sim.dma.clear()  # the copy engine stalls: the offload goes late
        batch = TransferBatch.build(TransferKind.OFFLOAD, "ns", [1, 2], [b"a", b"b"], SPEC.num_blocks)
        assert served.manager.run(batch).outcomes == [Outcome.DEADLINE_EXCEEDED] * 2
        registry.unregister(PoolRef("eng", served.descriptor.epoch), registration, drain_timeout=0)
        assert not registry.served() and len(cuda_sim.mappings) == 1  # not served; still mapped
        assert registry.until_landed.held == 1
        cuda_sim.dma.set()  # the late copy lands in mapped memory ...
        assert _until(lambda: not cuda_sim.mappings)  # ... and then the mapping goes
        assert registry.until_landed.held == 0 and not cuda_sim.violations
    finally:
        cuda_sim.dma.set()
        engine.close()
        registry.close()
