"""Pool storage: one flat byte buffer laid out by a PoolLayout, mapped by many processes.

A pool is either *owned* (created here: a CUDA allocation on a GPU, else a file
under /dev/shm) or *registered* (someone else allocated it and describes it; we
map it). Either way a ``PoolDescriptor`` says everything a process needs to map
the same bytes and build the same per-layer views.
"""

from __future__ import annotations

import enum
import mmap
import os
import secrets
import signal
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import NULL_BLOCK, Medium
from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout
from kvxfer.geometry.sharding import Sharding
from kvxfer.memory import cuda_mem, shm


class Access(enum.Enum):
    """How this process reaches a pool's bytes (chooses the copy engine)."""

    MAPPED = "mapped"  # through this process's mapping
    FILE = "file"  # pread/pwrite on its descriptor: a file shrunk under us fails a copy, never faults
    GUARDED = "guarded"  # mapped, its file shrinkable: copied only by the C loop, which survives the SIGBUS

@dataclass(frozen=True)
class PoolHandle:
    """How to map a pool: a file path, or a CUDA IPC handle and device."""

    medium: Medium
    path: str = ""
    ipc_handle: bytes = b""
    device: int = 0
    offset: int = 0  # byte offset of the pool inside the file or allocation
    device_uuid: str = ""  # CUDA: the GPU, by UUID (indices differ between containers)


def new_epoch() -> int:
    """A fresh, nonzero 63-bit epoch: a new one each time a pool is created or registered."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True)
class PoolDescriptor:
    """A pool's identity and geometry: enough for any process to map it and agree on addresses."""

    pool_id: str
    spec: KVSpec
    layout: Layout
    handle: PoolHandle
    epoch: int = field(default_factory=new_epoch)
    owned: bool = True
    sharding: Sharding | None = None  # a tensor-parallel rank's pool: its blocks are stored canonically

    @property
    def pool_layout(self) -> PoolLayout:
        return PoolLayout(self.spec, self.layout)


class Pool:
    """A mapped pool: flat uint8 storage, its layout and per-layer K/V views.

    Use ``Pool.create`` to own one and ``Pool.attach`` to map one described elsewhere.
    Closing an owned pool removes its file; views already handed out stay valid
    until dropped (the kernel keeps the pages while they are mapped).
    """

    def __init__(self, descriptor: PoolDescriptor, storage: torch.Tensor | None,
                 owned_file: shm.OwnedFile | None = None, fd: int | None = None,
                 cuda_device: int | None = None, guarded: bool = False) -> None:
        """``storage``: the mapped bytes, or None for a pool reached through ``fd`` only
        (``Access.FILE``). ``fd`` is held (and closed at ``close``) when given. ``cuda_device``:
        this process's index of the GPU a CUDA pool lives on. ``guarded``: the mapped file may shrink
        under us (``Access.GUARDED``)."""
        self._cuda_device = cuda_device
        self.descriptor = descriptor
        self.layout = descriptor.pool_layout
        if storage is not None and storage.numel() != self.layout.nbytes:
            raise InvalidArgument(f"pool storage has {storage.numel()} bytes, layout needs {self.layout.nbytes}")
        if storage is None and fd is None:
            raise InvalidArgument("a pool needs its storage or its descriptor")
        self.storage: torch.Tensor | None = storage
        self.fd = fd
        self.access = Access.FILE if storage is None else Access.GUARDED if guarded else Access.MAPPED
        self._owned_file = owned_file
        # Runs at close(), at garbage collection and at interpreter exit (exceptions included).
        self._finalizer = weakref.finalize(self, _release, owned_file, fd)

    @classmethod
    def create(cls, pool_id: str, spec: KVSpec, layout: Layout, *, device: str = "cpu",
               shm_dir: str | Path | None = "/dev/shm", mode: int = 0o600, unix_group: str | int | None = None,
               sharding: Sharding | None = None) -> Pool:
        """Allocate a new zeroed pool with a fresh epoch; block 0 is the null block. ``sharding``: the pool
        is a tensor-parallel rank's (its spec the rank's heads).

        On CPU: a file under ``shm_dir`` (others map it by path), or with ``shm_dir=None``
        a sealed memfd (others receive its descriptor; its size can never change).
        """
        nbytes = spec.nbytes
        if sharding is not None:
            sharding.check(spec)
        dev = torch.device(device)
        if dev.type == "cuda":
            index = dev.index or 0
            storage, raw = cuda_mem.allocate(nbytes, index)
            handle = PoolHandle(Medium.CUDA, ipc_handle=raw, device=index, device_uuid=cuda_mem.device_uuid(index))
            return cls(PoolDescriptor(pool_id, spec, layout, handle, sharding=sharding), storage, cuda_device=index)
        if dev.type != "cpu":
            raise InvalidArgument(f"pool device must be cpu or cuda[:N], got {device!r}")
        if shm_dir is None:
            epoch = new_epoch()
            fd = shm.create_sealed(f"{pool_id}-{epoch:016x}", nbytes)
            try:
                storage = shm.map_fd(fd, nbytes)
            except BaseException:
                os.close(fd)
                raise
            return cls(PoolDescriptor(pool_id, spec, layout, PoolHandle(Medium.MEMFD), epoch=epoch, sharding=sharding),
                       storage, fd=fd)
        shm.sweep_stale(shm_dir)
        epoch = new_epoch()
        owned = shm.OwnedFile.create(shm_dir, f"{pool_id}-{epoch:016x}", nbytes, mode=mode, unix_group=unix_group)
        try:
            storage = owned.map(nbytes)
        except BaseException:
            owned.release()
            raise
        handle = PoolHandle(Medium.SHM, path=str(owned.path))
        return cls(PoolDescriptor(pool_id, spec, layout, handle, epoch=epoch, sharding=sharding), storage, owned)

    @classmethod
    def attach(cls, descriptor: PoolDescriptor) -> Pool:
        """Map a pool described by another process (a client, or a registered pool)."""
        nbytes = descriptor.pool_layout.nbytes
        handle = descriptor.handle
        if handle.offset < 0:
            raise InvalidArgument("pool handle offset must be >= 0")
        if handle.medium is Medium.SHM:
            storage = shm.map_file(handle.path, nbytes, handle.offset)
        elif handle.medium is Medium.CUDA:
            device = cuda_mem.device_by_uuid(handle.device_uuid) if handle.device_uuid else handle.device
            return cls(descriptor, cuda_mem.open_handle(handle.ipc_handle, nbytes, device, handle.offset),
                       cuda_device=device)
        else:
            raise InvalidArgument("a memfd pool is mapped from its descriptor (Pool.from_fd)")
        return cls(descriptor, storage)

    @classmethod
    def from_fd(cls, descriptor: PoolDescriptor, fd: int, *, mapped: bool = True, guarded: bool = False) -> Pool:
        """A pool over an open descriptor, which the pool then holds.

        ``mapped=False`` never maps it: copies go through the descriptor (``Access.FILE``),
        so a file shrunk by someone else fails a copy instead of faulting this process.
        ``guarded``: map it, but only the C loop's guarded copies may touch it (``Access.GUARDED``):
        a file shrunk by someone else fails those copies, and the pool for good.
        """
        nbytes, offset = descriptor.pool_layout.nbytes, descriptor.handle.offset
        if not mapped:
            size = os.fstat(fd).st_size
            if offset < 0 or offset + nbytes > size:
                raise InvalidArgument(f"the pool's file holds {size} bytes; [{offset}, {offset + nbytes}) does not "
                                      "fit")
            return cls(descriptor, None, fd=fd)
        return cls(descriptor, shm.map_fd(fd, nbytes, offset), fd=fd, guarded=guarded)

    def mapping(self) -> tuple[int, int]:
        """(address, length) of this process's whole mapping of the pool's file (page-aligned; it starts
        at the file's start, ``offset`` bytes before the pool)."""
        storage = self._live_storage()
        offset = self.descriptor.handle.offset
        length = offset + self.layout.nbytes
        return storage.data_ptr() - offset, -(-length // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def is_cuda(self) -> bool:
        return self.descriptor.handle.medium is Medium.CUDA

    @property
    def cuda_device(self) -> int | None:
        """This process's index of the GPU a CUDA pool lives on (its host tier is pinned for it);
        None on the CPU."""
        return self._cuda_device if self.is_cuda else None

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each ``[num_blocks, block_size, num_kv_heads, head_size]``, zero-copy."""
        return self.layout.views(self._live_storage())

    def _live_storage(self) -> torch.Tensor:
        if self.storage is None:
            raise InvalidArgument(f"pool {self.descriptor.pool_id} is closed or not mapped here")
        return self.storage

    def close(self) -> None:
        """Drop this process's mapping and descriptor and, for an owned file, remove the file."""
        self.storage = None
        self._finalizer()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release(owned_file: shm.OwnedFile | None, fd: int | None) -> None:
    if owned_file is not None:
        owned_file.release()
    if fd is not None:
        os.close(fd)


def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Turn these signals into ``SystemExit`` so pools are released as at a normal exit.

    Python's default for SIGTERM kills the process without running exit handlers,
    which would leave owned pool files behind. Call from the main thread of a
    process that owns pools and has no shutdown handling of its own (the daemon
    has its own).
    """

    def _exit(signum: int, _frame) -> None:
        sys.exit(128 + signum)

    for signum in signals:
        signal.signal(signum, _exit)


__all__ = ["NULL_BLOCK", "Access", "Medium", "Pool", "PoolDescriptor", "PoolHandle", "exit_on_signals", "new_epoch"]
