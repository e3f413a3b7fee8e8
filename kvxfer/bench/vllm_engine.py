"""vLLM's real scheduler and KV connector driven in one process, with a stand-in forward pass.

Used by the backend's tests and by ``kvxfer bench vllm``. Everything that decides what
is looked up, loaded, stored, recomputed or fenced is vLLM's own code (Scheduler,
the connector in both roles, allocate_kv_cache); only the model is replaced: its
"forward pass" writes, for every scheduled token, KV bytes that are a function of the
token's prefix (so a block's right content is known) and samples a token from it.

``runner="v1"`` calls the worker-side connector in the order of vLLM's KVConnectorModelRunnerMixin;
``runner="v2"`` through vLLM's own ActiveKVConnector, the V2 model runner's. ``async_scheduling=True``
runs vLLM's AsyncScheduler with a batch queue of two, as EngineCore.step_with_batch_queue does: a
step is scheduled before the previous step's output has reached the scheduler.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import json
from collections import deque
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.utils import allocate_kv_cache

from kvxfer.geometry.sharding import head_range

EOS = 2


@dataclass(frozen=True)
class Model:
    """A tiny Llama: its config.json is all vLLM needs (no weights are loaded); a weights file of
    ``weights_seed``'s bytes names the weights (kvxfer's model identity reads it)."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    latent: bool = False  # an MLA cache (one latent a token: num_kv_heads 1, head_size its width), no V
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: "fp8" (per-tensor scales), "fp8_per_token_head", ...
    head_size_v: int = 0  # V's head size where it differs from K's (0: the same)
    dtype: torch.dtype = torch.bfloat16
    weights_seed: int = 0

    def write_config(self, directory: Path) -> Path:
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": self.num_kv_heads * 2 * self.head_size, "intermediate_size": 128,
                  "num_attention_heads": self.num_kv_heads * 2, "num_key_value_heads": self.num_kv_heads,
                  "head_dim": self.head_size, "num_hidden_layers": self.num_layers, "vocab_size": 1000,
                  "max_position_embeddings": 1 << 16, "rms_norm_eps": 1e-5,
                  "torch_dtype": str(self.dtype).removeprefix("torch."), "bos_token_id": 1, "eos_token_id": EOS}
        (directory / "config.json").write_text(json.dumps(config))
        weights = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(
            self.weights_seed))
        (directory / "model.safetensors").write_bytes(weights.numpy().tobytes())
        return directory


def _cache_format(model: Model) -> dict:
    """The cache spec's dtype and quantisation, as vLLM's attention backends make them (Triton's
    per-token-head modes: each head's token cell is its K codes and fp32 scale, then V's)."""
    if model.kv_cache_dtype == "auto":
        return {"dtype": model.dtype, **({"head_size_v": model.head_size_v} if model.head_size_v else {})}
    mode = get_kv_quant_mode(model.kv_cache_dtype)
    if mode.is_per_token_head:
        return {"dtype": torch.uint8, "kv_quant_mode": mode, "state_content_bytes": 2 * model.head_size + 8}
    return {"dtype": torch.uint8, "kv_quant_mode": mode}


@dataclass
class StepReport:
    scheduled: dict[str, int]  # req id -> tokens computed this step
    external_hits: dict[str, int] = field(default_factory=dict)  # req id -> tokens to load
    loaded: set[str] = field(default_factory=set)  # requests whose loads finished this step
    load_errors: set[int] = field(default_factory=set)


def _token_of(kv: torch.Tensor) -> int:
    return 3 + zlib.crc32(kv.contiguous().numpy().tobytes()) % 900


def prefix_hashes(tokens: list[int]) -> list[int]:
    """A rolling hash of each token's prefix: the stand-in model's KV is a function of it."""
    return list(itertools.accumulate(tokens, lambda h, t: (h * 1000003 + t + 1) % (1 << 61),
                                     initial=1469598103934665603))[1:]


class Rank:
    """One worker: its connector (worker role), its KV cache and the KV heads it holds."""

    def __init__(self, config: VllmConfig, kv_cache_config, layout: str, layer_names: list[str], rank: int,
                 total_heads: int, tensor_parallel: int) -> None:
        self.connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
        context = self.connector.get_mem_pool_context() or contextlib.nullcontext()
        with context:  # what vLLM's Worker.initialize_from_config does
            kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
        self.connector.register_kv_caches(kv_caches)
        self.layers = [kv_caches[name].view(torch.uint8) for name in layer_names]  # [B, H, N, C bytes] each
        self.heads = slice(*head_range(total_heads, tensor_parallel, rank))  # replicated when ranks > heads
        # The V2 model runner's connector driver, as GPUModelRunner builds it (its __init__ would fetch
        # the process-wide connector and register the caches again).
        self.v2 = ActiveKVConnector.__new__(ActiveKVConnector)
        self.v2.vllm_config, self.v2.kv_connector = config, self.connector
        self.v2._pending_load_kwargs, self.v2._disabled = None, False


class Engine:
    """One engine: its scheduler and ``tensor_parallel`` workers in this process, the connector
    named by ``kv_transfer``."""

    def __init__(self, kv_transfer: KVTransferConfig, *, num_blocks: int, model: Model = Model(),
                 block_size: int = 16, max_batched_tokens: int = 8192, layout: str = "BLHNC",
                 tensor_parallel: int = 1, runner: str = "v1", async_scheduling: bool = False) -> None:
        if runner not in ("v1", "v2"):
            raise ValueError(f"runner: v1 or v2, got {runner!r}")
        self.model, self.block_size, self.runner = model, block_size, runner
        self._dir = tempfile.TemporaryDirectory(prefix="kvx-vllm-")
        kv_transfer.engine_id = kv_transfer.engine_id or uuid.uuid4().hex
        max_len = block_size * (num_blocks - 1)  # one request may fill the whole cache
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model.write_config(Path(self._dir.name))), dtype=model.dtype,
                                     seed=0, max_model_len=max_len, skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                     cache_dtype=model.kv_cache_dtype),
            scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_batched_tokens,
                                             max_model_len=max_len, is_encoder_decoder=False,
                                             async_scheduling=async_scheduling),
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel),
            kv_transfer_config=kv_transfer, device_config=DeviceConfig("cpu"))
        self.config.cache_config.kv_cache_layout = layout  # what the engine core resolves (BLHNC: the connector's)
        if model.latent and model.num_kv_heads != 1:
            raise ValueError("the stand-in MLA model has one latent head (on every rank)")
        heads = max(1, model.num_kv_heads // tensor_parallel)
        kind = MLAAttentionSpec if model.latent else FullAttentionSpec
        specs = {f"model.layers.{i}.self_attn.attn": kind(
            block_size=block_size, num_kv_heads=heads, head_size=model.head_size, **_cache_format(model))
            for i in range(model.num_layers)}
        page = next(iter(specs.values())).page_size_bytes * model.num_layers
        self.cell_bytes = page // (model.num_layers * heads * block_size)  # one head's token: its C bytes
        groups = get_global_kv_cache_groups(self.config, [specs])
        self.kv_cache_config = get_kv_cache_configs(self.config, [specs], [page * num_blocks], groups)[0]
        self.kv_cache_config.kv_cache_layout = layout
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._queue: deque = deque()  # async scheduling: (scheduler output, merged runner output, report)
        self._unseen: dict[str, list[int]] = {}  # req id -> tokens sampled in batches still queued
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=block_size, log_stats=True)
        self.ranks = []
        for rank in range(tensor_parallel):
            config = copy.deepcopy(self.config)
            config.parallel_config.rank = rank
            self.ranks.append(Rank(config, self.kv_cache_config, layout, list(specs), rank, model.num_kv_heads,
                                   tensor_parallel))
        # One rank of each set that holds the same heads: together, every head once.
        self.distinct = [r for i, r in enumerate(self.ranks) if r.heads not in [q.heads for q in self.ranks[:i]]]
        self.worker = self.ranks[0].connector
        handshake = {(0, i): m for i, r in enumerate(self.ranks) if (m := r.connector.get_handshake_metadata())}
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(handshake)  # as EngineCore does
        self._aggregator = KVOutputAggregator.from_connector(self.worker, tensor_parallel)
        self.finished: set[str] = set()
        self.block_tables: dict[str, list[int]] = {}  # req id -> its blocks when last computed
        self.outputs: dict[str, list[int]] = {}  # req id -> tokens it produced
        # As vLLM's EngineCore does once started: the start-up heap is marked static, so that collections of
        # the oldest generation skip it (the stand-in paid a 0.4 s pause on a first load that vLLM never does).
        freeze_gc_heap()

    # -- requests ---------------------------------------------------------------------
    def add(self, req_id: str, tokens: list[int], *, cache_salt: str | None = None, max_tokens: int = 1,
            kv_hints=None, **extra_args) -> None:
        """``kv_hints``: a router's ``KvHintsEnvelope``; ``extra_args``: kv_transfer_params, as vLLM's OpenAI API
        passes it."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None)
        self.scheduler.add_request(Request(req_id, tokens, params, None, cache_salt=cache_salt,
                                           block_hasher=self._hasher, kv_hints=kv_hints))

    def offload_keys(self, tokens: list[int], cache_salt: str | None = None) -> list[bytes]:
        """The keys vLLM's offloading scheduler gives the full blocks of a request with ``tokens``."""
        request = Request("keys", tokens, SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                          block_hasher=self._hasher)
        return [make_offload_key(h, 0) for h in request.block_hashes]

    def blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def block_bytes(self, blocks: list[int], rank: int | None = None) -> torch.Tensor:
        """The bytes of whole blocks [L, blocks, H, N, C bytes] over every layer and head (a copy),
        or over one rank's heads."""
        ranks = self.distinct if rank is None else [self.ranks[rank]]
        return torch.cat([torch.stack([layer[blocks] for layer in r.layers]) for r in ranks], dim=2)

    def expected_block_bytes(self, tokens: list[int], count: int) -> torch.Tensor:
        """What the first ``count`` blocks of a request with ``tokens`` must hold."""
        n = count * self.block_size
        payload = self._payload(prefix_hashes(tokens)[:n])  # [L, n, H, C]
        layers, _, heads, width = payload.shape
        blocks = payload.view(layers, count, self.block_size, heads, width).transpose(2, 3)
        return blocks.contiguous()

    def zero_kv(self) -> None:
        for rank in self.ranks:
            for layer in rank.layers:
                layer.zero_()

    def reset_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(reset_connector=True)

    # -- stepping ---------------------------------------------------------------------
    def step(self) -> StepReport:
        """One engine step: schedule, run every worker, hand the output to the scheduler (with
        asynchronous scheduling, the previous step's output, once two are queued)."""
        if self._queue and not self.scheduler.has_requests():  # nothing to schedule: the queued batch's output
            updated = self._update(*self._queue.popleft())
            return StepReport({}, {}, updated.loaded, updated.load_errors)
        output = self.scheduler.schedule()
        merged, report = self._execute(output)
        if not isinstance(self.scheduler, AsyncScheduler):
            return self._update(output, merged, report)
        # What was scheduled now, and what the batch whose output the scheduler takes now loaded.
        self._queue.append((output, merged, report))
        step = StepReport(report.scheduled, report.external_hits)
        if len(self._queue) >= 2 or output.total_num_scheduled_tokens == 0:
            updated = self._update(*self._queue.popleft())
            step.loaded, step.load_errors = updated.loaded, updated.load_errors
        return step

    def _execute(self, output) -> tuple[ModelRunnerOutput, StepReport]:
        """Every worker's execute_model for one scheduled batch, and their merged output."""
        report = StepReport(dict(output.num_scheduled_tokens))
        meta = output.kv_connector_metadata
        for job in getattr(meta, "load_jobs", {}).values():
            report.external_hits[job.req_id] = len(job.dst_spec.block_ids) * self.block_size
        positions = self._positions(output.num_scheduled_tokens)
        v2 = self.runner == "v2"
        for rank in self.ranks:  # every worker's forward pass writes its heads ...
            rank.v2.pre_forward(output) if v2 else self._before_forward(rank, output)
            self._forward(rank, positions)
        sampled = self._sample(positions)  # ... and attention reads them all
        for req_id, tokens in sampled.items():
            self._unseen.setdefault(req_id, []).extend(tokens)
        after = self._after_forward_v2 if v2 else self._after_forward
        runner_outputs = [after(rank, output, sampled) for rank in self.ranks]
        for runner_output in runner_outputs:
            report.load_errors |= runner_output.kv_connector_output.invalid_block_ids or set()
        merged = self._aggregator.aggregate(runner_outputs)
        report.loaded = set(merged.kv_connector_output.finished_recving or ())
        return merged, report

    def _update(self, output, merged: ModelRunnerOutput, report: StepReport) -> StepReport:
        """The scheduler takes a batch's output (vLLM's update_from_output)."""
        for req_id, tokens in zip(merged.req_ids, merged.sampled_token_ids):
            unseen = self._unseen.get(req_id, [])
            del unseen[:len(tokens)]
        for outputs in self.scheduler.update_from_output(output, merged).values():
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    self.finished.add(out.request_id)
        return report

    @staticmethod
    def _before_forward(rank: Rank, output) -> None:
        """A worker's execute_model up to the forward pass (vLLM's KVConnectorModelRunnerMixin order)."""
        rank.connector.handle_preemptions(output.kv_connector_metadata)
        rank.connector.bind_connector_metadata(output.kv_connector_metadata)
        if output.has_sync_kv_loads:
            rank.connector.start_load_kv(None)

    @staticmethod
    def _after_forward(rank: Rank, output, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
        connector = rank.connector
        if not output.has_sync_kv_loads:
            connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(output.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                                 kv_connector_output=connector_output)

    def _after_forward_v2(self, rank: Rank, output, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
        """The V2 model runner's: ActiveKVConnector.finish_forward and post_forward."""
        rank.v2.finish_forward()
        connector_output = rank.v2.post_forward(output.finished_req_ids)
        req_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                                 kv_connector_output=connector_output)

    def busy(self) -> bool:
        """What makes vLLM's engine loop step: requests, queued batches, or stores of finished requests
        still in flight."""
        connector = self.scheduler.connector
        return (self.scheduler.has_requests() or bool(self._queue)
                or bool(connector and connector.has_pending_push_work()))

    def run(self, req_ids: set[str], max_steps: int = 2000, idle_sleep_s: float = 0.001) -> list[StepReport]:
        """Step until every named request finished and, like vLLM's engine loop, until idle."""
        reports = []
        for _ in range(max_steps):
            if req_ids <= self.finished and not self.busy():
                return reports
            reports.append(self.step())
            if not reports[-1].scheduled:
                time.sleep(idle_sleep_s)  # waiting on transfers, not on compute
        raise AssertionError(f"not done in {max_steps} steps: unfinished {sorted(req_ids - self.finished)}")

    def _positions(self, scheduled: dict[str, int]) -> dict[str, torch.Tensor]:
        """The token positions each request computes this step (and the blocks they land in)."""
        positions = {}
        for req_id, count in scheduled.items():
            end = self.scheduler.requests[req_id].num_computed_tokens  # schedule() counted this step already
            positions[req_id] = torch.arange(end - count, end)
            self.block_tables[req_id] = self.blocks(req_id)
        return positions

    def _forward(self, rank: Rank, positions: dict[str, torch.Tensor]) -> None:
        """Write the KV of the scheduled tokens (this rank's heads)."""
        for req_id, where in positions.items():
            tokens = list(self.scheduler.requests[req_id].all_token_ids)[:int(where[-1]) + 1]
            # Asynchronous scheduling may run a position whose input token the scheduler has not seen
            # (sampled by a batch still queued): on a GPU it comes from the device; its KV is redone
            # if that batch's output is discarded.
            tokens += self._unseen.get(req_id, [])[:int(where[-1]) + 1 - len(tokens)]
            tokens += [0] * (int(where[-1]) + 1 - len(tokens))
            payload = self._payload(prefix_hashes(tokens)[int(where[0]):])[:, :, rank.heads]  # [L, n, H, C bytes]
            blocks = torch.tensor(self.block_tables[req_id])[where // self.block_size]
            for layer, values in zip(rank.layers, payload):
                layer[blocks, :, where % self.block_size, :] = values

    def _sample(self, positions: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        """One token for each request whose known tokens are all computed now."""
        sampled = {}
        for req_id, where in positions.items():
            num_tokens = self.scheduler.requests[req_id].num_tokens
            if int(where[-1]) + 1 >= num_tokens:
                sampled[req_id] = [self._attend(req_id, num_tokens)]
        return sampled

    def _attend(self, req_id: str, num_tokens: int) -> int:
        """The next token, from the KV of every prior token as the caches hold it: wrong KV, wrong token."""
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(self.block_tables[req_id])[positions // self.block_size]
        kv = torch.cat([torch.stack([layer[blocks, :, positions % self.block_size, :] for layer in rank.layers])
                        for rank in self.distinct], dim=2)
        return _token_of(kv)

    def expected_token(self, tokens: list[int]) -> int:
        """The token a request with ``tokens`` must produce when its KV is right."""
        return _token_of(self._payload(prefix_hashes(tokens)))

    def _payload(self, hashes: list[int]) -> torch.Tensor:
        """KV bytes [L, tokens, H, C bytes] of tokens whose prefixes hash to ``hashes``."""
        heads = self.model.num_kv_heads
        width = self.cell_bytes  # K and V (and their scales), or the latent
        h = (torch.tensor(hashes, dtype=torch.int64) >> 3).remainder(251).to(torch.int16).view(1, -1, 1, 1)
        layer = (torch.arange(self.model.num_layers) * 7919).remainder(251).to(torch.int16).view(-1, 1, 1, 1)
        cell = (torch.arange(heads * width) * 131).remainder(251).to(torch.int16).view(1, 1, heads, width)
        return (h + layer + cell).remainder(251).to(torch.uint8)

    def close(self) -> None:
        for rank in self.ranks:
            rank.connector.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        self._dir.cleanup()
        gc.unfreeze()  # as EngineCore's shutdown: what it held may be collected again
