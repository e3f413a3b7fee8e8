"""The simulator's vocabulary: CUDA's codes, streams run by threads, events, and the entry wrapper."""

from __future__ import annotations

import ctypes
import os
import queue
import random
import struct
import threading
import time
from collections.abc import Callable

SUCCESS, INVALID_VALUE, NOT_INITIALIZED, INVALID_CONTEXT, INVALID_HANDLE = 0, 1, 3, 201, 400
NOT_READY, ILLEGAL_ADDRESS, ALREADY_REGISTERED, NOT_REGISTERED = 600, 700, 712, 713
NOT_PERMITTED, NOT_FOUND = 800, 500
NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
         3: "CUDA_ERROR_NOT_INITIALIZED", 201: "CUDA_ERROR_INVALID_CONTEXT", 400: "CUDA_ERROR_INVALID_HANDLE",
         500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
         712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", 713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
         719: "CUDA_ERROR_LAUNCH_FAILED", 800: "CUDA_ERROR_NOT_PERMITTED"}
EVENT_INTERPROCESS, EVENT_DISABLE_TIMING = 0x4, 0x2
LEGACY_STREAMS = (0, 1, 2)  # NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
PAGE = 4096
MEM_MAGIC, EVENT_MAGIC = b"KVSIMMEM", b"KVSIMEVT"
CTX_BASE = 0xC000


def value_of(arg) -> int:
    """The integer behind a ctypes argument (None and NULL are 0)."""
    value = getattr(arg, "value", arg)
    return int(value or 0)


class Sticky(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class Stream:
    """A queue of operations run in order by one worker thread."""

    def __init__(self, sim, sid: int, device: int) -> None:
        self.sim, self.id, self.device = sim, sid, device
        self.ops: queue.Queue = queue.Queue()
        self.enqueued = self.done = 0
        self.cond = threading.Condition()
        self.rng = random.Random(sid)
        threading.Thread(target=self._run, name=f"sim-stream-{sid:x}", daemon=True).start()

    def put(self, op: Callable[[], None]) -> None:
        with self.cond:
            self.enqueued += 1
        self.ops.put(op)

    def _run(self) -> None:
        while True:
            op = self.ops.get()
            if op is None:
                return
            time.sleep(self.rng.uniform(0, self.sim.delay_s))
            try:
                if self.sim.broken.get(self.device) is None:
                    if self.sim.async_error:
                        code, self.sim.async_error = self.sim.async_error, 0
                        raise Sticky(code)
                    if code := self.sim.region.take_fault():
                        raise Sticky(code)
                    op()
            except Sticky as exc:
                self.sim.break_device(self.device, exc.code, "a stream operation failed")
            with self.cond:
                self.done += 1
                self.cond.notify_all()

    def idle(self) -> bool:
        with self.cond:
            return self.done == self.enqueued


class Event:
    def __init__(self, index: int, gen: int, device: int, opened: bool) -> None:
        self.index, self.gen, self.device, self.opened = index, gen, device, opened


def api(fn):
    """Every driver entry: refused after fork, injected failures, the sticky state of the context."""
    name = fn.__name__

    def call(self, *args):
        self.calls.append(name)
        if os.getpid() != self.pid:
            return NOT_INITIALIZED
        injected = self.injected.get(name)
        if injected and injected[3]:  # calls that succeed first
            self.injected[name] = (*injected[:3], injected[3] - 1)
        elif injected:
            code, sticky, left, _ = injected
            self.injected[name] = (code, sticky, left - 1, 0) if left > 1 else None
            if sticky:
                self.break_device(self._current(), code, f"{name} failed (injected)")
            return code
        device = self._current()
        if device is not None and self.broken.get(device) is not None and name not in UNCHECKED:
            return self.broken[device]
        return fn(self, *args)

    call.__name__ = name
    return call


UNCHECKED = {"cuGetErrorName", "cuCtxSetCurrent", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
             "cuInit", "cuDeviceGet", "cuDeviceGetCount"}


def write_handle(phandle, magic: bytes, index: int, gen: int) -> None:
    """A 64-byte IPC handle naming entry ``index`` (generation ``gen``) of the region, made here."""
    raw = magic + struct.pack("<qqq", index, gen, os.getpid())
    ctypes.memmove(ctypes.addressof(phandle.contents), raw.ljust(64, b"\0"), 64)


def read_handle(handle, magic: bytes, entries: int) -> tuple[int, int] | int:
    """(index, generation) of a handle another process made, or the error CUDA gives for it
    (INVALID_CONTEXT: opened in the process that made it)."""
    raw = ctypes.string_at(ctypes.addressof(handle), 64)
    if raw[:8] != magic:
        return INVALID_VALUE
    index, gen, maker = struct.unpack_from("<qqq", raw, 8)
    if maker == os.getpid():
        return INVALID_CONTEXT
    return (index, gen) if 0 <= index < entries else INVALID_VALUE
