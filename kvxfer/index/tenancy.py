"""Tenants' shares of a tier: another tenant's traffic never pushes a tenant below its guarantee.

A tenant is named in the config by its ``cache_salt`` (the engines put a digest of it in the
namespace: ``vllm:<model>:<digest>``, ``sglang:<model>:<digest>``) or by a namespace prefix, with
a ``share`` of every host tier and disk tier. Namespaces that match no tenant are ``other`` (no
guarantee).

The tier keeps one eviction order; a tenant's blocks leave in that order, so each tenant's are
evicted least recently used first among themselves. When a store needs room, the victims may be
the storing tenant's own blocks, and any other tenant's only while it holds more than its
guarantee: the part above it is borrowed (a share unused is lent to the others). A tenant below
its guarantee takes back what others borrowed first, before it evicts a block of its own. A store
that finds no such victim gets RESOURCE_EXHAUSTED for the blocks that did not fit, as in a tier
full of pinned blocks. Bookkeeping only: slots and counts, never bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.core.records import digest
from kvxfer.index.eviction import Evictable, EvictionPolicy

OTHER = "other"  # namespaces no tenant names
MAX_TENANTS = 16
NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")
ENGINES = ("vllm", "sglang")  # backends whose namespaces carry the cache_salt's digest third
_MEMO = 4096  # namespaces whose tenant is remembered
_NONE = np.empty(0, dtype=np.int64)  # (never written to)


@dataclass(frozen=True)
class Tenant:
    """One entry of the ``tenants`` config list."""

    name: str
    share: float  # of every host and disk tier, guaranteed
    cache_salt: str = ""
    namespace_prefix: str = ""

    def matches(self, namespace: str) -> bool:
        if self.namespace_prefix:
            return namespace.startswith(self.namespace_prefix)
        parts = namespace.split(":", 3)
        return len(parts) >= 3 and parts[0] in ENGINES and parts[2] == digest(self.cache_salt)


@dataclass(frozen=True)
class TenantStats:
    """One tenant's figures in one tier."""

    name: str
    blocks: int  # slots holding its blocks (being written included)
    guaranteed: int  # blocks no other tenant's store may take below
    evictions: int
    hits: int  # blocks loaded from the tier


class Tenancy:
    """Which tenant holds each slot of one tier, and the victims a tenant's store may take. Used under the
    index's lock."""

    def __init__(self, tenants: Sequence[Tenant], capacity: int) -> None:
        self.tenants = tuple(tenants)
        self.names = [OTHER] + [t.name for t in self.tenants]
        self.guarantee = np.array([0] + [int(t.share * capacity) for t in self.tenants], dtype=np.int64)
        self.of_slot = np.zeros(capacity, dtype=np.uint8)
        self.blocks = np.zeros(len(self.names), dtype=np.int64)
        self.evictions = np.zeros(len(self.names), dtype=np.int64)
        self.hits = np.zeros(len(self.names), dtype=np.int64)
        self._memo: dict[str, int] = {}

    def of(self, namespace: str) -> int:
        """The tenant of a namespace (0: other)."""
        found = self._memo.get(namespace)
        if found is None:
            found = next((i + 1 for i, t in enumerate(self.tenants) if t.matches(namespace)), 0)
            if len(self._memo) >= _MEMO:
                self._memo.clear()
            self._memo[namespace] = found
        return found

    def assign(self, slots: np.ndarray, tenant: int) -> None:
        """Slots now hold this tenant's blocks."""
        self.of_slot[slots] = tenant
        self.blocks[tenant] += len(slots)

    def release(self, slots: np.ndarray, evicted: bool = False) -> None:
        """Slots freed (``evicted``: to make room)."""
        counts = np.bincount(self.of_slot[slots], minlength=len(self.names))
        self.blocks -= counts
        if evicted:
            self.evictions += counts

    def hit(self, namespace: str, n: int) -> None:
        self.hits[self.of(namespace)] += n

    def take(self, policy: EvictionPolicy, n: int, tenant: int, evictable: Evictable) -> np.ndarray:
        """Up to ``n`` victims ``policy`` names for a store of ``tenant``, counted evicted here: while the
        tenant holds less than its guarantee, what others borrowed comes back first (their oldest first);
        then its own blocks and others' borrowed ones, in the policy's order."""
        owed = min(n, int(max(self.guarantee[tenant] - self.blocks[tenant], 0)))
        at = policy.victims(owed, self.victims_for(tenant, evictable, own=False)) if owed else _NONE
        self.release(at, evicted=True)
        if len(at) < n:
            more = policy.victims(n - len(at), self.victims_for(tenant, evictable))
            self.release(more, evicted=True)
            at = np.concatenate([at, more]) if len(at) else more
        return at

    def victims_for(self, tenant: int, evictable, own: bool = True):
        """``evictable`` narrowed for a store of ``tenant``: its own blocks (unless ``own`` is False), and
        another tenant's only down to its guarantee. Called on candidates in eviction order, each once (the
        policy's contract)."""
        budget = np.maximum(self.blocks - self.guarantee, 0)
        budget[tenant] = np.iinfo(np.int64).max if own else 0

        def allowed(slots: np.ndarray) -> np.ndarray:
            mask = evictable(slots)
            owners = self.of_slot[slots]
            for t in np.unique(owners[mask]).tolist():
                at = np.flatnonzero(mask & (owners == t))
                take = int(min(budget[t], len(at)))
                mask[at[take:]] = False
                budget[t] -= take
            return mask

        return allowed

    def stats(self) -> list[TenantStats]:
        return [TenantStats(name, int(self.blocks[i]), int(self.guarantee[i]), int(self.evictions[i]),
                            int(self.hits[i])) for i, name in enumerate(self.names)]


__all__ = ["MAX_TENANTS", "NAME_RE", "OTHER", "Tenancy", "Tenant", "TenantStats"]
