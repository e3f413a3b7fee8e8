"""The simulator's memory: device allocations with generations, IPC memory handles, copies that
check what they touch when they run, page-granular host registration."""

from __future__ import annotations

import ctypes
import os
import threading

from tests.cudasim.rules import (ALREADY_REGISTERED, ILLEGAL_ADDRESS, INVALID_CONTEXT, INVALID_HANDLE, INVALID_VALUE,
                                 MEM_MAGIC, NOT_INITIALIZED, NOT_REGISTERED, PAGE, SUCCESS, Sticky, api, read_handle,
                                 value_of, write_handle)


class MemoryCalls:
    """The driver's memory and copy entry points (mixed into ``CudaSim``)."""

    def _device_span(self, address: int, size: int) -> tuple[int, int] | None | int:
        """(allocation, generation) holding [address, address + size), None for host memory, or an error."""
        device = self.region.device_of(address)
        if device is None:
            return None
        offset = address - self.region.device_base(device)
        index = self.region.alloc_at(device, offset)
        if index is None:
            return INVALID_VALUE
        slot = self.region.allocs[index]
        if offset + size > slot.offset + slot.size:
            return INVALID_VALUE
        return index, slot.gen

    def _check_live(self, span: tuple[int, int] | None) -> None:
        if span is not None:
            slot = self.region.allocs[span[0]]
            if not slot.live or slot.gen != span[1]:
                self.violations.append("a copy touched freed or reused device memory")
                raise Sticky(ILLEGAL_ADDRESS)

    def _enqueue_copies(self, stream, copies: list[tuple[int, int, int]]) -> int:
        s = self._stream(stream)
        if isinstance(s, int):
            return s
        checked = []
        for dst, src, size in copies:
            spans = (self._device_span(dst, size), self._device_span(src, size))
            if any(isinstance(x, int) for x in spans):
                return INVALID_VALUE
            if None in spans and not any(self._registered(a, size) for a, sp in zip((dst, src), spans) if sp is None):
                self.pageable_copies += 1
            checked.append((dst, src, size, spans))
        gate = self.stall if self.stall_left > 0 else None
        self.stall_left -= gate is not None

        def run() -> None:
            self.dma.wait()
            if gate is not None:
                gate.wait()
            for dst, src, size, spans in checked:
                for span in spans:
                    self._check_live(span)
                ctypes.memmove(dst, src, size)  # the source is read now, when the copy executes

        s.put(run)
        return SUCCESS

    def _registered(self, address: int, size: int) -> bool:
        first, last = address // PAGE, (address + size - 1) // PAGE
        return any(p <= first and last < p + n for p, n, _ in self.registered.values())

    # -- copies and memory -----------------------------------------------------------------
    @api
    def cuMemcpyAsync(self, dst, src, size, stream):
        return self._enqueue_copies(stream, [(value_of(dst), value_of(src), value_of(size))])

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
        self.calls.append("cuMemcpyBatchAsync")
        if os.getpid() != self.pid:
            return NOT_INITIALIZED
        device = self._current()
        if device is not None and self.broken.get(device) is not None:
            return self.broken[device]
        injected = self.injected.get("cuMemcpyBatchAsync")
        if injected:
            self.injected["cuMemcpyBatchAsync"] = None
            fail_idx[0] = 0
            return injected[0]
        if num_attrs < 1 or attr_idxs[0] != 0:
            return INVALID_VALUE
        self.access_orders.append(attrs[0].srcAccessOrder)
        return self._enqueue_copies(stream, [(dsts[i], srcs[i], sizes[i]) for i in range(count)])

    @api
    def cuMemsetD8Async(self, dptr, value, count, stream):
        span = self._device_span(value_of(dptr), value_of(count))
        if not isinstance(span, tuple):
            return INVALID_VALUE
        s = self._stream(stream)
        if isinstance(s, int):
            return s

        def run() -> None:
            self._check_live(span)
            ctypes.memset(value_of(dptr), value_of(value), value_of(count))

        s.put(run)
        return SUCCESS

    @api
    def cuMemAlloc_v2(self, pptr, size):
        device = self._current()
        if device is None:
            return INVALID_CONTEXT
        index = self.region.alloc(device, value_of(size))
        if index < 0:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        slot = self.region.allocs[index]
        ptr = self.region.device_base(device) + slot.offset
        self.allocations[ptr] = (index, slot.gen)
        pptr.contents.value = ptr
        return SUCCESS

    @api
    def cuMemFree_v2(self, ptr):
        entry = self.allocations.pop(value_of(ptr), None)
        if entry is None:
            return INVALID_VALUE
        self.drain(self._current())  # cuMemFree synchronises implicitly, then frees
        self.region.free(entry[0])
        return SUCCESS

    def drain(self, device: int | None) -> None:
        """Return once every stream of this process on ``device`` (destroyed ones too: their work still
        runs) has run what was enqueued, as CUDA's implicitly synchronising calls do: one stream
        waiting for ever makes them wait for ever."""
        if threading.current_thread().name.startswith("sim-stream-"):
            return  # a finaliser run by a stream's own thread (no CUDA call is made from one on a GPU)
        for stream in [*self.streams.values(), *self.destroyed]:
            if stream.device == device:
                with stream.cond:
                    stream.cond.wait_for(lambda s=stream: s.done == s.enqueued or self.broken.get(s.device) is not None)

    @api
    def cuIpcGetMemHandle(self, phandle, ptr):
        entry = self.allocations.get(value_of(ptr))
        if entry is None:
            return INVALID_VALUE
        write_handle(phandle, MEM_MAGIC, *entry)
        return SUCCESS

    @api
    def cuIpcOpenMemHandle_v2(self, pptr, handle, flags):
        if self._current() is None:
            return INVALID_CONTEXT
        opened = read_handle(handle, MEM_MAGIC, len(self.region.allocs))
        if opened == INVALID_CONTEXT:
            self.violations.append("a memory handle was opened in the process that exported it")
        if isinstance(opened, int):
            return opened
        index, gen = opened
        slot = self.region.allocs[index]
        if not slot.live or slot.gen != gen:
            return INVALID_HANDLE
        ptr = self.region.device_base(slot.device) + slot.offset
        self.mappings[ptr] = (index, gen)
        self.region.map_count(index, 1)
        pptr.contents.value = ptr
        return SUCCESS

    @api
    def cuIpcCloseMemHandle(self, ptr):
        entry = self.mappings.pop(value_of(ptr), None)
        if entry is None:
            return INVALID_VALUE
        self.region.map_count(entry[0], -1)
        return SUCCESS

    @api
    def cuMemGetAddressRange_v2(self, pbase, psize, ptr):
        span = self._device_span(value_of(ptr), 1)
        if not isinstance(span, tuple):
            return INVALID_VALUE
        slot = self.region.allocs[span[0]]
        pbase.contents.value = self.region.device_base(slot.device) + slot.offset
        psize.contents.value = slot.size
        return SUCCESS

    @api
    def cuMemHostRegister_v2(self, ptr, size, flags):
        first, last = value_of(ptr) // PAGE, (value_of(ptr) + value_of(size) - 1) // PAGE
        for page, n, _ in self.registered.values():  # the driver locks whole pages
            if first < page + n and page <= last:
                self.violations.append("host memory registered twice (pages overlap)")
                return ALREADY_REGISTERED
        self.registered[value_of(ptr)] = (first, last - first + 1, value_of(flags))
        return SUCCESS

    @api
    def cuMemHostUnregister(self, ptr):
        if self.registered.pop(value_of(ptr), None) is None:
            return NOT_REGISTERED
        return SUCCESS

    @api
    def cuPointerGetAttribute(self, pdata, attribute, ptr):
        if self.region.device_of(value_of(ptr)) is not None:
            pdata.contents.value = 2  # CU_MEMORYTYPE_DEVICE
        elif self._registered(value_of(ptr), 1):
            pdata.contents.value = 1  # CU_MEMORYTYPE_HOST
        else:
            return INVALID_VALUE
        return SUCCESS
