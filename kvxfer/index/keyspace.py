"""One namespace's keys -> slots, as a list of dicts (shards) chosen by the top bits of each key's hash.

A dict rebuilds its whole table now and then (to grow, or to drop the dummies that deletes
leave): stop-the-world work in proportion to its size, on whichever request inserts next. A
namespace of 3x10^7 keys in one dict paused an offload for seconds; in shards of at most
``SHARD_KEYS`` keys each rebuild is one shard's. Not smaller: a lookup's keys spread over more
shards cost more cache misses (1,024 keys stored together: 20 us in one dict or 16 shards,
30 us in 256). Tiers of up to ``SHARD_KEYS`` blocks get one shard (the dict as before). The C
passes (``kvxfer._fastpath``) choose the shard the same way (``shard_of``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

SHARD_KEYS = 1 << 20  # keys a shard holds when its tier is full (more shards: slower lookups)
MAX_SHARDS = 1 << 12


def shards_for(capacity: int) -> int:
    """Shards of a namespace in a tier of ``capacity`` slots: a power of two."""
    shards = 1
    while shards < MAX_SHARDS and shards * SHARD_KEYS < capacity:
        shards *= 2
    return shards


class KeySpace:
    """The keys of one namespace and their slots (the dict operations the index uses)."""

    __slots__ = ("shards", "_mask")

    def __init__(self, shards: int) -> None:
        self.shards: list[dict[bytes, int]] = [{} for _ in range(shards)]
        self._mask = shards - 1

    def shard(self, key: bytes) -> dict[bytes, int]:
        return self.shards[((hash(key) & 0xFFFFFFFFFFFFFFFF) >> 48) & self._mask]

    def __contains__(self, key: bytes) -> bool:
        return key in self.shard(key)

    def get(self, key: bytes, default: int | None = None) -> int | None:
        return self.shard(key).get(key, default)

    def __setitem__(self, key: bytes, slot: int) -> None:
        self.shard(key)[key] = slot

    def __delitem__(self, key: bytes) -> None:
        del self.shard(key)[key]

    def pop(self, key: bytes, default: int) -> int:
        return self.shard(key).pop(key, default)

    def update(self, pairs: Iterable[tuple[bytes, int]]) -> None:
        if not self._mask:
            self.shards[0].update(pairs)
            return
        for key, slot in pairs:
            self.shard(key)[key] = slot

    def isdisjoint(self, keys: Sequence[bytes]) -> bool:
        if not self._mask:
            return self.shards[0].keys().isdisjoint(keys)
        return not any(key in self.shard(key) for key in keys)

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __bool__(self) -> bool:
        return any(self.shards)

    def __iter__(self) -> Iterator[bytes]:
        for shard in self.shards:
            yield from shard


__all__ = ["KeySpace", "SHARD_KEYS", "shards_for"]
