"""The CUDA driver API through ctypes: memory, IPC, streams, events, batched copies, host functions.

By hand because ``cuMemcpyBatchAsync`` (CUDA 12.8+) takes a whole copy plan in one call and the
cuda-python 13 binding dropped its ``failIdx``; its symbol at the 12.8 ABI (``cuGetProcAddress``,
as vLLM does) is the same on 12.x and 13.x drivers. One binding, one set of rules (DESIGN.md 14):

- Context: every entry pushes its device's primary context and pops it on the way
  out, so torch's device switches and pools of several GPUs served by the same
  threads never leave the wrong context current.
- Errors: a failed call with a bad argument or handle leaves the context usable; a
  sticky error (``STICKY``: illegal address, launch failure, ECC, ...) makes the
  device *lost*: every later call fails, and ``on_device_lost`` listeners (the
  daemon) are told once, so that the process exits and is restarted.
- Fork: a child of a process that used CUDA cannot use it; ``driver`` refuses there.

Nothing here needs a GPU to be tested: ``Driver`` takes its library as an argument, and the
tests drive it with a simulator that obeys CUDA's ordering rules (``tests/cudasim``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

import numpy as np

from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.memory.cuda_abi import (BATCH_ABI_VERSION,  # (the codes and flags other modules read are here too)
                                    CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, CU_EVENT_DISABLE_TIMING,
                                    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_MEMHOSTREGISTER_DEVICEMAP,
                                    CU_MEMHOSTREGISTER_PORTABLE, CU_MEMORYTYPE_HOST, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    CU_STREAM_NON_BLOCKING, CUDA_ERROR_NOT_READY, CUDA_SUCCESS, HOST_FN,
                                    IPC_HANDLE_BYTES, LIBRARY, STICKY, BatchFn, IpcEventHandle, IpcMemHandle,
                                    MemcpyAttributes, Uuid)


class CudaError(FailedPrecondition):
    """The driver failed a call. ``sticky`` errors leave the device unusable until the process exits."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.cuda_code = code

    @property
    def sticky(self) -> bool:
        return self.cuda_code in STICKY


def load_library(name: str = LIBRARY):
    """The driver library, or a one-line reason why there is none."""
    try:
        return ctypes.CDLL(name)
    except OSError as exc:
        raise FailedPrecondition(f"no CUDA driver: cannot load {name} ({exc})") from None


class Driver:
    """One device's primary context and every driver call kvxfer makes on it."""

    def __init__(self, lib, device: int = 0, use_batch: bool = True) -> None:
        """``use_batch=False`` always loops over cuMemcpyAsync (the device check compares both)."""
        self.lib = lib
        self.device = device
        self.lost: CudaError | None = None  # the sticky error that broke this device, if any
        self._check(lib.cuInit(0), "cuInit")
        dev = c_int()
        self._check(lib.cuDeviceGet(ctypes.pointer(dev), device), f"cuDeviceGet({device})")
        self._dev = dev.value
        self._ctx_retained: c_void_p | None = None  # retained at first use (``scope``), not to read a UUID
        self._ctx_lock = threading.Lock()
        self._batch = self._resolve_batch() if use_batch else None
        self._host_fns: dict[int, object] = {}  # host functions enqueued and not yet called

    @property
    def batched(self) -> bool:
        """Whether cuMemcpyBatchAsync exists (driver 12.8+); otherwise copies loop over cuMemcpyAsync."""
        return self._batch is not None

    @property
    def host_backed(self) -> bool:
        """Whether "device" memory is host memory (the simulator the tests run on)."""
        return bool(getattr(self.lib, "host_backed", False))

    # -- errors and context --------------------------------------------------------
    def error_name(self, code: int) -> str:
        name = c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.pointer(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def _check(self, code: int, what: str, error: Callable[[str, int], Exception] = CudaError) -> None:
        if code == CUDA_SUCCESS:
            return
        exc = CudaError(f"{what} failed: {self.error_name(code)}", code)
        if exc.sticky:
            self._lose(exc)
            raise exc
        raise error(str(exc), code)

    def _lose(self, exc: CudaError) -> None:
        if self.lost is None:
            self.lost = exc
            for listener in list(_LOST_LISTENERS):
                listener(self.device, exc)

    @property
    def _ctx(self) -> c_void_p:
        """The device's primary context, retained when first needed: a daemon that only reads a GPU's UUID
        (to find the one a pool lives on) holds no context there (a few hundred MiB, and a failure on a
        GPU an engine has filled)."""
        if self._ctx_retained is None:
            with self._ctx_lock:
                if self._ctx_retained is None:
                    ctx = c_void_p()
                    self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.pointer(ctx), self._dev),
                                "cuDevicePrimaryCtxRetain")
                    self._ctx_retained = ctx
        return self._ctx_retained

    @contextmanager
    def scope(self) -> Iterator[None]:
        """This device's context current on the calling thread for the block, then the caller's again."""
        self._check(self.lib.cuCtxPushCurrent_v2(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.pointer(c_void_p()))

    def device_count(self) -> int:
        count = c_int()
        self._check(self.lib.cuDeviceGetCount(ctypes.pointer(count)), "cuDeviceGetCount")
        return count.value

    def uuid(self) -> str:
        """The GPU's UUID as nvidia-smi spells it ("GPU-xxxxxxxx-xxxx-...")."""
        raw = Uuid()
        self._check(self.lib.cuDeviceGetUuid_v2(ctypes.pointer(raw), self._dev), "cuDeviceGetUuid")
        h = bytes(raw.bytes).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    # -- streams and events --------------------------------------------------------
    def stream(self) -> c_void_p:
        """A non-blocking stream (never the legacy stream, which would serialise with the engine's work)."""
        s = c_void_p()
        with self.scope():
            self._check(self.lib.cuStreamCreate(ctypes.pointer(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return s

    def destroy_stream(self, stream: c_void_p) -> None:
        """Release a stream (work already enqueued on it still runs)."""
        with self.scope():
            self._check(self.lib.cuStreamDestroy_v2(stream), "cuStreamDestroy")

    def synchronize(self, stream: c_void_p) -> None:
        """Block until ``stream``'s work is done (never on a submit path: set-up and tear-down only)."""
        with self.scope():
            self._check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def record(self, stream: c_void_p) -> c_void_p:
        """A new event recorded on ``stream`` (the completion of what was enqueued before it)."""
        event = c_void_p()
        with self.scope():
            self._check(self.lib.cuEventCreate(ctypes.pointer(event), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            code = self.lib.cuEventRecord(event, stream)
            if code != CUDA_SUCCESS:
                self.lib.cuEventDestroy_v2(event)
            self._check(code, "cuEventRecord")
        return event

    def done(self, event: c_void_p) -> bool:
        """Poll an event: True when complete, False while not ready; a failure raises."""
        with self.scope():
            code = self.lib.cuEventQuery(event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check(code, "cuEventQuery")
        return True

    def destroy(self, event: c_void_p) -> None:
        with self.scope():
            self.lib.cuEventDestroy_v2(event)

    def wait_event(self, stream: c_void_p, event: c_void_p) -> None:
        """Make ``stream`` wait for what ``event`` (this process's, recorded) marks (cuStreamWaitEvent)."""
        with self.scope():
            self._check(self.lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def open_ipc_event(self, handle: bytes) -> c_void_p:
        """Open an event another process recorded (the engine's KV writes), to poll with
        ``engine_event_done`` and release with ``destroy``. Never waited for on a stream: a stream
        waiting on another process's event waits for ever if that process dies, and every implicitly
        synchronising call in this context (``cuMemFree``) would wait behind it.

        The handle is the client's: one the driver refuses (malformed, stale, its event
        destroyed) is InvalidArgument for that request and leaves the device usable."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(f"a CUDA IPC event handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        raw = IpcEventHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
        event = c_void_p()
        with self.scope():
            self._check(self.lib.cuIpcOpenEventHandle(ctypes.pointer(event), raw),
                        "opening the engine's CUDA event (cuIpcOpenEventHandle)", ClientHandleError)
        return event

    def engine_event_done(self, event: c_void_p) -> bool:
        """Poll an event ``open_ipc_event`` opened: True when complete, False while not ready. An error
        is the engine's (its process died, its context broke), never this device's: the request fails
        and the device stays in service (a fault of this context shows on its own next call)."""
        with self.scope():
            code = self.lib.cuEventQuery(event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        if code != CUDA_SUCCESS:
            raise ClientHandleError(f"the engine's CUDA event reported {self.error_name(code)} (cuEventQuery): "
                                    "its process may have died", code)
        return True

    def launch_host(self, stream: c_void_p, fn: Callable[[], None]) -> None:
        """Run ``fn`` in ``stream``'s order on a driver thread (cuLaunchHostFunc): work on "device"
        memory that is host memory (the simulator). ``fn`` must make no CUDA call."""
        def call(_user) -> None:
            try:
                fn()
            finally:
                self._host_fns.pop(id(callback), None)

        callback = HOST_FN(call)
        self._host_fns[id(callback)] = callback  # alive until the driver has called it
        with self.scope():
            code = self.lib.cuLaunchHostFunc(stream, callback, None)
        if code != CUDA_SUCCESS:
            self._host_fns.pop(id(callback), None)
        self._check(code, "cuLaunchHostFunc")

    # -- copies ----------------------------------------------------------------------
    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: c_void_p, access_order: int,
             looped: bool = False) -> int:
        """Enqueue ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes) on ``stream``; returns the driver calls made.

        One ``cuMemcpyBatchAsync`` where the driver has it (every copy with the same
        source access order) and not ``looped``, else one ``cuMemcpyAsync`` per descriptor. The arrays go to
        the driver as they are (no Python list per descriptor: 0.23 -> 0.002 us a descriptor).
        """
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        n = len(sizes)
        if n == 0:
            return 0
        with self.scope():
            if self._batch is None or looped:
                for d, s, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                    self._check(self.lib.cuMemcpyAsync(c_uint64(d), c_uint64(s), c_size_t(size), stream),
                                "cuMemcpyAsync")
                return n
            attrs = (MemcpyAttributes * 1)()
            attrs[0].srcAccessOrder = access_order
            index = (c_size_t * 1)(0)
            fail = c_size_t(n)
            words = POINTER(c_uint64)  # size_t is 64 bits on every platform CUDA runs on
            code = self._batch(dsts.ctypes.data_as(words), srcs.ctypes.data_as(words),
                               ctypes.cast(sizes.ctypes.data, POINTER(c_size_t)), n, attrs, index, 1,
                               ctypes.pointer(fail), stream)
        self._check(code, f"cuMemcpyBatchAsync (at copy {fail.value} of {n})")
        return 1

    def _resolve_batch(self):
        pfn, status = c_void_p(), c_int()
        get = getattr(self.lib, "cuGetProcAddress_v2", None)
        if get is None:
            return None
        code = get(b"cuMemcpyBatchAsync", ctypes.pointer(pfn), BATCH_ABI_VERSION, c_uint64(0), ctypes.pointer(status))
        if code != CUDA_SUCCESS or not pfn.value:
            return None  # an older driver: loop over cuMemcpyAsync
        return BatchFn(pfn.value)

    # -- device memory -----------------------------------------------------------------
    def alloc(self, nbytes: int, zeroed: bool = True) -> int:
        """``nbytes`` of device memory, ``zeroed`` on a stream of its own (not the legacy stream) before
        it returns: a host synchronisation, so scratch memory allocated on a submit path is not zeroed."""
        ptr = c_uint64()
        with self.scope():
            self._check(self.lib.cuMemAlloc_v2(ctypes.pointer(ptr), c_size_t(nbytes)), f"cuMemAlloc({nbytes})")
        if not zeroed:
            return ptr.value
        try:
            stream = self.stream()
            try:
                with self.scope():
                    self._check(self.lib.cuMemsetD8Async(ptr, 0, c_size_t(nbytes), stream), "cuMemsetD8Async")
                self.synchronize(stream)
            finally:
                self.destroy_stream(stream)
        except BaseException:
            self.free(ptr.value)
            raise
        return ptr.value

    def free(self, ptr: int) -> None:
        with self.scope():
            self._check(self.lib.cuMemFree_v2(c_uint64(ptr)), "cuMemFree")

    def export(self, ptr: int) -> bytes:
        """The CUDA IPC handle of the allocation at ``ptr``."""
        raw = IpcMemHandle()
        with self.scope():
            self._check(self.lib.cuIpcGetMemHandle(ctypes.pointer(raw), c_uint64(ptr)), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(raw), IPC_HANDLE_BYTES)

    def open_ipc(self, handle: bytes) -> int:
        """Map memory another process exported; InvalidArgument when the handle does not open."""
        raw, ptr = IpcMemHandle(), c_uint64()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
        with self.scope():
            self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.pointer(ptr), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                        "opening the CUDA IPC memory handle (cuIpcOpenMemHandle)", ClientHandleError)
        return ptr.value

    def close_ipc(self, ptr: int) -> None:
        with self.scope():
            self._check(self.lib.cuIpcCloseMemHandle(c_uint64(ptr)), "cuIpcCloseMemHandle")

    def allocation_size(self, ptr: int) -> int:
        """Bytes of the allocation that contains device pointer ``ptr``, from ``ptr`` on."""
        base, size = c_uint64(), c_size_t()
        with self.scope():
            self._check(self.lib.cuMemGetAddressRange_v2(ctypes.pointer(base), ctypes.pointer(size), c_uint64(ptr)),
                        "cuMemGetAddressRange")
        return base.value + size.value - ptr

    # -- host memory -------------------------------------------------------------------
    def pin(self, ptr: int, nbytes: int) -> None:
        """Page-lock an ordinary (page-aligned) allocation for DMA, for every context (PORTABLE) and
        mapped into the device's address space (DEVICEMAP), and check the driver now sees host memory."""
        supported, kind = c_int(), c_uint()
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        with self.scope():
            self._check(self.lib.cuDeviceGetAttribute(ctypes.pointer(supported),
                                                      CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, self._dev),
                        "cuDeviceGetAttribute")
            if not supported.value:
                raise CudaError("this device cannot register host memory (cuMemHostRegister)", 801)
            self._check(self.lib.cuMemHostRegister_v2(c_void_p(ptr), c_size_t(nbytes), flags),
                        f"cuMemHostRegister({nbytes} bytes)")
            self._check(self.lib.cuPointerGetAttribute(ctypes.pointer(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                       c_uint64(ptr)), "cuPointerGetAttribute")
        if kind.value != CU_MEMORYTYPE_HOST:
            raise CudaError(f"registered host memory reports memory type {kind.value}", 1)

    def unpin(self, ptr: int) -> None:
        with self.scope():
            self.lib.cuMemHostUnregister(c_void_p(ptr))


class ClientHandleError(InvalidArgument):
    """A handle a client supplied did not open or could not be waited for: the request's fault."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.cuda_code = code


_DRIVERS: dict[int, Driver] = {}
_LOST_LISTENERS: list[Callable[[int, CudaError], None]] = []
_LOCK = threading.Lock()
_FORKED = False


def driver(device: int = 0) -> Driver:
    """This process's driver binding for ``device`` (loaded on first use)."""
    with _LOCK:
        if _FORKED:
            raise FailedPrecondition("CUDA was initialised in this process's parent before it forked; a forked "
                                     "child cannot use it (start workers with the 'spawn' method)")
        if device not in _DRIVERS:
            _DRIVERS[device] = Driver(load_library(), device)
        return _DRIVERS[device]


def on_device_lost(listener: Callable[[int, CudaError], None]) -> Callable[[], None]:
    """Call ``listener(device, error)`` (from the thread that saw it) on a sticky error; returns the unsubscriber."""
    _LOST_LISTENERS.append(listener)
    return lambda: _LOST_LISTENERS.remove(listener)


def _after_fork_in_child() -> None:
    global _FORKED
    if _DRIVERS:  # the parent initialised CUDA: its state is not valid here
        _FORKED = True
        _DRIVERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
