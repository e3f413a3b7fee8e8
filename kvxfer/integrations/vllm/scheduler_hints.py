"""What vLLM's scheduler knows is coming, told to the daemon as hints (docs/vllm.md, Hints).

- PREFETCH: a request that joins the waiting queue (the connector's ``on_new_request``) has its
  prompt's blocks brought up to host memory while it waits. The scheduler collects these each step
  and hands them to the workers with the step's connector metadata; rank 0's worker sends one Hint
  a request over the local lane (the workers registered the pools, and a hint is scoped like a
  Restore: the pool's registrant). The scheduler never waits on the daemon for them.
- CANCEL: a request that finishes before any load of it was scheduled (an abort) has its queued
  prefetch dropped.
- RETAIN / RELEASE: a request whose ``kv_transfer_params`` carry ``{"kvxfer": {"hint": "release"}}``
  (the conversation ends with this turn) or ``{"kvxfer": {"hint": "retain", "ttl_s": 600}}`` has
  its blocks stored with that hint (an Offload's ``hint``).
- ENVELOPE: a request that carries a router's ``kv_hints`` (vLLM's ``KvHintsEnvelope``, vLLM 0.32 and
  0.33), or ``kv_transfer_params: {"kv_hint": <envelope>}`` (through vLLM's OpenAI server), has it
  sent to the daemon with the request's keys, ahead of its own PREFETCH, so that a ``kv.fetch``
  reads the router's peer first; a ``kv.release`` of the request's own blocks is sent when the request
  ends (``envelope_parts``). The daemon carries out, counts and logs each action
  (``kvxfer.core.envelope``). Its ``kv.retain`` or ``kv.release`` of the request's own blocks is also the
  hint their stores carry, as ``kv_transfer_params`` would give it (``kv_transfer_params`` come first).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

from kvxfer.core.envelope import MAX_ENVELOPE_BYTES
from kvxfer.core.records import HintAction

log = logging.getLogger("kvxfer.vllm")
PARAMS_KEY = "kvxfer"  # kv_transfer_params' field for this backend
ENVELOPE_PARAM = "kv_hint"  # kv_transfer_params' field for a router's envelope (KVCR's ROUTER_HINT_KEY)
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
STORE_HINTS = {"retain": HintAction.RETAIN, "release": HintAction.RELEASE}


@dataclass(frozen=True)
class HintCall:
    """One Hint a worker sends for the scheduler."""

    action: HintAction
    namespace: str
    keys: tuple[bytes, ...]
    request_id: str
    envelope: bytes = b""  # ENVELOPE: the router's envelope, JSON


def store_hint(params: dict[str, Any] | None) -> tuple[HintAction, int] | None:
    """The hint a request's ``kv_transfer_params`` ask for its blocks' stores; None (logged) when the field is
    absent or malformed: a bad field costs the hint, never the request."""
    field = (params or {}).get(PARAMS_KEY)
    if field is None:
        return None
    hint = field.get("hint") if isinstance(field, dict) else None
    ttl = field.get("ttl_s", 0) if isinstance(field, dict) else None
    action = STORE_HINTS.get(hint) if isinstance(hint, str) else None
    if action is None or isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0 or \
            (action is HintAction.RETAIN) != (ttl > 0):
        log.warning('kvxfer: kv_transfer_params["kvxfer"] must be {"hint": "release"} or {"hint": "retain", '
                    '"ttl_s": seconds}; got %.200r (ignored)', field)
        return None
    return action, ttl


def envelope_of(req_context: Any) -> Any:
    """A request's router envelope: vLLM's ``kv_hints`` (0.32 and 0.33 carry it from ``LLMEngine.add_request`` and
    ``AsyncLLM.generate``), else ``kv_transfer_params["kv_hint"]``, where routers put it for vLLM's OpenAI server
    (which has no field of its own for it; Dynamo's vLLM bridge and KVCR's parser read it there); None: neither."""
    kv_hints = getattr(req_context, "kv_hints", None)
    if kv_hints is not None:
        return kv_hints
    params = req_context.kv_transfer_params
    return params.get(ENVELOPE_PARAM) if isinstance(params, dict) else None


def envelope_json(kv_hints: Any) -> bytes:
    """A request's ``kv_hints`` as the daemon takes them: JSON, at most ``MAX_ENVELOPE_BYTES`` (else ValueError,
    saying why: the request goes on without them)."""
    try:
        data = msgspec.json.encode(kv_hints)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if len(data) > MAX_ENVELOPE_BYTES:
        raise ValueError(f"{len(data)} bytes, past {MAX_ENVELOPE_BYTES}")
    return data


def envelope_builtins(kv_hints: Any) -> Any:
    """A request's ``kv_hints`` (vLLM's msgspec struct, or a mapping) as plain Python values; ValueError when it
    cannot be."""
    try:
        return msgspec.to_builtins(kv_hints)
    except (TypeError, ValueError, msgspec.EncodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None


def envelope_parts(envelope: Any) -> tuple[bytes | None, bytes | None]:
    """A request's envelope (``envelope_builtins``) as the daemon takes it, in two parts with the router's ids
    (``envelope_json`` each): what is sent when the request arrives, and its ``kv.release`` of the request's own
    blocks, sent when it ends. Released on arrival, the prefix it is about to load would stand at the eviction
    front; at its end the whole session's blocks go there, as the router meant."""
    actions = envelope.get("actions") if isinstance(envelope, dict) else None
    at_end = [a for a in actions if _own_release(a)] if isinstance(actions, list) else []
    if not at_end:
        return envelope_json(envelope), None  # (whatever it is: the daemon judges and counts it)
    first = [a for a in actions if not _own_release(a)]
    return (envelope_json({**envelope, "actions": first}) if first else None,
            envelope_json({**envelope, "actions": at_end}))


def _own_release(action: Any) -> bool:
    return isinstance(action, dict) and action.get("action_type") == "kv.release" and \
        isinstance(action.get("payload"), dict) and "block_hashes" not in action["payload"]


def request_id(req_id: str) -> str:
    """vLLM's request id as the daemon takes one (its own characters, else a digest of it)."""
    return req_id if REQUEST_ID_RE.fullmatch(req_id) else hashlib.sha256(req_id.encode()).hexdigest()[:32]


def prompt_keys(block_hashes: Sequence[bytes], config: Any) -> list[OffloadKey]:
    """The keys of a request's full offloaded blocks, as vLLM's offloading scheduler makes them (each chunk's key
    is the hash at its end, per KV cache group), in prefix order. ``config``: its ``SchedulerOffloadConfig``."""
    per_hash = config.tokens_per_hash
    tokens = len(block_hashes) * per_hash
    return [make_offload_key(block_hashes[end // per_hash - 1], group.group_idx)
            for group in config.kv_group_configs if not group.is_eagle_group
            for end in range(group.tokens_per_chunk, tokens + 1, group.tokens_per_chunk)]
