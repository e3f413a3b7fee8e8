"""The CUDA simulator keeps CUDA's rules (DESIGN.md section 14): it is not a stand-in that
finishes work at once, so the GPU path's tests on it can fail for the reasons a GPU would."""

import ctypes
import os
import threading
import time
from ctypes import c_size_t, c_void_p

import pytest

from kvxfer.core.errors import FailedPrecondition
from kvxfer.memory import cuda_driver
from kvxfer.memory.cuda_abi import CU_MEMCPY_SRC_ACCESS_ORDER_ANY
from kvxfer.memory.cuda_driver import ClientHandleError, CudaError, Driver, IpcEventHandle
from tests.cudasim.engine import SimEngine
from tests.cudasim.rules import (ALREADY_REGISTERED, EVENT_DISABLE_TIMING, EVENT_INTERPROCESS, ILLEGAL_ADDRESS,
                                 INVALID_CONTEXT, INVALID_HANDLE, INVALID_VALUE, NOT_PERMITTED, NOT_REGISTERED)


def _buffer(n: int, fill: int = 0) -> ctypes.Array:
    return (ctypes.c_uint8 * n)(*([fill] * n))


def test_work_runs_in_stream_order_after_enqueue_and_copies_read_their_source_when_they_run(cuda_sim):
    gpu = Driver(cuda_sim)
    stream = gpu.stream()
    dev = gpu.alloc(4096)
    src, back = _buffer(4096, 7), _buffer(4096)
    gate = threading.Event()
    cuda_sim.launch(stream.value, gate.wait)  # a kernel still running
    gpu.copy([dev], [ctypes.addressof(src)], [4096], stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
    gpu.copy([ctypes.addressof(back)], [dev], [4096], stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
    event = gpu.record(stream)
    time.sleep(0.05)
    assert not gpu.done(event) and bytes(back) == bytes(4096)  # enqueued, not run
    ctypes.memset(src, 9, 4096)  # changed after the enqueue, before the copy ran: the copy sees 9
    gate.set()
    while not gpu.done(event):
        time.sleep(0.001)
    assert bytes(back) == bytes([9]) * 4096


def test_an_event_orders_two_streams(cuda_sim):
    gpu = Driver(cuda_sim)
    first, second = gpu.stream(), gpu.stream()
    dev = gpu.alloc(1024)
    src, out = _buffer(1024, 5), _buffer(1024)
    gate = threading.Event()
    cuda_sim.launch(first.value, gate.wait)
    gpu.copy([dev], [ctypes.addressof(src)], [1024], first, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
    written = gpu.record(first)
    with gpu.scope():
        assert cuda_sim.cuStreamWaitEvent(second, written, 0) == 0
    gpu.copy([ctypes.addressof(out)], [dev], [1024], second, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
    read = gpu.record(second)
    time.sleep(0.05)
    assert not gpu.done(read)
    gate.set()
    gpu.synchronize(second)
    assert bytes(out) == bytes([5]) * 1024


def test_ipc_handles_open_in_another_process_only_and_follow_their_rules(cuda_sim):
    gpu = Driver(cuda_sim)
    dev = gpu.alloc(8192)
    handle = gpu.export(dev)
    with pytest.raises(ClientHandleError, match="INVALID_CONTEXT"):  # never in the exporting process
        gpu.open_ipc(handle)
    engine = SimEngine(cuda_sim.region.path)
    try:
        engine("open", handle=handle.hex())
        event = engine.forward(4096, 4096, 0x33, delay_s=0.2)  # the engine writes our memory, later
        out = _buffer(8192)
        stream = gpu.stream()
        opened = gpu.open_ipc_event(event)
        while not gpu.engine_event_done(opened):  # (bounded by the engine's 0.2 s)
            time.sleep(0.005)
        gpu.destroy(opened)
        gpu.copy([ctypes.addressof(out)], [dev], [8192], stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
        gpu.synchronize(stream)
        assert bytes(out) == bytes(4096) + bytes([0x33]) * 4096
        timed = engine("write", offset=0, nbytes=16, value=1, flags=EVENT_INTERPROCESS)  # timing not disabled
        assert timed["code"] == INVALID_VALUE and not timed["event"]
        engine("sync")
        engine("destroy", index=0)  # the creator destroys the event: its handle is dead
        with pytest.raises(ClientHandleError, match="INVALID_HANDLE"):
            gpu.open_ipc_event(event)
        assert not gpu.lost  # a client's bad handle never breaks the device
    finally:
        engine.close()
    own = IpcEventHandle()
    ev = c_void_p()
    with gpu.scope():
        cuda_sim.cuEventCreate(ctypes.pointer(ev), EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
        assert cuda_sim.cuIpcGetEventHandle(ctypes.pointer(own), ev) == 0
        assert cuda_sim.cuIpcOpenEventHandle(ctypes.pointer(c_void_p()), own) == INVALID_CONTEXT


def test_contexts_are_per_thread_and_checked(cuda_sim):
    gpu0, gpu1 = Driver(cuda_sim, 0), Driver(cuda_sim, 1)
    s0 = gpu0.stream()
    event = c_void_p()
    assert cuda_sim.cuEventCreate(ctypes.pointer(event), 0) == INVALID_CONTEXT  # nothing current
    with gpu1.scope():
        assert cuda_sim.cuStreamSynchronize(s0) == INVALID_HANDLE  # device 0's stream in device 1's context
        assert cuda_sim.cuStreamSynchronize(None) == NOT_PERMITTED  # the legacy stream
        seen = []
        threading.Thread(target=lambda: seen.append(cuda_sim._current())).start()
        time.sleep(0.05)
        assert seen == [None] and cuda_sim._current() == 1  # another thread has its own current context
    assert cuda_sim._current() is None  # scope restores what was current
    assert any("legacy" in v for v in cuda_sim.violations)


def test_a_copy_into_memory_its_owner_freed_is_a_sticky_illegal_address(cuda_sim):
    """(A free in this process waits for this process's copies: cuMemFree synchronises. The engine's does not.)"""
    gpu = Driver(cuda_sim)
    engine = SimEngine(cuda_sim.region.path)
    try:
        dev = gpu.open_ipc(bytes.fromhex(engine("alloc", nbytes=4096)["handle"]))
        stream = gpu.stream()
        src = _buffer(4096, 1)
        gate = threading.Event()
        cuda_sim.launch(stream.value, gate.wait)
        gpu.copy([dev], [ctypes.addressof(src)], [4096], stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
        event = gpu.record(stream)
        engine("free")  # the memory's owner frees it while this process's copy into it is pending
        gate.set()
        while True:
            try:
                if gpu.done(event):
                    break
            except CudaError as exc:
                assert "ILLEGAL_ADDRESS" in str(exc) and exc.sticky and gpu.lost is exc
                break
            time.sleep(0.01)
        assert gpu.lost is not None
        with pytest.raises(CudaError):  # every later call in that context fails
            gpu.stream()
        assert any("freed or reused" in v for v in cuda_sim.violations)
    finally:
        engine.close()


def test_host_registration_is_page_granular(cuda_sim):
    gpu = Driver(cuda_sim)
    page = _buffer(8192)
    base = (ctypes.addressof(page) + 4095) // 4096 * 4096
    gpu.pin(base, 100)
    with gpu.scope():
        assert cuda_sim.cuMemHostRegister_v2(c_void_p(base + 200), c_size_t(100), 0) == ALREADY_REGISTERED
        assert cuda_sim.cuMemHostUnregister(c_void_p(base + 200)) == NOT_REGISTERED
    gpu.unpin(base)
    gpu.pin(base + 200, 100)  # the page is free again


def test_injected_errors_are_sticky_or_not_as_asked(cuda_sim):
    gpu = Driver(cuda_sim)
    cuda_sim.inject("cuStreamCreate", INVALID_VALUE)
    with pytest.raises(CudaError, match="INVALID_VALUE") as info:
        gpu.stream()
    assert not info.value.sticky and gpu.lost is None
    stream = gpu.stream()  # usable
    cuda_sim.inject_async(ILLEGAL_ADDRESS)  # the next stream operation (a kernel) faults
    event = gpu.record(stream)
    time.sleep(0.05)
    with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
        gpu.done(event)
    assert gpu.lost is not None and gpu.lost.sticky


def test_a_forked_child_cannot_use_cuda(cuda_sim):
    cuda_driver.driver(0).stream()
    pid = os.fork()
    if pid == 0:  # the child: both the simulator and kvxfer refuse
        try:
            refused = cuda_sim.cuInit(0) != 0
            try:
                cuda_driver.driver(0)
            except FailedPrecondition as exc:
                refused = refused and "forked" in str(exc)
            else:
                refused = False
        finally:
            os._exit(0 if refused else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert not cuda_driver._FORKED  # the parent still can
    cuda_driver.driver(0).stream()


def test_memory_is_checked_and_device_memory_is_zeroed_on_a_stream(cuda_sim):
    gpu = Driver(cuda_sim)
    dev = gpu.alloc(4096)
    out = _buffer(4096, 0xFF)
    stream = gpu.stream()
    gpu.copy([ctypes.addressof(out)], [dev], [4096], stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
    gpu.synchronize(stream)
    assert bytes(out) == bytes(4096) and not cuda_sim.violations
    with pytest.raises(CudaError, match="INVALID_VALUE"):  # past the allocation's end
        gpu.copy([ctypes.addressof(out)], [dev + 4000], [4096], stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
    assert gpu.allocation_size(dev + 100) == 4096 - 100


def test_mem_free_synchronises_behind_a_stream_waiting_on_an_engines_event(cuda_sim):
    """What made issue 47 item 4 a hang: cuMemFree returns only once every stream of the context has run
    its work, so one stream waiting on an event that never completes (a dead engine's) holds it."""
    gpu = Driver(cuda_sim)
    engine = SimEngine(cuda_sim.region.path)
    try:
        engine("open", handle=gpu.export(gpu.alloc(8192)).hex())
        event = engine.forward(0, 4096, 0x33, hang=True)
        stream = gpu.stream()
        opened = gpu.open_ipc_event(event)
        gpu.wait_event(stream, opened)
        gpu.destroy(opened)
        gpu.destroy_stream(stream)  # a destroyed stream's work still runs, and is still waited for
        scratch = gpu.alloc(4096, zeroed=False)
        freed = threading.Thread(target=gpu.free, args=(scratch,), daemon=True)
        freed.start()
        freed.join(0.5)
        assert freed.is_alive() and not gpu.engine_event_done(gpu.open_ipc_event(event))
        engine("release")
        freed.join(60)  # a hang guard
        assert not freed.is_alive()
    finally:
        engine.close()
