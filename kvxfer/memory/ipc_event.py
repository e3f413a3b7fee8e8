"""The CUDA event an offload waits for on the GPU, as the 64-byte IPC handle the daemon opens."""

from __future__ import annotations

from typing import Union

import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.memory.cuda_driver import IPC_HANDLE_BYTES

#: What an offload waits for on the GPU: a ``torch.cuda.Event(interprocess=True)`` recorded
#: after the blocks' writes, or its 64-byte IPC handle; None waits for nothing.
CudaEvent = Union[torch.cuda.Event, bytes, None]


def event_handle(event: CudaEvent) -> bytes:
    """The IPC handle the daemon opens for ``event`` (b"" for None)."""
    if event is None:
        return b""
    if isinstance(event, (bytes, bytearray)):
        raw = bytes(event)
    else:
        try:
            raw = bytes(event.ipc_handle())
        except RuntimeError as exc:
            raise InvalidArgument(f"the CUDA event cannot be shared with the daemon ({str(exc).splitlines()[0]}): "
                                  "create it with torch.cuda.Event(interprocess=True)") from None
    if len(raw) != IPC_HANDLE_BYTES:
        raise InvalidArgument(f"a CUDA IPC event handle has {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    return raw


__all__ = ["CudaEvent", "event_handle"]
