"""What an SGLang engine's HiCache pages are called in kvxfer: geometry, pool ids, groups, namespaces.

Pure functions of the host pool's geometry and the storage config, so that they can be tested
without SGLang. One SGLang page is one kvxfer block: the pool's ``num_blocks`` is the host
pool's page count and its ``block_size`` the page size. SGLang's host layouts are kvxfer
layouts of the same bytes (its token axis is pages x tokens of a page), so the daemon reads
and writes SGLang's host pages in place.

A namespace binds what determines a page's bytes: the model, the layout, the geometry, the
dtype, and the rank's share of the model (tensor, pipeline and context parallel rank; an MLA
latent is the same on every tensor-parallel rank, so its ranks share one namespace).
SGLang seeds its page hashes with the request's ``cache_salt``, so tenants never share keys;
``tenant`` separates deployments that must not share even equal keys.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from kvxfer.client import KVSpec, Layout, dtype_name
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import digest
from kvxfer.integrations.identity import safe_group_prefix

#: SGLang's host layouts (``--hicache-mem-layout``) in kvxfer's axes: MHA pools hold K and V
#: outermost ([2, ...]); MLA pools one latent a token (KV and H of size 1).
MHA_LAYOUTS: dict[str, str] = {
    "layer_first": "KV,L,B,N,H,D",  # [2, layers, pages x page_size, heads, head_dim]
    "page_first": "KV,B,N,L,H,D",  # [2, pages x page_size, layers, heads, head_dim]
    "page_first_direct": "KV,B,L,N,H,D",  # [2, pages, layers, page_size, heads, head_dim]
    "page_head": "KV,B,H,N,L,D",  # [2, pages, heads, page_size, layers, head_dim]
}
MLA_LAYOUTS: dict[str, str] = {
    "layer_first": "L,B,N,H,KV,D",  # [layers, pages x page_size, 1, kv_cache_dim]
    "page_first": "B,N,L,H,KV,D",  # [pages x page_size, layers, 1, kv_cache_dim]
    "page_first_direct": "B,L,N,H,KV,D",  # [pages, layers, page_size, 1, kv_cache_dim]
}



@dataclass(frozen=True)
class HostGeometry:
    """One SGLang host KV pool as kvxfer sees it."""

    spec: KVSpec
    layout: Layout
    host_layout: str  # SGLang's name for it
    mla: bool

    @classmethod
    def of(cls, *, mla: bool, host_layout: str, num_layers: int, num_pages: int, page_size: int, num_heads: int,
           head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None) -> HostGeometry:
        """The geometry of a host pool; a layout or shape kvxfer cannot address is refused, saying why."""
        layouts = MLA_LAYOUTS if mla else MHA_LAYOUTS
        if host_layout not in layouts:
            raise InvalidArgument(f"kvxfer serves SGLang {'MLA' if mla else 'MHA'} host pools in the layouts "
                                  f"{', '.join(layouts)}; --hicache-mem-layout {host_layout} is not one of them")
        if v_head_dim is not None and v_head_dim != head_dim:
            raise InvalidArgument(f"kvxfer serves SGLang host pools whose K and V have one head size; this one has "
                                  f"{head_dim} and {v_head_dim}")
        spec = KVSpec(num_layers=num_layers, num_blocks=num_pages, block_size=page_size,
                      num_kv_heads=1 if mla else num_heads, head_size=head_dim, dtype=dtype, kv_parts=1 if mla else 2)
        return cls(spec, Layout.parse(layouts[host_layout]), host_layout, mla)

    @property
    def shape(self) -> tuple[int, ...]:
        """The pool as a tensor of its six axes in memory order (a view of SGLang's buffer)."""
        return tuple(self.spec.axis_size(axis) for axis in self.layout.order)

    @property
    def page_axis(self) -> int:
        """Where the page (B) axis is in ``shape``."""
        return [axis.value for axis in self.layout.order].index("B")

    def with_pages(self, num_pages: int) -> HostGeometry:
        """The same page format with another number of pages (a staging area)."""
        s = self.spec
        spec = KVSpec(num_layers=s.num_layers, num_blocks=num_pages, block_size=s.block_size,
                      num_kv_heads=s.num_kv_heads, head_size=s.head_size, dtype=s.dtype, kv_parts=s.kv_parts)
        return HostGeometry(spec, self.layout, self.host_layout, self.mla)


@dataclass(frozen=True)
class RankShare:
    """Which part of the model this engine process holds (SGLang's HiCacheStorageConfig)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1


@dataclass(frozen=True)
class PageNames:
    """The names of one SGLang engine process's pools and pages at the daemon."""

    model: str
    geometry: HostGeometry
    share: RankShare
    group_prefix: str = ""  # the settings' cache_group: engines that share it share a host tier
    tenant: str = ""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process: its pools are its own

    @property
    def fingerprint(self) -> str:
        """Changes whenever a page's bytes would mean something else (not with the number of pages)."""
        g, s, r = self.geometry, self.geometry.spec, self.share
        tp = ("mla",) if g.mla else (r.tp_rank, r.tp_size)  # a latent is the same on every TP rank
        return digest("sglang", self.model, g.layout.spelled, s.num_layers, s.block_size, s.num_kv_heads,
                       s.head_size, dtype_name(s.dtype), *tp, r.pp_rank, r.pp_size, r.cp_rank, r.cp_size)

    @property
    def cache_group(self) -> str:
        """Stable across engine restarts; shared by replicas of the same model and share on one node."""
        return f"{safe_group_prefix(self.group_prefix, 'sglang')}-{self.fingerprint}"

    @property
    def namespace(self) -> str:
        tenant = digest(self.tenant) if self.tenant else "shared"
        return f"sglang:{self.fingerprint}:{tenant}"

    def pool_id(self, role: str) -> str:
        """``role``: "host" (SGLang's own host pool) or "staging" (kvxfer's copy area)."""
        return f"sglang-{self.instance[:12]}-r{self.share.tp_rank}-{role}"
