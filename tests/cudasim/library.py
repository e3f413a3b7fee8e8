"""CudaSim: the CUDA driver API as a GPU would answer it, for a machine without one.

It replaces libcuda for ``kvxfer.memory.cuda_driver.Driver`` (same functions, same
ctypes argument conventions, the batched copy as a real CFUNCTYPE resolved through
cuGetProcAddress) and obeys CUDA's rules rather than finishing work at once:

- Each stream is a queue run by its own worker thread, with a random delay before each
  operation: work runs in stream order, never at enqueue time, and a copy reads its
  source when it executes. An event records a position in a stream; cuStreamWaitEvent
  holds a stream until the event's latest record (at the time of the call) has run.
- IPC: memory and event handles open in another process mapping the same ``Region``
  (never in the exporting process); exporting an event needs INTERPROCESS and
  DISABLE_TIMING; an event its creator destroyed cannot be opened or waited for.
- Contexts: several devices, a current context per thread; streams, events and copies
  are checked against it (INVALID_CONTEXT without one, INVALID_HANDLE across devices).
  The legacy and per-thread default streams are refused (kvxfer must never use them).
- Memory: allocations carry generations, so a copy into freed or reused memory is a
  sticky ILLEGAL_ADDRESS; host registration is page-granular (overlap: already registered).
  cuMemFree synchronises implicitly: it returns once every stream of the context (destroyed
  ones too) has run its work, so a stream waiting for ever makes it wait for ever.
- Errors: ``inject`` fails the next call of a function (non-sticky, or sticky: every
  later call in that context fails); ``inject_async`` fails the next stream operation.
- After fork, every call in the child fails (CUDA cannot be used there).

``violations`` lists every rule broken, for tests to assert on.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable

from kvxfer.memory.cuda_driver import BATCH_ABI_VERSION, BatchFn
from tests.cudasim.memory import MemoryCalls
from tests.cudasim.region import Region
from tests.cudasim.rules import (CTX_BASE, EVENT_DISABLE_TIMING, EVENT_INTERPROCESS, EVENT_MAGIC, INVALID_CONTEXT,
                                 INVALID_HANDLE, INVALID_VALUE, LEGACY_STREAMS, NAMES, NOT_FOUND, NOT_PERMITTED,
                                 NOT_READY, ILLEGAL_ADDRESS, SUCCESS, Event, Stream, api, read_handle, value_of,
                                 write_handle)

class CudaSim(MemoryCalls):
    """The driver library of one process over a shared ``Region``."""

    host_backed = True  # device memory is host memory here: kvxfer wraps it as CPU tensors

    def __init__(self, region: Region | str, delay_s: float = 0.002, batched: bool = True) -> None:
        self.region = region if isinstance(region, Region) else Region(region)
        self.delay_s, self.batched, self.pid = delay_s, batched, os.getpid()
        self.calls: list[str] = []
        self.violations: list[str] = []
        self.injected: dict[str, tuple[int, bool, int] | None] = {}
        self.async_error = 0
        self.broken: dict[int, int | None] = {}
        self.streams: dict[int, Stream] = {}
        self.destroyed: list[Stream] = []  # destroyed with work still enqueued
        self.events: dict[int, Event] = {}
        self.registered: dict[int, tuple[int, int, int]] = {}  # pointer -> (first page, pages, flags)
        self.mappings: dict[int, tuple[int, int]] = {}  # pointer -> (allocation, generation) opened by IPC
        self.allocations: dict[int, tuple[int, int]] = {}  # pointer -> (allocation, generation) made here
        self.pageable_copies = 0
        self.access_orders: list[int] = []  # each batched copy call's source access order
        self.retained: set[int] = set()  # devices whose primary context was retained
        self.dma = threading.Event()  # cleared: copies stall (a hung copy engine), until set again
        self.dma.set()
        self.stall, self.stall_left = threading.Event(), 0  # ``stall_copies``
        self.stall.set()
        self._ids, self._tls, self._lock = iter(range(0x1000, 1 << 40, 0x10)), threading.local(), threading.Lock()
        self._batch_fn = BatchFn(self._batch)
        self._keep: list = []

    # -- test controls -------------------------------------------------------------------
    def inject(self, name: str, code: int, sticky: bool = False, times: int = 1, after: int = 0) -> None:
        """Fail ``times`` calls of ``name`` with ``code`` (sticky: the context breaks too), after ``after``
        calls that succeed (a loop of calls failing midway)."""
        self.injected[name] = (code, sticky, times, after)

    def stall_copies(self, times: int = 1) -> None:
        """The next ``times`` copy calls stall on their streams (a copy that misses its deadline while the
        other streams run on) until ``stall.set()``."""
        self.stall.clear()
        self.stall_left = times

    def inject_async(self, code: int = ILLEGAL_ADDRESS) -> None:
        """The next stream operation to run fails with sticky ``code`` (a kernel's illegal address)."""
        self.async_error = code

    def break_device(self, device: int | None, code: int, why: str) -> None:
        if device is not None and self.broken.get(device) is None:
            self.broken[device] = code
            self.violations.append(f"device {device} broken ({NAMES.get(code, code)}): {why}")

    def launch(self, stream: int, fn: Callable[[], None]) -> int:
        """A host function run in stream order (cuLaunchHostFunc; the engine's "kernels")."""
        self.streams[stream].put(fn)
        return SUCCESS

    @api
    def cuLaunchHostFunc(self, stream, fn, user_data):
        s = self._stream(stream)
        if isinstance(s, int):
            return s
        s.put(lambda: fn(user_data))
        return SUCCESS

    def live_streams(self) -> int:
        return len(self.streams)

    # -- helpers -------------------------------------------------------------------------
    def _new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def _current(self) -> int | None:
        stack = self._stack()
        return stack[-1] - CTX_BASE if stack else None

    def _stream(self, handle) -> Stream | int:
        """The stream, or the error code a GPU would give for it in the current context."""
        sid = value_of(handle)
        if sid in LEGACY_STREAMS:
            self.violations.append("the legacy (or per-thread default) stream was used")
            return NOT_PERMITTED
        device = self._current()
        if device is None:
            return INVALID_CONTEXT
        stream = self.streams.get(sid)
        if stream is None or stream.device != device:
            where = "after destruction" if stream is None else "in another context"
            self.violations.append(f"stream {sid:#x} used {where}")
            return INVALID_HANDLE
        return stream

    def _event(self, handle, same_device: bool = True) -> Event | int:
        device = self._current()
        if device is None:
            return INVALID_CONTEXT
        event = self.events.get(value_of(handle))
        if event is None or (same_device and event.device != device):
            self.violations.append("event used after destruction or in another context")
            return INVALID_HANDLE
        if self.region.events[event.index].gen != event.gen or not self.region.events[event.index].live:
            self.violations.append("an IPC event was used after its creator destroyed it")
            return INVALID_HANDLE
        return event

    # -- initialisation and contexts -------------------------------------------------------
    @api
    def cuInit(self, flags):
        return SUCCESS

    @api
    def cuDeviceGetCount(self, pcount):
        pcount.contents.value = self.region.devices
        return SUCCESS

    @api
    def cuDeviceGet(self, pdev, ordinal):
        if not 0 <= value_of(ordinal) < self.region.devices:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        pdev.contents.value = value_of(ordinal)
        return SUCCESS

    @api
    def cuDeviceGetUuid_v2(self, puuid, dev):
        uuid = struct.pack("<QQ", zlib.crc32(self.region.path.encode()), value_of(dev))  # the same in every process
        ctypes.memmove(ctypes.addressof(puuid.contents), uuid, 16)
        return SUCCESS

    @api
    def cuDevicePrimaryCtxRetain(self, pctx, dev):
        self.retained.add(value_of(dev))  # (a real retain costs the device a few hundred MiB)
        pctx.contents.value = CTX_BASE + value_of(dev)
        return SUCCESS

    @api
    def cuCtxSetCurrent(self, ctx):
        stack = self._stack()
        if stack:
            stack.pop()
        if value_of(ctx):
            stack.append(value_of(ctx))
        return SUCCESS

    @api
    def cuCtxGetCurrent(self, pctx):
        stack = self._stack()
        pctx.contents.value = stack[-1] if stack else None
        return SUCCESS

    @api
    def cuCtxPushCurrent_v2(self, ctx):
        self._stack().append(value_of(ctx))
        return SUCCESS

    @api
    def cuCtxPopCurrent_v2(self, pctx):
        stack = self._stack()
        if not stack:
            return INVALID_CONTEXT
        popped = stack.pop()
        if pctx is not None:
            pctx.contents.value = popped
        return SUCCESS

    @api
    def cuGetErrorName(self, code, pname):
        name = ctypes.c_char_p(NAMES.get(value_of(code), "CUDA_ERROR_UNKNOWN").encode())
        self._keep.append(name)
        pname.contents.value = name.value
        return SUCCESS

    @api
    def cuDeviceGetAttribute(self, pvalue, attribute, dev):
        pvalue.contents.value = 1
        return SUCCESS

    @api
    def cuGetProcAddress_v2(self, symbol, ppfn, version, flags, pstatus):
        if not self.batched or symbol != b"cuMemcpyBatchAsync" or version != BATCH_ABI_VERSION:
            return NOT_FOUND
        ppfn.contents.value = ctypes.cast(self._batch_fn, ctypes.c_void_p).value
        return SUCCESS

    # -- streams and events ----------------------------------------------------------------
    @api
    def cuStreamCreate(self, pstream, flags):
        device = self._current()
        if device is None:
            return INVALID_CONTEXT
        sid = self._new_id()
        self.streams[sid] = Stream(self, sid, device)
        pstream.contents.value = sid
        return SUCCESS

    @api
    def cuStreamDestroy_v2(self, stream):
        s = self._stream(stream)
        if isinstance(s, int):
            return s
        del self.streams[s.id]
        self.destroyed = [d for d in self.destroyed if not d.idle()] + [s]  # its work runs on, and is waited for
        s.ops.put(None)  # the worker ends after the work already enqueued, as CUDA lets it
        return SUCCESS

    @api
    def cuStreamSynchronize(self, stream):
        s = self._stream(stream)
        if isinstance(s, int):
            return s
        with s.cond:
            s.cond.wait_for(lambda: s.done == s.enqueued or self.broken.get(s.device) is not None)
        return self.broken.get(s.device) or SUCCESS

    @api
    def cuEventCreate(self, pevent, flags):
        device = self._current()
        if device is None:
            return INVALID_CONTEXT
        index = self.region.new_event(device, value_of(flags))
        eid = self._new_id()
        self.events[eid] = Event(index, self.region.events[index].gen, device, opened=False)
        pevent.contents.value = eid
        return SUCCESS

    @api
    def cuEventRecord(self, event, stream):
        e, s = self._event(event), self._stream(stream)
        if isinstance(e, int) or isinstance(s, int):
            return e if isinstance(e, int) else s
        slot = self.region.events[e.index]
        slot.recorded += 1
        seq = slot.recorded

        def complete() -> None:
            slot.completed = max(slot.completed, seq)
            if slot.live == 2 and slot.completed >= slot.recorded:  # destroyed while pending
                slot.live = 0

        s.put(complete)
        return SUCCESS

    @api
    def cuEventQuery(self, event):
        e = self._event(event, same_device=False)
        if isinstance(e, int):
            return e
        slot = self.region.events[e.index]
        return SUCCESS if slot.completed >= slot.recorded else NOT_READY

    @api
    def cuEventSynchronize(self, event):
        while (code := self.cuEventQuery(event)) == NOT_READY:
            time.sleep(0.0002)
        return code

    @api
    def cuEventDestroy_v2(self, event):
        e = self.events.pop(value_of(event), None)
        if e is None:
            return INVALID_HANDLE
        if not e.opened:
            slot = self.region.events[e.index]
            with self.region.locked():
                slot.live = 0 if slot.completed >= slot.recorded else 2
        return SUCCESS

    @api
    def cuIpcGetEventHandle(self, phandle, event):
        e = self._event(event)
        if isinstance(e, int):
            return e
        flags = self.region.events[e.index].flags
        if flags & (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING) != EVENT_INTERPROCESS | EVENT_DISABLE_TIMING:
            self.violations.append("an event without INTERPROCESS|DISABLE_TIMING was exported")
            return INVALID_VALUE
        write_handle(phandle, EVENT_MAGIC, e.index, e.gen)
        return SUCCESS

    @api
    def cuIpcOpenEventHandle(self, pevent, handle):
        device = self._current()
        if device is None:
            return INVALID_CONTEXT
        opened = read_handle(handle, EVENT_MAGIC, len(self.region.events))
        if opened == INVALID_CONTEXT:
            self.violations.append("an IPC event handle was opened in the process that created it")
        if isinstance(opened, int):
            return opened
        index, gen = opened
        slot = self.region.events[index]
        if slot.gen != gen or slot.live != 1:
            self.violations.append("an IPC event handle was opened after its creator destroyed the event")
            return INVALID_HANDLE
        eid = self._new_id()
        self.events[eid] = Event(index, gen, device, opened=True)
        pevent.contents.value = eid
        return SUCCESS

    @api
    def cuStreamWaitEvent(self, stream, event, flags):
        s, e = self._stream(stream), self._event(event, same_device=False)
        if isinstance(s, int) or isinstance(e, int):
            return s if isinstance(s, int) else e
        slot, target, gen = self.region.events[e.index], self.region.events[e.index].recorded, e.gen

        def wait() -> None:  # the event's latest record, as of the call, must have run
            while slot.completed < target and slot.gen == gen:
                time.sleep(0.0002)

        s.put(wait)
        return SUCCESS
