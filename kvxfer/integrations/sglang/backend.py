"""kvxfer as SGLang HiCache's storage backend (L3), loaded by SGLang's factory for out-of-tree backends.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvxfer", "module_path":
        "kvxfer.integrations.sglang", "class_name": "KvxferStore", "interface_v1": 1,
        "allocator": "shm", "socket": "/run/kvxfer/kvxfer.sock"}'

``interface_v1`` has SGLang pass host page indices (the zero-copy interface);
``allocator: shm`` has it allocate its host pool in a memfd, which the daemon then reads
and writes in place (docs/sglang.md). Page keys are SGLang's chained page hashes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo,
                                                  PoolName, PoolTransfer, PoolTransferResult)

from kvxfer.client import PoolLayout
from kvxfer.integrations.identity import weights_identity
from kvxfer.integrations.settings import parse_settings
from kvxfer.integrations.sglang.naming import HostGeometry, PageNames, RankShare
from kvxfer.integrations.sglang.pages import PageMover, Settings

log = logging.getLogger("kvxfer.sglang")
#: SGLang's own keys in the same extra config (its prefetch knobs, which it usually takes out first, and
#: the path it adds for ``--file-storage-path``).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size",
                         "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys", "file_storage_path"})


#: Batches remembered between two of SGLang's metric reads (it reads every scheduler step; bounded anyway).
METRIC_BATCHES = 4096


class BatchMetrics:
    """Pages and GB/s of every batch loaded and stored, for SGLang's own storage metrics
    (``--enable-storage-metrics``: its prefetch and backup page and bandwidth histograms)."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self._lock = threading.Lock()  # the prefetch and backup threads record, the scheduler takes
        self._batches = {kind: deque(maxlen=METRIC_BATCHES) for kind in ("prefetch", "backup")}

    def record(self, kind: str, answers: list[bool], started: float) -> list[bool]:
        pages, seconds = sum(answers), time.perf_counter() - started
        if pages and seconds > 0:
            with self._lock:
                self._batches[kind].append((pages, pages * self.page_bytes / seconds / 1e9))
        return answers

    def take(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            for kind, pages, bandwidth in (("prefetch", metrics.prefetch_pgs, metrics.prefetch_bandwidth),
                                           ("backup", metrics.backup_pgs, metrics.backup_bandwidth)):
                for n, gbps in self._batches[kind]:
                    pages.append(n)
                    bandwidth.append(gbps)
                self._batches[kind].clear()
        return metrics


def host_geometry(host_pool: Any) -> HostGeometry:
    """The geometry of SGLang's host KV pool (MHA or MLA, one allocation)."""
    mla = hasattr(host_pool, "kv_cache_dim")
    heads = 1 if mla else host_pool.head_num
    head_dim = host_pool.kv_cache_dim if mla else host_pool.head_dim
    return HostGeometry.of(mla=mla, host_layout=host_pool.layout, num_layers=host_pool.layer_num,
                           num_pages=host_pool.page_num, page_size=host_pool.page_size, num_heads=heads,
                           head_dim=head_dim, dtype=host_pool.dtype, v_head_dim=getattr(host_pool, "v_head_dim", None))


def model_identity(model_name: str | None, host_pool: Any, model_id: str = "") -> str:
    """The model in the namespace: ``model_id`` if set, else the weights SGLang serves (a local directory by
    content, a hub name as itself), tagged with the host pool's own page format when it has one."""
    tag = getattr(host_pool, "storage_format_tag", None)
    path = model_name or ""
    if tag and path.endswith(f"-{tag}"):  # SGLang's storage_model_name() appended it
        path = path[:-len(tag) - 1]
    if not (model_id or path):
        raise ValueError("kvxfer: SGLang gave no model name; set model_id in the extra config")
    weights = f"id:{model_id}" if model_id else weights_identity(path, None)
    return f"{weights}|{tag or 'plain'}"


def shared_fd(host_pool: Any) -> int | None:
    """The memfd SGLang allocated the host pool in, when it is one allocation in one (``allocator: shm``)."""
    fds = getattr(host_pool.allocator, "fds", None)
    return fds[0] if fds and len(fds) == 1 else None


class KvxferStore(HiCacheStorage):
    """HiCache pages stored by the node's kvxfer daemon: checksummed, shared by replicas, kept across restarts."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.settings = parse_settings(Settings, extra, where="hicache-storage-backend-extra-config",
                                       foreign=SGLANG_KEYS, engine="SGLang's HiCache")
        self.config = storage_config
        self.share = RankShare(storage_config.tp_rank, storage_config.tp_size, storage_config.pp_rank,
                               storage_config.pp_size, storage_config.attn_cp_rank, storage_config.attn_cp_size)
        # An MLA latent is the same on every TP rank: one rank writes it (SGLang's own rule).
        self.writer = storage_config.is_storage_writer
        self.mover: PageMover | None = None
        self.metrics: BatchMetrics | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        geometry = host_geometry(mem_pool_host)
        model = model_identity(self.config.model_name, mem_pool_host, self.settings.model_id)
        names = PageNames(model, geometry, self.share, self.settings.cache_group, self.settings.tenant)
        fd = shared_fd(mem_pool_host)
        if not self.config.extra_config or not self.config.extra_config.get("interface_v1"):
            log.warning("kvxfer: SGLang hands pages over as tensors (\"interface_v1\": 1 in the extra config "
                        "passes host pages, which the daemon moves with one copy fewer)")
        if fd is None:
            log.info("kvxfer: SGLang's host pool is private memory; pages move through a staging area "
                     "(\"allocator\": \"shm\" in the extra config lets the daemon read them in place)")
        self.mover = PageMover(names, self.settings, mem_pool_host.kv_buffer, fd)
        self.metrics = BatchMetrics(PoolLayout(geometry.spec, geometry.layout).block_bytes)
        log.info("kvxfer: HiCache rank %d stores %s pages (%s) in namespace %s of cache group %s",
                 self.share.tp_rank, geometry.host_layout, "zero copy" if fd is not None else "staged",
                 names.namespace, names.cache_group)

    # -- the zero-copy interface (interface_v1) --------------------------------------
    def _pages(self, keys: List[str], host_indices: torch.Tensor) -> list[int] | None:
        size = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * size:
            log.error("kvxfer: %d host indices for %d pages of %d tokens", host_indices.numel(), len(keys), size)
            return None
        starts = host_indices[::size]
        if bool((starts % size).any()):  # a page's tokens are one host page, from its first token
            log.error("kvxfer: host indices that do not start pages of %d tokens", size)
            return None
        return (starts // size).tolist()

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        if not self.writer:
            return [True] * len(keys)
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = None if prefix is None else (prefix[-1].encode() if prefix else b"")
        started = time.perf_counter()
        return self.metrics.record("backup", self.mover.store(_keys(keys), pages, parent), started)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        started = time.perf_counter()
        return self.metrics.record("prefetch", self.mover.load(_keys(keys), pages), started)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self.mover.exists(_keys(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the per-pool interface (KV pages only) ---------------------------------------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        if pool_transfers:  # pools beside the KV pages (Mamba, SWA, ...) are not stored here: no hit
            return PoolTransferResult.empty()
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {PoolName.KV: hits} if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {t.name: (self.batch_get_v1(t.keys or [], t.host_indices) if t.name == PoolName.KV
                         else [False] * len(t.keys or [])) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {t.name: (self.batch_set_v1(t.keys or [], t.host_indices) if t.name == PoolName.KV
                         else [False] * len(t.keys or [])) for t in transfers}

    # -- the generic interface (pages as tensors) -------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        targets = target_locations or [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        started = time.perf_counter()
        answers = self.metrics.record("prefetch", self.mover.load_tensors(_keys(keys), targets), started)
        return [t if ok else None for t, ok in zip(targets, answers)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if not self.writer:
            return True
        started = time.perf_counter()
        return all(self.metrics.record("backup", self.mover.store_tensors(_keys(keys), values), started))

    def get_stats(self) -> Any:
        """Pages and GB/s of each batch since the last call, measured here (SGLang's storage metrics)."""
        return self.metrics.take() if self.metrics is not None else None

    def clear(self) -> None:
        log.info("kvxfer: clear() leaves the daemon's pages, shared with other replicas, in place")

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()


def _keys(keys: List[str]) -> list[bytes]:
    return [k.encode() for k in keys]
