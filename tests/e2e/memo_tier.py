"""A lower tier written in a test, to prove what issue 48 promised: a new tier is one module, its
config section and one row in ``kvxfer.tiers.registry.LOWER_TIERS``, and nothing else changes.

``memo`` keeps the blocks the host tier evicts in this process's memory, the oldest dropped past
``capacity_blocks``. It reports itself as ``TIER_REMOTE``: a tier of a new medium also adds its
value to the proto's ``Tier`` enum (the API names where a block is; ``TierKind`` is made from it),
which a test cannot do to the compiled proto.

``python -m tests.e2e.memo_tier serve --config F`` is the ``kvxfer serve`` program with the row added.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from kvxfer.core.errors import ConfigError
from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.tiers.lower import GroupContext, StagedBlock
from kvxfer.tiers.registry import LOWER_TIERS, TierRow


@dataclass(frozen=True)
class MemoSettings:
    capacity_blocks: int


def parse(raw) -> MemoSettings | None:
    if raw is None:
        return None
    capacity = raw.get("capacity_blocks") if isinstance(raw, dict) and set(raw) == {"capacity_blocks"} else None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= 1 << 20:
        raise ConfigError("memo: must be a mapping of capacity_blocks, an integer in [1, 1048576]")
    return MemoSettings(capacity)


class MemoFetch:
    def __init__(self, tier: MemoTier, namespace: str, keys: list[bytes]) -> None:
        self.tier, self.namespace, self.keys = tier, namespace, keys
        self.formats = [0] * len(keys)

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        out = []
        for j, target in targets:
            held = self.tier.get(self.namespace, self.keys[j])
            if held is None:
                out.append((Outcome.NOT_FOUND, 0))
                continue
            checksum, data, self.formats[j] = held
            target.numpy()[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()
            out.append((Outcome.DONE, checksum) if block_checksum(target.numpy()) == checksum else
                       (Outcome.DATA_LOSS, 0))
        return out

    def end(self, corrupt: set[int]) -> None:
        self.tier.delete(self.namespace, [self.keys[j] for j in corrupt])


class MemoTier:
    kind = TierKind.REMOTE
    takes_evictions, takes_stores, restart_warm = True, False, False
    index = None

    def __init__(self, settings: MemoSettings, group: GroupContext) -> None:
        self.capacity, self.slot_bytes = settings.capacity_blocks, group.block_bytes
        self._blocks: OrderedDict[tuple[str, bytes], tuple[int, bytes, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.events: Counter[str] = Counter()

    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        self.write_now(namespace, blocks, key_format)

    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        with self._lock:
            for key, checksum, data in blocks:
                self._blocks[(namespace, key)] = (checksum, data.numpy().tobytes(), key_format)
                self._blocks.move_to_end((namespace, key))
                self.events["demoted"] += 1
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
                self.events["evicted"] += 1
        return len(blocks)

    def get(self, namespace: str, key: bytes) -> tuple[int, bytes, int] | None:
        with self._lock:
            return self._blocks.get((namespace, key))

    def wait_ready(self, until: float) -> bool:
        return True

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        with self._lock:
            return [(namespace, k) in self._blocks for k in keys]

    def fetch(self, namespace: str, keys: list[bytes]) -> MemoFetch:
        self.events["promoted"] += sum(self.contains(namespace, keys))
        return MemoFetch(self, namespace, [k for k, held in zip(keys, self.contains(namespace, keys)) if held])

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        with self._lock:
            return sum(self._blocks.pop((namespace, k), None) is not None for k in keys)

    def stats(self) -> TierStats:
        with self._lock:
            used = len(self._blocks)
        return TierStats(self.kind, self.capacity, used, used, 0, self.events["evicted"], self.slot_bytes,
                         events=dict(self.events))

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float = 0.0) -> None:
        with self._lock:
            self._blocks.clear()


ROW = TierRow(TierKind.REMOTE, "memo", MemoTier, parse, frozenset({"capacity_blocks"}))


def main() -> int:
    LOWER_TIERS.insert(len(LOWER_TIERS) - 1, ROW)  # below the local tiers and the peers, above Redis
    from service.program import main as kvxfer

    return kvxfer()


if __name__ == "__main__":
    sys.exit(main())
