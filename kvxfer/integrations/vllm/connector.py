"""``KvxferConnector``: vLLM's OffloadingConnector with kvxfer as its offloading backend.

Enable it with one ``--kv-transfer-config`` (docs/vllm.md). It reuses vLLM's own
offloading scheduler and worker logic whole and adds the three things an
``OffloadingSpec`` alone cannot do:

- the geometry and layout of the KV cache (for the pool and the namespaces), which
  vLLM's OffloadingConfig leaves out;
- ``get_mem_pool_context()``: vLLM's KV cache allocated in shared memory, so that the
  daemon serves it with zero copy (on a GPU, CUDA IPC needs no such context);
- per-block load failures (``get_block_ids_with_load_errors``), so that vLLM recomputes
  exactly the blocks that did not come back, and the tenant (``cache_salt``) in the
  namespace.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import vllm
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVQuantMode, MLAAttentionSpec
from vllm.v1.request import Request

from kvxfer.client import KVSpec
from kvxfer.core.errors import KvxferError
from kvxfer.integrations import identity
from kvxfer.integrations.vllm import SUPPORTED_VLLM
from kvxfer.integrations.vllm.manager import KvxferManager
from kvxfer.integrations.vllm.naming import EngineNames, kvxfer_layout
from kvxfer.integrations.vllm.scheduler_hints import prompt_keys
from kvxfer.integrations.vllm.spec import KvxferOffloadingSpec, Settings


def engine_names(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineNames:
    """The engine's pool geometry and names; a cache kvxfer cannot describe stops vLLM here."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("kvxfer serves models with one group of full-attention layers; this model has "
                         f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    spec = groups[0].kv_cache_spec
    latent = isinstance(spec, MLAAttentionSpec)  # one latent vector a token, no V (DeepSeek's MLA)
    if latent and (spec.cache_dtype_str not in (None, "auto") or spec.alignment or spec.topk_buffer_width
                   or spec.model_version):
        raise ValueError("kvxfer serves MLA caches of plain latents; this one is quantised, padded or sparse "
                         f"({spec.cache_dtype_str or spec.model_version or 'sparse'})")
    if spec.sliding_window is not None:
        raise ValueError("kvxfer needs full attention without a sliding window")
    kv_parts, head_size, dtype, kv_format = kv_element(spec, latent, vllm_config.cache_config.cache_dtype)
    tensors = kv_cache_config.kv_cache_tensors
    if len(tensors) > 1:
        raise ValueError(f"kvxfer serves one KV allocation per rank; vLLM planned {len(tensors)}")
    num_layers = len(tensors[0].layers) if tensors else len(groups[0].layer_names)
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    if layout is None:
        raise ValueError("kvxfer: vLLM's KV-cache layout is not resolved yet")
    transfer = vllm_config.kv_transfer_config
    settings = Settings.parse(transfer.kv_connector_extra_config)
    parallel = vllm_config.parallel_config
    kv = KVSpec(num_layers, kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, head_size, dtype,
                kv_parts=kv_parts)
    # Canonical blocks (shared across TP sizes and layouts) where every rank holds every layer and token of
    # its heads: no pipeline parallelism (its stages hold different layers), no context parallelism (its
    # ranks hold different tokens).
    canonical = (parallel.world_size == parallel.tensor_parallel_size
                 and getattr(parallel, "decode_context_parallel_size", 1) == 1
                 and getattr(parallel, "prefill_context_parallel_size", 1) == 1)
    total = (1 if latent else vllm_config.model_config.get_total_num_kv_heads()) if canonical else 0
    names = EngineNames(engine_id=transfer.engine_id or "", model=model_identity(vllm_config, settings), spec=kv,
                        layout=kvxfer_layout(layout), world_size=parallel.world_size,
                        group_prefix=settings.cache_group, total_kv_heads=total, kv_format=kv_format)
    try:  # a split kvxfer cannot store canonically stops vLLM here, with the reason
        sharding = names.sharding(0)
        if sharding is not None:
            sharding.check(kv)
    except KvxferError as exc:
        raise ValueError(f"kvxfer: {exc}") from None
    return names


def kv_element(spec: FullAttentionSpec, latent: bool, cache_dtype: str) -> tuple[int, int, torch.dtype, str]:
    """(kv_parts, head_size, dtype, kv_format) of a KV cache's elements as kvxfer stores them. A cell kvxfer
    does not split into K and V is one part: K and V of different widths (K's, then V's elements), or a
    per-token-head quantised cache's K codes and fp32 scale then V's (one part of that many bytes, whose
    scales travel with their head, so a TP split of the heads keeps them)."""
    mode = spec.kv_quant_mode
    if mode is KVQuantMode.NONE:
        if not latent and spec.head_size_v != spec.head_size:  # K then V in each cell, of their own widths
            return 1, spec.head_size + spec.head_size_v, spec.dtype, f"k{spec.head_size}v{spec.head_size_v}"
        return (1 if latent else 2), spec.head_size, spec.dtype, ""
    if not latent and mode is KVQuantMode.FP8_PER_TENSOR and spec.head_size_v == spec.head_size:
        return 2, spec.head_size, spec.dtype, f"{cache_dtype}:per_tensor"  # the scales are the weights'
    if not latent and mode in INLINE_SCALES and spec.state_content_bytes and spec.page_size_padded is None:
        return 1, spec.state_content_size_bytes, torch.uint8, \
            f"{mode.name.lower()}:k{spec.head_size}v{spec.head_size_v}:inline_f32"
    raise ValueError(f"kvxfer stores plain, FP8 per-tensor and FP8/INT8 per-token-head KV caches; this one is "
                     f"{mode.name.lower()}{' (MLA)' if latent else ''}")


#: Per-token-head quantisation whose scales vLLM packs inline after each head's codes.
INLINE_SCALES = frozenset({KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD})


def check_version(version: str) -> bool:
    """Whether this vLLM release is one the backend is tested with; a warning names the others."""
    release = ".".join(version.split(".")[:2])
    if release in SUPPORTED_VLLM:
        return True
    logging.getLogger("kvxfer.vllm").warning("kvxfer: vLLM %s is untested with this backend (tested: %s)", version,
                                             ", ".join(SUPPORTED_VLLM))
    return False


def model_identity(vllm_config: VllmConfig, settings: Settings) -> str:
    """The weights (by content, or ``model_id``), the architecture and the precision: replicas
    loading the same weights from different paths share blocks; other weights never match."""
    model = vllm_config.model_config
    return identity.model_identity(model.model, model.revision, model.hf_config.to_dict(), model.dtype,
                                   model.quantization, settings.model_id)


@dataclass
class KvxferRegistration(KVConnectorHandshakeMetadata):
    """A worker's pool and the registration token it chose, for the scheduler (vLLM's handshake metadata)."""

    pool_id: str
    token: bytes


class KvxferConnector(OffloadingConnector):
    """vLLM's offloading connector, backed by the kvxfer sidecar."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # OffloadingConnector.__init__, with the spec built here: it needs the geometry.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        check_version(vllm.__version__)
        if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
            raise ValueError('kvxfer: set "kv_load_failure_policy": "recompute" in --kv-transfer-config, so '
                             "that a block the daemon cannot return is recomputed instead of failing the request")
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        self.spec = KvxferOffloadingSpec(offloading_config, engine_names(vllm_config, kv_cache_config))
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(self.spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = OffloadingConnectorWorker(self.spec, vllm_config, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "BLHNC"  # one contiguous span per block: one copy per block, whatever the layer count

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        if self.connector_worker is None or self._vllm_config.device_config.device_type != "cpu":
            return None  # on a GPU the daemon opens vLLM's own allocation through CUDA IPC
        return self.spec.allocation

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        # A step that runs no forward pass (every request waits on transfers): the workers may wait a moment
        # for the daemon's answer instead of returning to an engine loop that would only spin.
        meta.kvxfer_idle = scheduler_output.total_num_scheduled_tokens == 0
        meta.kvxfer_hints = self.scheduler.manager.take_hint_calls()  # rank 0's worker sends them
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.spec.idle_step(getattr(connector_metadata, "kvxfer_idle", False))
        self.spec.send_hints(getattr(connector_metadata, "kvxfer_hints", []))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.connector_worker is None:
            return None
        return KvxferRegistration(self.spec.names.pool_id(self.spec.rank), self.spec.token)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every worker's registration, collected by vLLM once its KV caches are registered: the scheduler
        presents their tokens with its Lookups (a private group answers its registrant only)."""
        if self.connector_scheduler is not None:
            manager = self.scheduler.manager
            assert isinstance(manager, KvxferManager)
            manager.present({m.pool_id: m.token for m in metadata.values() if isinstance(m, KvxferRegistration)})

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.spec.take_load_errors()

    def on_new_request(self, request: Request) -> None:
        manager = self.scheduler.manager
        assert isinstance(manager, KvxferManager)
        manager.set_tenant(request.request_id, request.cache_salt)
        manager.track(request)
        super().on_new_request(request)
        manager.prefetch_request(request.request_id, prompt_keys(request.block_hashes, self.scheduler.config))

