"""The CUDA driver API through ctypes: streams, events, batched copies, host registration.

Why the driver API by hand: ``cuMemcpyBatchAsync`` (CUDA 12.8+) takes a whole copy
plan in one call, and the cuda-python 13 binding dropped its ``failIdx`` argument;
resolving the symbol with ``cuGetProcAddress`` at the 12.8 ABI (as vLLM does) gives
the same entry point on 12.x and 13.x drivers. One ``Driver`` per process, bound to
one device's primary context; every call that enqueues work makes that context
current on the calling thread first.

Nothing here runs on a machine without a GPU. ``Driver`` takes its library as an
argument, so the tests drive it with a ctypes stand-in that performs the copies on
host memory (``tests/unit/test_cuda_engine.py``, ``FakeCudaLibrary``).
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

from kvxfer.errors import FailedPrecondition

CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST = 2, 1
CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 0x1, 0x3
BATCH_ABI_VERSION = 12080  # cuMemcpyBatchAsync with failIdx
IPC_EVENT_HANDLE_BYTES = 64
LIBRARY = "libcuda.so.1"


class MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes: how the copies of one range of a batch access their operands."""

    _fields_ = [("srcAccessOrder", c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", c_uint)]


class IpcEventHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_EVENT_HANDLE_BYTES)]


#: cuMemcpyBatchAsync at the 12.8 ABI.
BatchFn = ctypes.CFUNCTYPE(c_int, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_size_t), c_size_t,
                           POINTER(MemcpyAttributes), POINTER(c_size_t), c_size_t, POINTER(c_size_t), c_void_p)


class CudaError(FailedPrecondition):
    """The driver failed a call. ``sticky`` errors leave the context unusable: the pool is out of service."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.cuda_code = code

    @property
    def sticky(self) -> bool:
        return self.cuda_code not in (CUDA_ERROR_NOT_READY, 1, 2, 100, 101)  # not: value, memory, device args


def load_library(name: str = LIBRARY):
    """The driver library, or a one-line reason why there is none."""
    try:
        return ctypes.CDLL(name)
    except OSError as exc:
        raise FailedPrecondition(f"no CUDA driver: cannot load {name} ({exc})") from None


class Driver:
    """One device's primary context and the calls the copy engine makes."""

    def __init__(self, lib, device: int = 0, use_batch: bool = True) -> None:
        """``use_batch=False`` always loops over cuMemcpyAsync (the device check compares both)."""
        self.lib = lib
        self.device = device
        self._check(lib.cuInit(0), "cuInit")
        dev = c_int()
        self._check(lib.cuDeviceGet(ctypes.pointer(dev), device), f"cuDeviceGet({device})")
        self._dev = dev.value
        ctx = c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.pointer(ctx), self._dev), "cuDevicePrimaryCtxRetain")
        self._ctx = ctx
        self._batch = self._resolve_batch() if use_batch else None
        self._local = threading.local()

    @property
    def batched(self) -> bool:
        """Whether cuMemcpyBatchAsync exists (driver 12.8+); otherwise copies loop over cuMemcpyAsync."""
        return self._batch is not None

    # -- errors ------------------------------------------------------------------
    def error_name(self, code: int) -> str:
        name = c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.pointer(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def _check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(f"{what} failed: {self.error_name(code)}", code)

    def current(self) -> None:
        """Make this device's context current on the calling thread (once per thread)."""
        if getattr(self._local, "ctx", None) is not self._ctx:
            self._check(self.lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._local.ctx = self._ctx

    # -- streams and events --------------------------------------------------------
    def stream(self) -> c_void_p:
        """A non-blocking stream (never the legacy stream, which would serialise with the engine's work)."""
        self.current()
        s = c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.pointer(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return s

    def record(self, stream: c_void_p) -> c_void_p:
        """A new event recorded on ``stream`` (the completion of what was enqueued before it)."""
        self.current()
        event = c_void_p()
        self._check(self.lib.cuEventCreate(ctypes.pointer(event), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self._check(self.lib.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def done(self, event: c_void_p) -> bool:
        """Poll an event: True when complete, False while not ready; a failure raises."""
        code = self.lib.cuEventQuery(event)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check(code, "cuEventQuery")
        return True

    def destroy(self, event: c_void_p) -> None:
        self.lib.cuEventDestroy_v2(event)

    def wait_ipc_event(self, stream: c_void_p, handle: bytes) -> None:
        """Make ``stream`` wait for an event another process recorded (the engine's KV writes)."""
        if len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise CudaError(f"a CUDA IPC event handle has {IPC_EVENT_HANDLE_BYTES} bytes, got {len(handle)}", 1)
        self.current()
        raw = IpcEventHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_EVENT_HANDLE_BYTES)
        event = c_void_p()
        self._check(self.lib.cuIpcOpenEventHandle(ctypes.pointer(event), raw), "cuIpcOpenEventHandle")
        try:
            self._check(self.lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")
        finally:
            self.destroy(event)

    # -- copies ------------------------------------------------------------------------
    def copy(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: c_void_p, access_order: int) -> int:
        """Enqueue ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes) on ``stream``; returns the driver calls made.

        One ``cuMemcpyBatchAsync`` where the driver has it (every copy with the same
        source access order), else one ``cuMemcpyAsync`` per descriptor.
        """
        self.current()
        n = len(sizes)
        if n == 0:
            return 0
        if self._batch is None:
            for d, s, size in zip(dsts, srcs, sizes):
                self._check(self.lib.cuMemcpyAsync(c_uint64(d), c_uint64(s), c_size_t(size), stream), "cuMemcpyAsync")
            return n
        attrs = (MemcpyAttributes * 1)()
        attrs[0].srcAccessOrder = access_order
        index = (c_size_t * 1)(0)
        fail = c_size_t(n)
        code = self._batch((c_uint64 * n)(*dsts), (c_uint64 * n)(*srcs), (c_size_t * n)(*sizes), n, attrs, index, 1,
                           ctypes.pointer(fail), stream)
        if code != CUDA_SUCCESS:
            raise CudaError(f"cuMemcpyBatchAsync failed at copy {fail.value} of {n}: {self.error_name(code)}", code)
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

    def allocation_size(self, ptr: int) -> int:
        """Bytes of the allocation that contains device pointer ``ptr``, from ``ptr`` on."""
        self.current()
        base, size = c_uint64(), c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.pointer(base), ctypes.pointer(size), c_uint64(ptr)),
                    "cuMemGetAddressRange")
        return base.value + size.value - ptr

    # -- host memory -------------------------------------------------------------------
    def pin(self, ptr: int, nbytes: int) -> None:
        """Page-lock an ordinary allocation for DMA (no power-of-two rounding, unlike torch's pinned
        allocator) and check that the driver now sees it as host memory."""
        self.current()
        supported = c_int()
        self._check(self.lib.cuDeviceGetAttribute(ctypes.pointer(supported), CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
                                                  self._dev), "cuDeviceGetAttribute")
        if not supported.value:
            raise CudaError("this device cannot register host memory (cuMemHostRegister)", 801)
        self._check(self.lib.cuMemHostRegister_v2(c_void_p(ptr), c_size_t(nbytes), CU_MEMHOSTREGISTER_PORTABLE),
                    f"cuMemHostRegister({nbytes} bytes)")
        kind = c_uint()
        self._check(self.lib.cuPointerGetAttribute(ctypes.pointer(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                   c_uint64(ptr)), "cuPointerGetAttribute")
        if kind.value != CU_MEMORYTYPE_HOST:
            raise CudaError(f"registered host memory reports memory type {kind.value}", 1)

    def unpin(self, ptr: int) -> None:
        self.current()
        self.lib.cuMemHostUnregister(c_void_p(ptr))


_DRIVERS: dict[int, Driver] = {}
_LOCK = threading.Lock()


def driver(device: int = 0) -> Driver:
    """This process's driver binding for ``device`` (loaded on first use)."""
    with _LOCK:
        if device not in _DRIVERS:
            _DRIVERS[device] = Driver(load_library(), device)
        return _DRIVERS[device]
