"""The simulated GPUs' shared state: device memory, allocations and events, in one file.

Every process of a test (the daemon side, the engine) maps the same file, so a CUDA IPC
handle exported by one process opens in another and an event one process records is
seen completing by another, as on a GPU. Layout: a table of events, a table of
allocations, then each device's memory. Table updates take an ``flock`` on the file; an
event's ``completed`` has one writer (its creator's stream worker).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from contextlib import contextmanager
from pathlib import Path

MAX_EVENTS, MAX_ALLOCS = 4096, 1024
ALIGN = 512  # cudaMalloc aligns to at least 256 bytes


class EventSlot(ctypes.Structure):
    """One event: ``recorded`` counts its records, ``completed`` is the last record that ran."""

    _fields_ = [("gen", ctypes.c_int64), ("live", ctypes.c_int64), ("creator", ctypes.c_int64),
                ("flags", ctypes.c_int64), ("device", ctypes.c_int64), ("recorded", ctypes.c_int64),
                ("completed", ctypes.c_int64)]


class AllocSlot(ctypes.Structure):
    """One allocation: ``offset`` bytes into its device's memory; ``gen`` changes with each reuse."""

    _fields_ = [("gen", ctypes.c_int64), ("live", ctypes.c_int64), ("owner", ctypes.c_int64),
                ("device", ctypes.c_int64), ("offset", ctypes.c_int64), ("size", ctypes.c_int64),
                ("mapped", ctypes.c_int64)]  # IPC mappings other processes hold open


class Header(ctypes.Structure):
    """``fault``: a sticky error the next stream operation of process ``fault_pid`` raises (a test
    breaks the GPU under a daemon in another process this way)."""

    _fields_ = [("devices", ctypes.c_int64), ("device_bytes", ctypes.c_int64), ("fault", ctypes.c_int64),
                ("fault_pid", ctypes.c_int64)]


class Region:
    """The mapped file: tables and device memory, at this process's addresses."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        self.header = Header.from_buffer(self._map, 0)
        at = ctypes.sizeof(Header)
        self.events = (EventSlot * MAX_EVENTS).from_buffer(self._map, at)
        at += ctypes.sizeof(self.events)
        self.allocs = (AllocSlot * MAX_ALLOCS).from_buffer(self._map, at)
        at += ctypes.sizeof(self.allocs)
        self.memory_at = at
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._map, 0))
        self.devices, self.device_bytes = self.header.devices, self.header.device_bytes

    @classmethod
    def create(cls, path: str | Path, devices: int = 2, device_bytes: int = 64 << 20) -> Region:
        """A new region of ``devices`` GPUs with ``device_bytes`` of memory each (sparse file)."""
        tables = ctypes.sizeof(Header) + ctypes.sizeof(EventSlot) * MAX_EVENTS + ctypes.sizeof(AllocSlot) * MAX_ALLOCS
        with open(path, "wb") as f:
            f.truncate(tables + devices * device_bytes)
            f.seek(0)
            f.write(bytes(Header(devices, device_bytes, 0, 0)))
        return cls(path)

    # -- memory ----------------------------------------------------------------------
    def device_base(self, device: int) -> int:
        """This process's address of ``device``'s memory."""
        return self.base + self.memory_at + device * self.device_bytes

    def device_of(self, address: int) -> int | None:
        """The device whose memory holds ``address`` (in this process), or None (host memory)."""
        first = self.base + self.memory_at
        if not first <= address < first + self.devices * self.device_bytes:
            return None
        return (address - first) // self.device_bytes

    def alloc(self, device: int, size: int) -> int:
        """A free allocation slot with ``size`` bytes on ``device`` (first fit), or -1."""
        size = -(-max(size, 1) // ALIGN) * ALIGN
        with self.locked():
            used = sorted((a.offset, a.size) for a in self.allocs if a.live and a.device == device)
            start = 0
            for offset, length in used + [(self.device_bytes, 0)]:
                if offset - start >= size:
                    break
                start = offset + length
            else:
                return -1
            if start + size > self.device_bytes:
                return -1
            for index, slot in enumerate(self.allocs):
                if not slot.live:
                    slot.gen, slot.live, slot.owner = slot.gen + 1, 1, os.getpid()
                    slot.device, slot.offset, slot.size, slot.mapped = device, start, size, 0
                    return index
        return -1

    def alloc_at(self, device: int, offset: int) -> int | None:
        """The live allocation containing byte ``offset`` of ``device``'s memory."""
        for index, slot in enumerate(self.allocs):
            if slot.live and slot.device == device and slot.offset <= offset < slot.offset + slot.size:
                return index
        return None

    def map_count(self, index: int, delta: int) -> None:
        with self.locked():
            self.allocs[index].mapped += delta

    def free(self, index: int) -> None:
        with self.locked():
            self.allocs[index].live = 0

    # -- events ------------------------------------------------------------------------
    def new_event(self, device: int, flags: int) -> int:
        with self.locked():
            for index, slot in enumerate(self.events):
                if not slot.live:
                    slot.gen, slot.live, slot.creator, slot.flags = slot.gen + 1, 1, os.getpid(), flags
                    slot.device, slot.recorded, slot.completed = device, 0, 0
                    return index
        raise MemoryError("the simulator's event table is full")

    def take_fault(self) -> int:
        """The fault planted for this process, once (0: none)."""
        if self.header.fault_pid != os.getpid() or not self.header.fault:
            return 0
        with self.locked():
            code, self.header.fault = self.header.fault, 0
        return code

    @contextmanager
    def locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
