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
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

from kvxfer.core.records import HintAction

log = logging.getLogger("kvxfer.vllm")
PARAMS_KEY = "kvxfer"  # kv_transfer_params' field for this backend
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
STORE_HINTS = {"retain": HintAction.RETAIN, "release": HintAction.RELEASE}


@dataclass(frozen=True)
class HintCall:
    """One Hint a worker sends for the scheduler."""

    action: HintAction
    namespace: str
    keys: tuple[bytes, ...]
    request_id: str


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
