"""Device memory shared between processes with CUDA IPC (cuda-python runtime API).

The pool is one ``cudaMalloc`` allocation so that its IPC handle names exactly the
pool (torch's caching allocator may hand out a slice of a larger segment). Memory
is wrapped as a torch tensor through ``__cuda_array_interface__``; the wrapper
object frees (or closes) the memory when the last tensor over it is gone.

Not exercised on machines without a GPU; see README for what is verified.
"""

from __future__ import annotations

import ctypes

import torch

from kvxfer.errors import FailedPrecondition, Internal, InvalidArgument
from kvxfer.memory.cuda_driver import driver, load_library

IPC_HANDLE_BYTES = 64
#: The type byte of torch's shared-storage handle (c10's CUDACachingAllocator::shareIpcHandle).
TORCH_CUDA_MALLOC, TORCH_EXPANDABLE_SEGMENT = b"c", b"e"


def _runtime():
    from cuda.bindings import runtime  # imported lazily: CPU hosts never need it

    return runtime


def _check(result: tuple, what: str):
    err, *values = result
    rt = _runtime()
    if err != rt.cudaError_t.cudaSuccess:
        raise FailedPrecondition(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else values


class _DeviceMemory:
    """Holds a device pointer and releases it when garbage collected."""

    def __init__(self, ptr: int, nbytes: int, device: int, opened_by_ipc: bool) -> None:
        self.ptr, self.nbytes, self.device, self.opened_by_ipc = ptr, nbytes, device, opened_by_ipc
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }

    def __del__(self) -> None:
        rt = _runtime()
        with torch.cuda.device(self.device):
            if self.opened_by_ipc:
                rt.cudaIpcCloseMemHandle(self.ptr)
            else:
                rt.cudaFree(self.ptr)


def _as_tensor(memory: _DeviceMemory) -> torch.Tensor:
    tensor = torch.as_tensor(memory, device=f"cuda:{memory.device}")
    if tensor.data_ptr() != memory.ptr:
        raise Internal("CUDA array interface made a copy of the pool")
    return tensor


def why_unusable(device: int = 0) -> str | None:
    """Why a CUDA pool cannot be served on ``device`` here, or None when it can."""
    try:
        import cuda.bindings  # noqa: F401  (cuda-python: allocation and IPC)
    except ImportError:
        return "cuda-python is not installed (pip install cuda-python, major version = torch's CUDA)"
    try:
        load_library()
    except FailedPrecondition as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if device >= torch.cuda.device_count():
        return f"no CUDA device {device} (this machine has {torch.cuda.device_count()})"
    return None


def device_uuid(device: int) -> str:
    """The GPU's UUID as nvidia-smi spells it ("GPU-xxxxxxxx-...")."""
    text = str(torch.cuda.get_device_properties(device).uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def device_by_uuid(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; FailedPrecondition if it sees no such GPU
    (a container given another GPU than the daemon's)."""
    if not torch.cuda.is_available():
        raise FailedPrecondition(f"the pool lives on GPU {uuid!r}, and this process sees no GPU")
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise FailedPrecondition(f"the pool lives on GPU {uuid!r}; this process sees only {seen}: run the engine "
                                 "and the daemon on the same GPU (see README: containers)")
    return seen.index(uuid)


def allocate(nbytes: int, device: int) -> tuple[torch.Tensor, bytes]:
    """A zeroed flat uint8 tensor of ``nbytes`` on ``device`` and its IPC handle."""
    rt = _runtime()
    with torch.cuda.device(device):
        ptr = int(_check(rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))
        memory = _DeviceMemory(ptr, nbytes, device, opened_by_ipc=False)
        _check(rt.cudaMemset(ptr, 0, nbytes), "cudaMemset")
        handle = _check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        raw = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
    return _as_tensor(memory), raw


def share_tensor(tensor: torch.Tensor) -> tuple[bytes, int]:
    """The IPC handle of the allocation that holds a CUDA ``tensor`` (from torch's caching
    allocator) and the tensor's byte offset in that allocation."""
    _device, shared, _size, storage_offset, *_ = tensor.untyped_storage()._share_cuda_()
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
    rt = _runtime()
    handle = rt.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    with torch.cuda.device(device):
        ptr = int(_check(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
    memory = _DeviceMemory(ptr, offset + nbytes, device, opened_by_ipc=True)
    size = driver(device).allocation_size(ptr)
    if offset + nbytes > size:  # the memory must hold the declared geometry
        del memory  # closes the handle
        raise InvalidArgument(f"the shared allocation holds {size} bytes; [{offset}, {offset + nbytes}) does not "
                              "fit")
    whole = _as_tensor(memory)
    return whole[offset:] if offset else whole
