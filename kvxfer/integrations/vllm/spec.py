"""kvxfer as a vLLM ``OffloadingSpec``: vLLM's offloading scheduler logic, kvxfer's tiers and copies.

The settings come from ``kv_connector_extra_config`` and are validated here: a wrong
value stops vLLM at start-up with a message that names it, never later.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from kvxfer.client import PoolLayout
from kvxfer.core.errors import KvxferError
from kvxfer.integrations.settings import daemon_token, group_token, parse_settings
from kvxfer.integrations.sidecar_link import DaemonLink, LinkDown
from kvxfer.integrations.vllm.allocation import SharedKVAllocation
from kvxfer.integrations.vllm.manager import KvxferManager
from kvxfer.integrations.vllm.naming import EngineNames
from kvxfer.integrations.vllm.registration import check_memory, register_rank
from kvxfer.integrations.vllm.worker import KvxferWorker, cuda_ready_event, no_event

log = logging.getLogger("kvxfer.vllm")
#: vLLM's own keys in the same extra config that apply whatever the offloading backend (its CPU
#: backend's keys, cpu_bytes_to_use and the like, would do nothing here: they are refused too).
VLLM_KEYS = frozenset({"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
                       "offload_prompt_only", "self_describing_kv_events", "sync_load_budget_bytes"})


@dataclass(frozen=True)
class Settings:
    """The backend's knobs (``kv_connector_extra_config``), with their defaults."""

    socket: str = "/tmp/kvxfer.sock"  # the sidecar's gRPC socket; its descriptor socket is <socket>.fd
    timeout_s: float = 1.0  # deadline of every call (submits, polls, lookups)
    retry_s: float = 2.0  # after a failure, no call to the daemon for this long
    lease_s: float = 30.0  # the daemon cancels a job whose engine went silent this long
    deadline_s: float = 5.0  # a transfer moves its blocks within this long, or fails (loads are recomputed)
    idle_wait_s: float = 0.002  # a step that runs no forward pass waits this long for a transfer to finish
    cache_group: str = ""  # prefix of the cache groups; engines that share it share a host tier
    model_id: str = ""  # the weights' identity (default: from their bytes, or the hub name and revision)
    forget_on_reset: bool = False  # reset_prefix_cache (a weight update in place) stops serving older blocks
    share_events: bool = True  # routers (WatchEvents, the ZeroMQ publisher) see the blocks' keys
    share_with_peers: bool = False  # other nodes' daemons may read and push this engine's cache groups
    daemon_token_file: str = ""  # the daemon's own token (token_file), where it has a TCP listener (peering)
    token_file: str = ""  # the private groups' token: engines given the same file share them on shared tiers
    lane: bool = True  # submits and lookups over the daemon's local lane (kvxfer.client.lane_client); False: gRPC only
    prefetch: bool = True  # a request joining the queue has its blocks brought up to host memory while it waits
    hint_max_ttl_s: int = 3600  # a router's kv.retain TTL for the blocks a request stores, at most (hints.max_ttl_s)

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> Settings:
        return parse_settings(cls, extra, where="kv_connector_extra_config", foreign=VLLM_KEYS,
                              engine="vLLM's offloading connector")

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"


class KvxferOffloadingSpec(OffloadingSpec):
    """Built by ``KvxferConnector``, which knows the geometry vLLM's OffloadingConfig leaves out."""

    def __init__(self, config: OffloadingConfig, names: EngineNames) -> None:
        super().__init__(config)
        self.settings = Settings.parse(dict(self.extra_config))
        if self.blocks_per_chunk != 1:  # the worker pairs GPU blocks with keys one to one
            raise ValueError(f"kvxfer stores one GPU block under each key; kv_connector_extra_config's block_size "
                             f"or blocks_per_chunk groups {self.blocks_per_chunk} under one: remove them (or set "
                             "blocks_per_chunk: 1)")
        self.names = names
        self.rank = config.parallel.rank
        self.allocation = SharedKVAllocation(names.pool_id(self.rank))
        self.worker: KvxferWorker | None = None
        #: the worker's registration token, chosen here so that it outlives a daemon's restart: vLLM hands it to
        #: the scheduler (``KvxferConnector.get_handshake_metadata``), whose Lookups of a private group need it.
        #: From ``token_file``, the same for every engine given that file: their private groups then reach each
        #: other's blocks on the tiers other nodes read (else those blocks are this engine's alone)
        self.token = group_token("kv_connector_extra_config.token_file", self.settings.token_file) \
            if self.settings.token_file else secrets.token_bytes(32)
        self.daemon_token = daemon_token("kv_connector_extra_config.daemon_token_file", self.settings.daemon_token_file)

    def get_manager(self) -> OffloadingManager:
        link = DaemonLink(self.settings.target, timeout_s=self.settings.timeout_s, retry_s=self.settings.retry_s,
                          role="scheduler", lane=self.settings.lane, token=self.daemon_token)
        shared = self.names.namespace(None)
        log.info("kvxfer: this engine's blocks are stored in namespace %s (a request with a cache_salt: %s:<its "
                 "digest>), cache group %s; watch them with: kvxfer events --namespace %s", shared,
                 shared.rsplit(":", 1)[0], self.names.cache_group(self.rank), shared)
        return KvxferManager(link, self.names, self.settings.forget_on_reset, self.settings.prefetch,
                             self.settings.hint_max_ttl_s)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        kv = kv_caches.tensors[0].tensor
        expected = PoolLayout(self.names.spec, self.names.layout)
        check_memory(kv, expected, self.allocation)  # a mismatch stops vLLM here, with the reason
        pool_id = self.names.pool_id(self.rank)

        def on_connect(client) -> None:
            register_rank(client, self.names, self.rank, kv, self.allocation, self.settings.share_events,
                          self.settings.share_with_peers, self.token)

        link = DaemonLink(self.settings.target, timeout_s=self.settings.timeout_s, retry_s=self.settings.retry_s,
                          role=f"worker rank {self.rank}", on_connect=on_connect, lane=self.settings.lane,
                          token=self.daemon_token)
        log.info("kvxfer: rank %d serves its KV cache (%d blocks of %d bytes, %s) as pool %s",
                 self.rank, self.names.spec.num_blocks, expected.block_bytes, self.names.layout.spelled, pool_id)
        ready = cuda_ready_event(kv.device) if kv.device.type == "cuda" else no_event
        self.worker = KvxferWorker(link, pool_id, lease_s=self.settings.lease_s,
                                    deadline_s=self.settings.deadline_s, ready_event=ready,
                                    idle_wait_s=self.settings.idle_wait_s)
        try:
            link.call(lambda client: None)  # register now if the daemon is up; later otherwise
        except LinkDown:  # vLLM starts anyway and registers when the daemon is there (the link said why)
            pass
        except KvxferError as exc:
            log.warning("kvxfer: rank %d not registered yet: %s", self.rank, exc)
        return self.worker

    def idle_step(self, idle: bool) -> None:
        """Whether the step under way runs a forward pass (the scheduler's metadata says)."""
        if self.worker is not None:
            self.worker.idle_step = idle

    def send_hints(self, calls: list) -> None:
        """The scheduler's hints of this step (``kvxfer.integrations.vllm.scheduler_hints``): rank 0 sends them."""
        if calls and self.worker is not None and self.rank == 0:
            self.worker.send_hints(calls)

    def take_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()
