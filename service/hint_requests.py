"""Hint requests, checked and carried out: one home for gRPC (``service.servicer``) and the local lane.

A hint names keys of a pool's cache group. A private group (a registered pool's, without
``share_events``) takes hints from its registrant only (its token), as a Restore; a group that
shows its keys to every watcher (the daemon's own, or registered with ``share_events``: what a
router reads to route) takes them from any caller, for that is how a router sends them. Keys the
group does not hold, another group's keys included, change nothing, and the answer is the same
empty message whatever was held: a hint never tells its sender which prompts are cached. RETAIN and RELEASE change the eviction
order (``kvxfer.index.hinted``) of the host and disk tiers; PREFETCH queues the keys for the
prefetcher (``kvxfer.serving.prefetch``); CANCEL drops the prefetches queued under a request id.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import HintAction, PoolRef
from kvxfer.core.validate import check_name, check_namespace, checked_keys
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire import messages as wire
from service import hint_envelopes
from service.parts import Hints

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
STORE_HINTS = (HintAction.RETAIN, HintAction.RELEASE)  # what an Offload's blocks may carry


def checked_ttl(action: HintAction, ttl_s: int, top: int) -> int:
    """The TTL a hint carries, checked against what its action takes (``top``: hints.max_ttl_s)."""
    if action is HintAction.RETAIN and not 1 <= ttl_s <= top:
        raise InvalidArgument(f"ttl_s {ttl_s} is out of range: RETAIN takes 1 to {top} seconds (hints.max_ttl_s)")
    if action is HintAction.PREFETCH and ttl_s > top:
        raise InvalidArgument(f"ttl_s {ttl_s} is out of range: PREFETCH retains what it brings up for 0 to {top} "
                              "seconds (hints.max_ttl_s)")
    if action in (HintAction.RELEASE, HintAction.CANCEL, HintAction.ENVELOPE) and ttl_s:
        raise InvalidArgument(f"ttl_s goes with RETAIN and PREFETCH; {action.name} takes none")
    return ttl_s


def action_of(value: int) -> HintAction:
    action = wire.PB_TO_HINT.get(value)
    if action is None:
        raise InvalidArgument(f"hint action {value} is none of PREFETCH, RETAIN, RELEASE, CANCEL")
    return action


def store_hint(msg: pb.BlockHint, max_ttl_s: int) -> tuple[HintAction, int]:
    """An Offload's hint for its blocks, checked: (RETAIN or RELEASE, its TTL)."""
    action = action_of(msg.action)
    if action not in STORE_HINTS:
        raise InvalidArgument(f"an Offload's hint is RETAIN or RELEASE, not {action.name} (send a Hint)")
    return action, checked_ttl(action, msg.ttl_s, max_ttl_s)


def hint(registry: PoolRegistry, hints: Hints, max_keys: int, request: pb.HintRequest
         ) -> Callable[[], pb.HintResponse]:
    """A Hint, checked (cheap: no pass over its keys); the call carries it out (on a worker thread)."""
    ref = PoolRef(request.pool.pool_id, request.pool.epoch, request.pool.registration_token)
    served = registry.get(ref, reader=True)  # a private group: its registrant only, as for a Lookup
    action = action_of(request.action)
    ttl_s = checked_ttl(action, request.ttl_s, hints.settings.max_ttl_s)
    request_id = request.request_id
    if request_id or action is HintAction.CANCEL:
        check_name(request_id, REQUEST_ID_RE, "request_id", "1-128 letters, digits, '_', '.', ':', '-'")
    owner = (served.descriptor.pool_id, request_id)
    group, namespace = served.manager.group, request.namespace
    if action is HintAction.CANCEL:
        if request.keys:
            raise InvalidArgument("a CANCEL names its prefetches by request_id, and no keys")
    else:
        check_namespace(namespace)
    if (action is HintAction.ENVELOPE) != bool(request.envelope):
        raise InvalidArgument("an envelope goes with action ENVELOPE, and ENVELOPE with an envelope")

    def run() -> pb.HintResponse:
        with hints.gate:
            return carry_out()

    def carry_out() -> pb.HintResponse:
        if action is HintAction.CANCEL:
            group.hints[action] += 1
            hints.prefetcher.cancel(owner)
        elif action is HintAction.ENVELOPE:
            keys = checked_keys(request.keys, unique=False, limit=max_keys)
            hint_envelopes.carry_out(hints, group, namespace, keys, request.key_format == pb.KEY_FORMAT_VLLM,
                                     request.envelope, owner, max_keys)
            group.hints[action] += 1
        elif action is HintAction.PREFETCH:
            keys = checked_keys(request.keys, limit=max_keys)
            hints.prefetcher.submit(group, namespace, keys, owner, ttl_s)  # (raises when its queue is full)
            group.hints[action] += 1  # counted once taken: a refused hint is no hint taken
        else:
            group.hint(namespace, checked_keys(request.keys, limit=max_keys), action, time.monotonic() + ttl_s)
        return pb.HintResponse()

    return run
