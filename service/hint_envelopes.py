"""A router's hint envelope, carried out: each action it holds becomes a hint of the pool's cache group.

``kvxfer.core.envelope`` reads the envelope; here each action it understood is resolved to keys (the
request's, or those its block hashes name) and done as the Hint RPC does it, within the same shares
and bounds: kv.prefetch and kv.fetch queue a prefetch (kv.fetch reading from the peer it names alone:
a source that is none of ``peering.peers`` is never dialled), kv.retain and kv.release change the
eviction order. Every action ends with one outcome, counted by action type
(``kvxfer_hint_envelope_actions``): ``taken``, or why it was set aside, and announced in the group's
KV event stream as a HINTED event (its blocks, the envelope's ``message_id``, the ``action_id``, the
outcome). An envelope with an action set aside is logged as a warning (at most one line every
``EnvelopeCounts.LOG_EVERY_S``, with how many were not shown); one fully taken, at debug. Both name its
``message_id`` and each ``action_id``, so a router can trace what it asked.
"""

from __future__ import annotations

import logging
import time

from kvxfer.core.envelope import Action, Envelope, EnvelopeCounts, Kind, Reason, loads, parse, resolve
from kvxfer.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvxfer.core.records import TierKind
from kvxfer.core.validate import checked_keys
from kvxfer.events.event_records import EventKind, HintTrace
from kvxfer.serving.group import CacheGroup
from service.parts import Hints

log = logging.getLogger("kvxfer.hints")
TAKEN = "taken"


def carry_out(hints: Hints, group: CacheGroup, namespace: str, keys: list[bytes], vllm_keys: bool,
              data: bytes, owner: tuple[str, str], max_keys: int) -> None:
    """Carry out the envelope ``data`` (JSON) for the request whose blocks are ``keys``; InvalidArgument only
    where it is no envelope at all."""
    envelope = parse(loads(data), hints.settings.max_ttl_s, max_keys)
    done = [(a.action_id, a.label, a.reason.value, []) for a in envelope.set_aside]
    for action in envelope.actions:
        outcome, named = _one(hints, group, namespace, keys, vllm_keys, action, owner, max_keys)
        done.append((action.action_id, action.kind.value, outcome, named))
    hints.envelopes.add([(label, outcome) for _, label, outcome, _ in done])
    if hints.kv_events is not None:  # each action in the group's event stream: what a router traces it by
        for action_id, label, outcome, named in done:
            hints.kv_events.emit(EventKind.HINTED, TierKind.HOST, group.name, namespace, named,
                                    scope=group.event_scope,
                                    hint=HintTrace(envelope.message_id, action_id, label, outcome))
    _log(envelope, [(a, label, outcome, len(named)) for a, label, outcome, named in done], hints.envelopes, owner)


def _one(hints: Hints, group: CacheGroup, namespace: str, keys: list[bytes], vllm_keys: bool, action: Action,
         owner: tuple[str, str], max_keys: int) -> tuple[str, list[bytes]]:
    """One action done: its outcome, and the blocks it named."""
    tiers = None
    if action.kind is Kind.FETCH:  # a source that is none of the peers is never dialled, whatever it names
        tiers = group.reading_from(action.source, router=True)
        if not tiers:  # (no such peer, or a group without a peer tier: it reads from no peer)
            return Reason.UNKNOWN_PEER.value, []
    try:
        named = checked_keys(resolve(action.names, keys, vllm_keys), limit=max_keys)
    except InvalidArgument:  # a key in full that no tier would take (empty, too long)
        return Reason.MALFORMED.value, []
    if not named:
        return Reason.UNRESOLVED.value, []
    hint = action.kind.hint
    if action.kind in (Kind.RETAIN, Kind.RELEASE):
        group.hint(namespace, named, hint, time.monotonic() + action.ttl_s)
        return TAKEN, named
    try:
        hints.prefetcher.submit(group, namespace, named, owner, action.ttl_s, tiers=tiers)
    except (ResourceExhausted, Unavailable):
        return Reason.REFUSED.value, named
    group.hints[hint] += 1
    return TAKEN, named


def _log(envelope: Envelope, done: list[tuple[str, str, str, int]], counts: EnvelopeCounts,
         owner: tuple[str, str]) -> None:
    actions = [{"action_id": action_id, "action_type": label, "outcome": outcome, "blocks": blocks}
               for action_id, label, outcome, blocks in done]
    extra = {"message_id": envelope.message_id, "protocol_version": envelope.protocol_version,
             "pool": owner[0], "request_id": owner[1], "actions": actions}
    if all(a["outcome"] == TAKEN for a in actions):
        log.debug("hint envelope taken", extra=extra)
        return
    quiet = counts.may_log()
    if quiet is not None:
        log.warning("hint envelope: actions set aside", extra={**extra, "not_shown_since": quiet})
