"""FakeCudaLibrary: a ctypes stand-in for libcuda, the one fake of the suite.

It exists because no GPU is here. It answers the driver calls ``kvxfer.memory.
cuda_driver.Driver`` makes, with the same argument conventions (ctypes pointers
for out-parameters, a real CFUNCTYPE for the batched copy resolved through
cuGetProcAddress), and performs the copies on host memory when an event is polled,
so that marshalling (pointer arrays, sizes, attribute indices) is checked byte for
byte. It also records what was called, and can be told to answer NOT_READY a few
times or fail with a sticky error.
"""

import ctypes

from kvxfer.memory.cuda_driver import BATCH_ABI_VERSION, CUDA_ERROR_NOT_READY, BatchFn

NAMES = {0: b"CUDA_SUCCESS", 1: b"CUDA_ERROR_INVALID_VALUE", 600: b"CUDA_ERROR_NOT_READY",
         700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}


class FakeCudaLibrary:
    def __init__(self, batched: bool = True, not_ready_polls: int = 0) -> None:
        self.batched = batched
        self.not_ready_polls = not_ready_polls  # answers NOT_READY this many times per event
        self.query_error = 0  # a cuEventQuery error to inject (700: sticky)
        self.batch_error = 0
        self.calls: list[tuple] = []
        self.streams: dict[int, int] = {}  # stream -> flags
        self.pending: dict[int, list[tuple[int, int, int]]] = {}  # stream -> copies not yet done
        self.events: dict[int, list] = {}  # event -> [stream, copies it covers, polls left]
        self.registered: dict[int, int] = {}
        self._next = 0x100
        self._keep = []
        self._batch_fn = BatchFn(self._batch)

    def _id(self) -> int:
        self._next += 0x10
        return self._next

    # -- context ---------------------------------------------------------------
    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, pdev, ordinal):
        pdev.contents.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, pctx, dev):
        pctx.contents.value = 0xC0
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("cuCtxSetCurrent", ctx.value))
        return 0

    def cuGetErrorName(self, code, pname):
        name = ctypes.c_char_p(NAMES.get(code, b"CUDA_ERROR_UNKNOWN"))
        self._keep.append(name)
        pname.contents.value = name.value
        return 0

    def cuDeviceGetAttribute(self, pvalue, attribute, dev):
        pvalue.contents.value = 1
        return 0

    def cuGetProcAddress_v2(self, symbol, ppfn, version, flags, pstatus):
        self.calls.append(("cuGetProcAddress_v2", symbol, version))
        if not self.batched or symbol != b"cuMemcpyBatchAsync" or version != BATCH_ABI_VERSION:
            return 500  # CUDA_ERROR_NOT_FOUND
        ppfn.contents.value = ctypes.cast(self._batch_fn, ctypes.c_void_p).value
        return 0

    # -- streams and events --------------------------------------------------------
    def cuStreamCreate(self, pstream, flags):
        s = self._id()
        self.streams[s] = flags
        self.pending[s] = []
        pstream.contents.value = s
        return 0

    def cuEventCreate(self, pevent, flags):
        e = self._id()
        self.events[e] = [None, [], self.not_ready_polls]
        pevent.contents.value = e
        return 0

    def cuEventRecord(self, event, stream):
        entry = self.events[event.value]
        entry[0], entry[1] = stream.value, self.pending[stream.value]
        self.pending[stream.value] = []
        return 0

    def cuEventQuery(self, event):
        if self.query_error:
            return self.query_error
        entry = self.events[event.value]
        if entry[2] > 0:
            entry[2] -= 1
            return CUDA_ERROR_NOT_READY
        for dst, src, size in entry[1]:  # the "DMA" runs now
            ctypes.memmove(dst, src, size)
        entry[1] = []
        return 0

    def cuEventDestroy_v2(self, event):
        self.events.pop(event.value, None)
        return 0

    def cuIpcOpenEventHandle(self, pevent, handle):
        self.calls.append(("cuIpcOpenEventHandle", ctypes.string_at(ctypes.addressof(handle), 64)))
        return self.cuEventCreate(pevent, 0)

    def cuStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("cuStreamWaitEvent", stream.value))
        return 0

    # -- copies ----------------------------------------------------------------------
    def cuMemcpyAsync(self, dst, src, size, stream):
        self.calls.append(("cuMemcpyAsync", stream.value))
        self.pending[stream.value].append((dst.value, src.value, size.value))
        return 0

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
        if self.batch_error:
            fail_idx[0] = 0
            return self.batch_error
        orders = []
        for k in range(num_attrs):  # attrs[k] covers copies attr_idxs[k] .. attr_idxs[k+1]-1
            end = attr_idxs[k + 1] if k + 1 < num_attrs else count
            orders += [attrs[k].srcAccessOrder] * (end - attr_idxs[k])
        self.calls.append(("cuMemcpyBatchAsync", stream, count, tuple(orders)))
        self.pending[stream].extend((dsts[i], srcs[i], sizes[i]) for i in range(count))
        return 0

    # -- host memory --------------------------------------------------------------
    def cuMemHostRegister_v2(self, ptr, size, flags):
        self.registered[ptr.value] = size.value
        return 0

    def cuPointerGetAttribute(self, pdata, attribute, ptr):
        pdata.contents.value = 1 if ptr.value in self.registered else 2
        return 0

    def cuMemHostUnregister(self, ptr):
        self.registered.pop(ptr.value, None)
        return 0
