"""Device memory shared between processes with CUDA IPC (through ``cuda_driver``).

The pool is one ``cuMemAlloc`` allocation so that its IPC handle names exactly the
pool (torch's caching allocator may hand out a slice of a larger segment). Memory
is wrapped as a torch tensor through ``__cuda_array_interface__``; the wrapper
object frees (or closes) the memory when the last tensor over it is gone. On the
tests' simulator ("device" memory is host memory) the same memory is wrapped as a
CPU tensor.
"""

from __future__ import annotations

import ctypes

import torch

from kvxfer.core.errors import FailedPrecondition, Internal, InvalidArgument
from kvxfer.memory.cuda_driver import IPC_HANDLE_BYTES, Driver, driver

#: The type byte of torch's shared-storage handle (c10's CUDACachingAllocator::shareIpcHandle).
TORCH_CUDA_MALLOC, TORCH_EXPANDABLE_SEGMENT = b"c", b"e"


class _DeviceMemory:
    """Holds a device pointer and releases it when the last tensor over it is gone."""

    def __init__(self, gpu: Driver, ptr: int, nbytes: int, opened_by_ipc: bool) -> None:
        self.gpu, self.ptr, self.nbytes, self.opened_by_ipc = gpu, ptr, nbytes, opened_by_ipc
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}

    def __del__(self) -> None:
        if self.gpu.lost is not None:
            return  # the context is gone: nothing can be released, and nothing needs to be
        if self.opened_by_ipc:
            self.gpu.close_ipc(self.ptr)  # unmaps the importer's view: the exporter's memory can go
        else:
            self.gpu.free(self.ptr)


def _as_tensor(memory: _DeviceMemory) -> torch.Tensor:
    if memory.gpu.host_backed:  # the simulator: its device memory is this process's memory
        raw = (ctypes.c_uint8 * memory.nbytes).from_address(memory.ptr)
        raw.owner = memory  # the tensor keeps the array, the array keeps the memory
        return torch.frombuffer(raw, dtype=torch.uint8)
    tensor = torch.as_tensor(memory, device=f"cuda:{memory.gpu.device}")
    if tensor.data_ptr() != memory.ptr:
        raise Internal("CUDA array interface made a copy of the pool")
    return tensor


def device_buffer(gpu: Driver, nbytes: int) -> torch.Tensor:
    """Device memory of the daemon's own (never shared, never zeroed: no host synchronisation, so it
    may be made on a submit path): a flat uint8 tensor, freed with it."""
    return _as_tensor(_DeviceMemory(gpu, gpu.alloc(nbytes, zeroed=False), nbytes, opened_by_ipc=False))


def why_unusable(device: int = 0) -> str | None:
    """Why a CUDA pool cannot be served on ``device`` here, or None when it can."""
    try:
        count = driver(0).device_count()
        if device >= count:
            return f"no CUDA device {device} (this machine has {count})"
        if not driver(device).host_backed and not torch.cuda.is_available():
            return "torch has no CUDA (torch.cuda.is_available() is False): install a CUDA build of torch"
    except FailedPrecondition as exc:
        return str(exc)
    return None


def resolve_device(device: str) -> str:
    """``auto`` is the GPU when one is usable (a device, its driver, a CUDA build of torch), else the CPU;
    ``cuda[:N]`` where none is usable is a one-line error saying why."""
    if device == "auto":
        return "cuda:0" if why_unusable(0) is None else "cpu"
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        reason = why_unusable(index)
        if reason is not None:
            raise FailedPrecondition(f"pool device {device}: {reason}")
    return device


def device_uuid(device: int) -> str:
    """The GPU's UUID as nvidia-smi spells it ("GPU-xxxxxxxx-...")."""
    return driver(device).uuid()


def device_by_uuid(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; FailedPrecondition if it sees no such GPU
    (a container given another GPU than the daemon's)."""
    try:
        seen = [driver(i).uuid() for i in range(driver(0).device_count())]
    except FailedPrecondition as exc:
        raise FailedPrecondition(f"the pool lives on GPU {uuid!r}, and this process cannot use a GPU: {exc}") \
            from None
    if uuid not in seen:
        raise FailedPrecondition(f"the pool lives on GPU {uuid!r}; this process sees only {seen}: run the engine "
                                 "and the daemon on the same GPU (see docs/gpu.md)")
    return seen.index(uuid)


def allocate(nbytes: int, device: int) -> tuple[torch.Tensor, bytes]:
    """A zeroed flat uint8 tensor of ``nbytes`` on ``device`` and its IPC handle."""
    gpu = driver(device)
    memory = _DeviceMemory(gpu, gpu.alloc(nbytes), nbytes, opened_by_ipc=False)
    return _as_tensor(memory), gpu.export(memory.ptr)


def share_tensor(tensor: torch.Tensor) -> tuple[bytes, int]:
    """The IPC handle of the allocation that holds a CUDA ``tensor`` (from torch's caching
    allocator) and the tensor's byte offset in that allocation."""
    try:
        _device, shared, _size, storage_offset, *_ = tensor.untyped_storage()._share_cuda_()
    except RuntimeError as exc:
        raise FailedPrecondition(
            f"torch cannot share this tensor by a CUDA IPC handle ({str(exc).splitlines()[0]}): memory mapped with "
            "cuMemCreate/cuMemMap (vLLM's sleep mode, a custom allocator) has no such handle; allocate the KV "
            "cache with torch's default allocator (no sleep mode for it), or let the daemon own the pool") from None
    return ipc_handle_from_torch(bytes(shared)), storage_offset + tensor.storage_offset() * tensor.element_size()


def ipc_handle_from_torch(shared: bytes) -> bytes:
    """The ``cudaIpcMemHandle_t`` in what torch's ``_share_cuda_`` returns.

    torch 2.x writes a version byte, a type byte and the payload: ``c`` (a cudaMalloc
    segment) is followed by the 64-byte handle, ``e`` (an expandable segment) by a
    handle of another kind that ``cudaIpcOpenMemHandle`` cannot open. Older torch
    returned the bare 64 bytes."""
    if len(shared) == IPC_HANDLE_BYTES:
        return shared
    if len(shared) == IPC_HANDLE_BYTES + 2 and shared[1:2] == TORCH_CUDA_MALLOC:
        return shared[2:]
    if shared[1:2] == TORCH_EXPANDABLE_SEGMENT:
        raise FailedPrecondition("the tensor lives in an expandable segment of torch's allocator, which CUDA IPC "
                                 "handles cannot share: allocate the KV cache with expandable_segments:False in "
                                 "PYTORCH_CUDA_ALLOC_CONF, or let the daemon own the pool")
    raise FailedPrecondition(f"torch shared the tensor with a handle kvxfer does not know ({len(shared)} bytes, "
                             f"type {shared[1:2]!r})")


def open_handle(raw: bytes, nbytes: int, device: int, offset: int = 0) -> torch.Tensor:
    """Map memory another process exported; ``offset`` bytes into the allocation."""
    if len(raw) != IPC_HANDLE_BYTES:
        raise InvalidArgument(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    gpu = driver(device)
    ptr = gpu.open_ipc(raw)  # a handle that does not open (cuMem memory, a freed allocation): InvalidArgument
    memory = _DeviceMemory(gpu, ptr, offset + nbytes, opened_by_ipc=True)
    size = gpu.allocation_size(ptr)
    if offset + nbytes > size:  # the memory must hold the declared geometry
        del memory  # closes the handle
        raise InvalidArgument(f"the shared allocation holds {size} bytes; [{offset}, {offset + nbytes}) does not "
                              "fit")
    whole = _as_tensor(memory)
    return whole[offset:] if offset else whole
