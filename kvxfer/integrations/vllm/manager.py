"""The scheduler side: which blocks the daemon holds, asked in one Lookup per request.

vLLM's offloading scheduler asks ``lookup`` one key at a time. The first time it asks
about a request, this manager answers RETRY for each key (the scheduler goes on asking
until a miss, so it names them all) and sends one Lookup for all of them, across every
rank's pool, at the end of the scheduling step; from the next step on the answers are
known. A block counts only if every rank holds it (the daemon takes that minimum). No
state about blocks is kept here: the daemon's tiers are the truth, a load of a block
evicted meanwhile fails per block and vLLM recomputes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
from vllm.v1.kv_offload.base import (LoadStoreSpec, LookupResult, OffloadingManager, OffloadKey, PrepareStoreOutput,
                                     ReqContext, RequestOffloadingContext, ScheduleEndContext, get_offload_block_hash)
from vllm.v1.request import RequestStatus

from kvxfer.client import ExtraKeys
from kvxfer.core.envelope import store_hint as envelope_store_hint
from kvxfer.core.errors import InvalidArgument, KvxferError
from kvxfer.core.records import HintAction
from kvxfer.core.validate import checked_extra_keys
from kvxfer.integrations.sidecar_link import DaemonLink, LinkDown
from kvxfer.integrations.vllm.naming import EngineNames
from kvxfer.integrations.vllm.scheduler_hints import (HintCall, envelope_builtins, envelope_of, envelope_parts,
                                                      request_id, store_hint)

log = logging.getLogger("kvxfer.vllm")
WARN_EVERY_S = 60.0  # a warning about kv_hints not sent, at most this often


class KvxferBlocks(LoadStoreSpec):
    """Blocks at the daemon: their keys, inside the request's namespace. A store also says what a router
    needs to recompute each key's block hash (``describe``): the blocks' tokens in order (``block_size`` a
    key) and the hash of the block before the first (empty for a request's first block); no tokens: not
    known."""

    def __init__(self, keys: list[OffloadKey], namespace: str, token_ids: Sequence[int] = (),
                 parent: bytes = b"", block_size: int = 0, extra_keys: tuple[ExtraKeys, ...] = (),
                 lora_name: str = "", lora_id: int = 0) -> None:
        self.hint: tuple[HintAction, int] | None = None  # a store's hint (the request's kv_transfer_params)
        self.keys = keys
        self.namespace = namespace
        self.token_ids = token_ids
        self.parent = parent
        self.block_size = block_size
        self.extra_keys = extra_keys  # one a key, as vLLM's events publish them (empty: none in any)
        self.lora_name = lora_name
        self.lora_id = lora_id

    def __repr__(self) -> str:
        return f"KvxferBlocks({len(self.keys)} keys in {self.namespace})"


class KvxferManager(OffloadingManager):
    """Answers vLLM's offloading scheduler from the daemon; keeps no copy of its index."""

    def __init__(self, link: DaemonLink, names: EngineNames, forget_on_reset: bool = False,
                 prefetch: bool = True, hint_max_ttl_s: int = 3600) -> None:
        """``forget_on_reset``: a reset of vLLM's prefix cache (after a weight update in place) starts a
        new generation of namespaces, so that no block stored before it is served again. ``prefetch``: new
        requests' blocks are prefetched while they wait (``kvxfer.integrations.vllm.scheduler_hints``).
        ``hint_max_ttl_s``: a router's kv.retain of a request's blocks is their stores' hint up to this TTL."""
        self._link = link
        self._names = names
        self._forget_on_reset = forget_on_reset
        self.generation = 0
        self._pool_ids = names.pool_ids()
        self._tokens: dict[str, bytes] = {}  # pool id -> the registration token its worker chose (``present``)
        self._salts: dict[str, str | None] = {}  # req id -> cache_salt (set by the connector)
        self._requests: dict[str, Any] = {}  # req id -> vLLM's Request (its tokens and block hashes)
        self._answers: dict[str, dict[OffloadKey, bool]] = {}  # req id -> key -> present
        self._asked: dict[str, dict[OffloadKey, None]] = {}  # req id -> keys to look up this step, in order
        self.lookups = 0
        self.prefetch = prefetch
        self._store_hints: dict[str, tuple[HintAction, int]] = {}  # req id -> its stores' hint
        self._prefetching: set[str] = set()  # req ids whose prefetch may still be queued at the daemon
        self._hint_calls: list[HintCall] = []  # for the workers, with this step's metadata
        self._hint_max_ttl_s = hint_max_ttl_s
        self._envelopes: dict[str, tuple[bytes | None, bytes | None]] = {}  # req id -> its kv_hints, until its keys
        self._at_end: dict[str, HintCall] = {}  # req id -> the part of its kv_hints sent when it ends
        self.envelopes_dropped = 0  # kv_hints that could not be sent (not JSON, too large)
        self._warned_at = float("-inf")

    def set_tenant(self, req_id: str, cache_salt: str | None) -> None:
        self._salts[req_id] = cache_salt

    def track(self, request: Any) -> None:
        """Keep a new request's tokens and block hashes at hand until it finishes (``describe``)."""
        self._requests[request.request_id] = request

    def namespace(self, req_context: ReqContext) -> str:
        return self._names.namespace(self._salts.get(req_context.req_id), self.generation)

    # -- lookups -------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        answers = self._answers.get(req_context.req_id)
        if answers is not None and key in answers:
            return LookupResult.HIT if answers[key] else LookupResult.MISS
        if self._link.resting:
            return LookupResult.MISS  # the daemon is down: no hits, and no step spent waiting
        asked = self._asked.get(req_context.req_id)
        if asked is None:
            asked = self._asked[req_context.req_id] = {}
        asked[key] = None  # an ordered set: vLLM asks each key again until the step ends
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        asked, self._asked = self._asked, {}
        for req_id, ordered in asked.items():
            keys = list(ordered)
            namespace = self._names.namespace(self._salts.get(req_id), self.generation)
            try:
                found = self._link.call(lambda c: self._lookup(c, keys, namespace))
                hits = found.hits
                self.lookups += 1
            except LinkDown:
                hits = 0  # the daemon is down: no hits, no delay beyond this step
            except KvxferError as exc:  # refused (e.g. more keys than the daemon takes): no hits
                log.warning("kvxfer: lookup of %d keys refused: %s", len(keys), exc)
                hits = 0
            answers = self._answers.setdefault(req_id, {})
            answers.update((key, i < hits) for i, key in enumerate(keys))

    def present(self, tokens: dict[str, bytes]) -> None:
        """The workers' registration tokens (vLLM's handshake metadata): a private group (``share_events``
        false) answers Lookups to its registrant only."""
        self._tokens.update(tokens)

    def _lookup(self, client, keys: list[OffloadKey], namespace: str):
        client.present(self._tokens)
        return client.lookup(keys, pool_ids=self._pool_ids, namespace=namespace)

    def has_pending_work(self) -> bool:
        return bool(self._asked)

    # -- loads and stores ------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        # The answers are spent: if this load fails and vLLM reschedules the request, ask the daemon again.
        self._answers.pop(req_context.req_id, None)
        self._prefetching.discard(req_context.req_id)  # its load is under way: no cancel when it ends
        return KvxferBlocks(list(keys), self.namespace(req_context))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        # The daemon evicts on its own and skips keys it holds already (ALREADY_PRESENT).
        keys = list(keys)
        spec = describe(keys, self._requests.get(req_context.req_id), req_context, self._names.spec.block_size,
                        self.namespace(req_context))
        spec.hint = self._store_hints.get(req_context.req_id)
        return PrepareStoreOutput(keys_to_store=keys, store_spec=spec, evicted_keys=[])

    # -- hints -----------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        kv_hints = envelope_of(req_context)
        hint = store_hint(req_context.kv_transfer_params)
        if kv_hints is not None:
            try:
                envelope = envelope_builtins(kv_hints)
                if hint is None:  # (kv_transfer_params' own hint comes first)
                    hint = envelope_store_hint(envelope, self._hint_max_ttl_s)
                self._envelopes[req_context.req_id] = envelope_parts(envelope)
            except ValueError as exc:  # the request goes on without them
                self.envelopes_dropped += 1
                if time.monotonic() - self._warned_at >= WARN_EVERY_S:
                    self._warned_at = time.monotonic()
                    log.warning("kvxfer: a request's kv_hints were not sent: %s (%d so far)", exc,
                                self.envelopes_dropped)
        if hint is not None:
            self._store_hints[req_context.req_id] = hint
        return RequestOffloadingContext()

    def prefetch_request(self, req_id: str, keys: list[OffloadKey]) -> None:
        """A request joined the waiting queue: its router's envelope, if any, goes to the daemon with its blocks
        (``keys``, in prefix order), then its blocks are prefetched."""
        now, at_end = self._envelopes.pop(req_id, (None, None))
        if self._link.resting:
            return
        namespace = self._names.namespace(self._salts.get(req_id), self.generation)
        if now is not None:
            self._hint_calls.append(HintCall(HintAction.ENVELOPE, namespace, tuple(keys), request_id(req_id), now))
        if at_end is not None:
            self._at_end[req_id] = HintCall(HintAction.ENVELOPE, namespace, tuple(keys), request_id(req_id), at_end)
        if self.prefetch and keys:
            self._hint_calls.append(HintCall(HintAction.PREFETCH, namespace, tuple(keys), request_id(req_id)))
            self._prefetching.add(req_id)

    def take_hint_calls(self) -> list[HintCall]:
        """The hints of this step, for the workers (rank 0 sends them)."""
        calls, self._hint_calls = self._hint_calls, []
        return calls

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        request = self._requests.get(req_id)
        if req_id in self._prefetching and getattr(request, "status", None) is RequestStatus.FINISHED_ABORTED:
            self._hint_calls.append(HintCall(HintAction.CANCEL, "", (), request_id(req_id)))  # never loaded
        self._prefetching.discard(req_id)
        if req_id in self._at_end:  # the session's blocks, the prefix it loaded among them, to the eviction front
            self._hint_calls.append(self._at_end.pop(req_id))
        for table in (self._salts, self._answers, self._asked, self._requests, self._store_hints, self._envelopes):
            table.pop(req_id, None)

    def reset_cache(self) -> None:
        self._answers.clear()  # the daemon's tiers are shared: a reset of vLLM's cache does not empty them
        if self._forget_on_reset:  # ... but this engine no longer sees what it stored before
            self.generation += 1

    def shutdown(self) -> None:
        self._link.close()


def describe(keys: list[OffloadKey], request: Any, req_context: ReqContext, block_size: int,
             namespace: str) -> KvxferBlocks:
    """The blocks to store, with their tokens and parent hash where the request says them: each key the
    hash of the request's block at its position (``block_size`` tokens a hash), the keys consecutive blocks.
    Otherwise (hashes of finer blocks than the stored ones, gaps) the keys alone: an event never claims
    tokens that are not the block's."""
    if request is None or not keys:
        return KvxferBlocks(keys, namespace)
    ends = [req_context.get_offload_key_position(key) for key in keys]
    if any(end is None or end % block_size for end in ends):
        return KvxferBlocks(keys, namespace)
    first = ends[0] // block_size - 1
    hashes = request.block_hashes
    if (first < 0 or first + len(keys) > len(hashes) or ends != list(range(ends[0], ends[0] + block_size * len(keys),
                                                                          block_size))
            or any(get_offload_block_hash(k) != hashes[first + i] for i, k in enumerate(keys))):
        return KvxferBlocks(keys, namespace)
    tokens = request.all_token_ids[first * block_size:(first + len(keys)) * block_size]
    if len(tokens) != block_size * len(keys):
        return KvxferBlocks(keys, namespace)
    parent = bytes(hashes[first - 1]) if first else b""
    lora = getattr(request, "lora_request", None)
    extras, lora_name, lora_id = extra_keys(request, first, len(keys), block_size), "", 0
    if lora:
        lora_name, lora_id = lora.lora_name, lora.lora_int_id
    try:  # the daemon's own check: values it would refuse (a salt over 1,024 characters) cost the tokens, not the store
        checked_extra_keys(extras, len(keys), lora_name, lora_id)
    except InvalidArgument:
        return KvxferBlocks(keys, namespace)
    return KvxferBlocks(keys, namespace, list(tokens), parent, block_size, extras, lora_name, lora_id)


def extra_keys(request: Any, first: int, count: int, block_size: int) -> tuple[ExtraKeys, ...]:
    """What besides tokens entered the hashes of blocks ``first`` .. ``first + count - 1`` (LoRA, media, cache_salt,
    prompt embeddings), one tuple a block, as vLLM's own BlockStored events publish it; empty when nothing did."""
    if not (getattr(request, "lora_request", None) or getattr(request, "cache_salt", None)
            or getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None):
        return ()
    tagged, media = [], 0
    for i in range(first, first + count):
        keys, media = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, media)
        tagged.append(keys)
    return tuple(tuple(block) if block else () for block in to_event_extra_keys(tagged))
