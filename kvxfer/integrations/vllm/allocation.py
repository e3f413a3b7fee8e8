"""vLLM's KV cache allocated in shared memory, so that the daemon serves it with zero copy.

vLLM allocates the whole KV cache of a worker as one ``torch.zeros(n, dtype=int8)`` inside
the context its connector returns from ``get_mem_pool_context()`` (``allocate_kv_cache``).
On the CPU this context serves that one allocation from a sealed memfd instead of
anonymous memory; the worker then hands the memfd's descriptor to the daemon, which maps
the same pages. On a GPU no context is needed: the daemon opens the allocation through
CUDA IPC (``Client.register_cuda_tensor``).
"""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode

from kvxfer.client import create_sealed, map_fd


def _is_cpu(device: object) -> bool:
    return device is None or torch.device(device).type == "cpu"


class SharedKVAllocation(TorchFunctionMode):
    """Serves the first CPU ``torch.zeros(n, dtype=torch.int8)`` made inside it from a sealed memfd.

    Every other call passes through untouched. ``fd`` and ``tensor`` are set once it served one.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fd: int | None = None
        self.tensor: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.zeros and self.tensor is None and kwargs.get("dtype") is torch.int8
                and _is_cpu(kwargs.get("device")) and len(args) == 1 and isinstance(args[0], int)):
            nbytes = args[0]
            fd = create_sealed(self.name, nbytes)  # zeroed, reserved: fails here, not on first touch
            self.fd, self.tensor = fd, map_fd(fd, nbytes).view(torch.int8)
            return self.tensor
        return func(*args, **kwargs)

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lies in the memory this context allocated."""
        if self.tensor is None or tensor.device.type != "cpu":
            return False
        base = self.tensor.data_ptr()
        return base <= tensor.data_ptr() < base + self.tensor.numel()

    def offset_of(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr() - self.tensor.data_ptr()

    def close(self) -> None:
        """Close the descriptor (the mapping lives on with the tensor)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
