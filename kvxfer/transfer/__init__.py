"""Copy engines, chosen by (source medium, destination medium)."""

from __future__ import annotations

import torch

from kvxfer.errors import FailedPrecondition
from kvxfer.layout import PoolLayout
from kvxfer.pool import Medium
from kvxfer.store import TierKind
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.base import CompletedHandle, CopyBatch, CopyEngine, CopyHandle, Direction
from kvxfer.transfer.cpu import CpuCopyEngine

#: (pool medium, tier) -> engine class. The CUDA engine is added with the GPU path.
ENGINES: dict[tuple[Medium, TierKind], type[CopyEngine]] = {
    (Medium.SHM, TierKind.HOST): CpuCopyEngine,
}


def engine_for(medium: Medium, storage: torch.Tensor, layout: PoolLayout, host: HostTier) -> CopyEngine:
    try:
        cls = ENGINES[(medium, TierKind.HOST)]
    except KeyError:
        raise FailedPrecondition(f"no copy engine between a {medium.value} pool and the host tier") from None
    return cls(storage, layout, host)


__all__ = ["CompletedHandle", "CopyBatch", "CopyEngine", "CopyHandle", "Direction", "engine_for", "ENGINES"]
