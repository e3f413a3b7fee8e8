"""The KV hint envelope engines carry (vLLM's ``KvHintsEnvelope``; KVCR's ``kv.fetch``), read as kvxfer's hints.

An envelope is advisory request metadata a router attaches::

    {"protocol_version": "0.1", "message_id": "...",
     "actions": [{"action_id": "...", "action_type": "kv.fetch", "action_version": "1.0", "payload": {...}}]}

The action types kvxfer understands (docs/vllm.md, The hint envelope), each at action version 1.x:

=============  ====================================================================  =========================
action_type    payload                                                               kvxfer does
=============  ====================================================================  =========================
kv.fetch       ``source_control_endpoint`` (or ``source_endpoint``): a configured     PREFETCH from that peer
               peer; ``block_hashes``: the blocks it holds; ``mode``: "copy" only
kv.prefetch    ``block_hashes`` (absent: the request's blocks); ``ttl_s``: retain    PREFETCH
               what it brings up this long (0, the default: not retained)
kv.retain      ``ttl_s`` (required); ``block_hashes`` (absent: the request's)        RETAIN
kv.release     ``block_hashes`` (absent: the request's): the session ended           RELEASE
=============  ====================================================================  =========================

A block is named by its 64-bit event hash (an int: what vLLM's and SGLang's KV events publish and what
KV-aware routers index; matched against the request's keys) or by its key in full (a hex string).
Parsing never fails on an action: one of an unknown type or version, or with a malformed or oversized
payload, is set aside with its reason and the others still count. Only what is no envelope at all (not
an object, no list of actions) raises ``InvalidArgument``.
"""

from __future__ import annotations

import enum
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import HintAction

MAX_ACTIONS = 16  # actions read from one envelope; those past it are set aside (OVERSIZED)
MAX_ENVELOPE_BYTES = 1 << 20  # an envelope's JSON, at most
ID_RE = re.compile(r"[\x20-\x7e]{0,128}")  # message and action ids: printable ASCII, as logs show them
U64 = (1 << 64) - 1
BlockName = int | bytes  # a 64-bit event hash, or a key in full


class Kind(enum.Enum):
    """An action type kvxfer understands, and the hint it becomes."""

    FETCH = "kv.fetch"
    PREFETCH = "kv.prefetch"
    RETAIN = "kv.retain"
    RELEASE = "kv.release"

    @property
    def hint(self) -> HintAction:
        return HINTS[self]


class Reason(enum.Enum):
    """Why an action was set aside (the ``outcome`` label of ``kvxfer_hint_envelope_actions``)."""

    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_VERSION = "unknown_version"
    MALFORMED = "malformed"  # a payload field missing or of the wrong type or range
    OVERSIZED = "oversized"  # more block hashes than a request takes, or past MAX_ACTIONS
    UNKNOWN_PEER = "unknown_peer"  # kv.fetch: the source is none of peering.peers (never dialled)
    UNRESOLVED = "unresolved"  # no block it names is one of the request's
    REFUSED = "refused"  # the daemon could not take it now (its prefetch queue is full)


@dataclass(frozen=True)
class Action:
    """One action kvxfer carries out. ``names``: the blocks it names, or None for the request's own."""

    action_id: str
    kind: Kind
    names: tuple[BlockName, ...] | None
    ttl_s: int = 0
    source: str = ""  # kv.fetch: the peer


@dataclass(frozen=True)
class SetAside:
    """An action not carried out, and why."""

    action_id: str
    action_type: str  # as sent, shortened (a label: one of Kind's values, else "other")
    reason: Reason

    @property
    def label(self) -> str:
        return self.action_type if self.action_type in KNOWN else "other"


@dataclass(frozen=True)
class Envelope:
    protocol_version: str
    message_id: str
    actions: tuple[Action, ...]
    set_aside: tuple[SetAside, ...]


KNOWN = {k.value for k in Kind}
HINTS = {Kind.FETCH: HintAction.PREFETCH, Kind.PREFETCH: HintAction.PREFETCH, Kind.RETAIN: HintAction.RETAIN,
         Kind.RELEASE: HintAction.RELEASE}


class _Bad(Exception):
    """An action set aside while it is read (internal: becomes a SetAside)."""

    def __init__(self, reason: Reason) -> None:
        self.reason = reason


def loads(data: bytes) -> Any:
    """An envelope's JSON, decoded; InvalidArgument when it is not JSON (or nests past what Python decodes)."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise InvalidArgument(f"the envelope has {len(data)} bytes; at most {MAX_ENVELOPE_BYTES}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"the envelope is not JSON: {str(exc)[:120]}") from None


def parse(envelope: Any, max_ttl_s: int, max_names: int) -> Envelope:
    """An envelope (a mapping, as decoded from JSON or ``msgspec.to_builtins``) read as kvxfer's actions.
    ``max_ttl_s``: a TTL's bound (hints.max_ttl_s); ``max_names``: block hashes one action may name."""
    if not isinstance(envelope, Mapping) or not isinstance(envelope.get("actions"), list):
        raise InvalidArgument("a hint envelope is an object with a list of actions")
    message_id = _text(envelope.get("message_id", ""))
    protocol = _text(envelope.get("protocol_version", ""))
    actions, set_aside = [], []
    for i, raw in enumerate(envelope["actions"]):
        raw = raw if isinstance(raw, Mapping) else {}
        action_id, action_type = _text(raw.get("action_id", "")), _text(raw.get("action_type", ""))[:64]
        try:
            if i >= MAX_ACTIONS:
                raise _Bad(Reason.OVERSIZED)
            actions.append(_action(raw, action_id, max_ttl_s, max_names))
        except _Bad as bad:
            set_aside.append(SetAside(action_id, action_type, bad.reason))
    return Envelope(protocol, message_id, tuple(actions), tuple(set_aside))


def _action(raw: Mapping, action_id: str, max_ttl_s: int, max_names: int) -> Action:
    try:
        kind = Kind(raw.get("action_type"))
    except ValueError:
        raise _Bad(Reason.UNKNOWN_TYPE) from None
    version = raw.get("action_version")
    if not isinstance(version, str) or version.split(".")[0] != "1":
        raise _Bad(Reason.UNKNOWN_VERSION)  # a major version kvxfer does not know: its meaning may differ
    payload = raw.get("payload")
    if not isinstance(payload, Mapping):
        raise _Bad(Reason.MALFORMED)
    names = _names(payload, max_names)
    if kind is Kind.FETCH:
        source = payload.get("source_control_endpoint", payload.get("source_endpoint"))
        if not isinstance(source, str) or not 0 < len(source) <= 256 or payload.get("mode", "copy") != "copy" \
                or not names or not isinstance(payload.get("no_retain", False), bool):
            raise _Bad(Reason.MALFORMED)
        return Action(action_id, kind, names, source=source)
    ttl = payload.get("ttl_s", 0)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 <= ttl <= max_ttl_s or \
            (kind is Kind.RETAIN and not ttl) or (kind is Kind.RELEASE and ttl):
        raise _Bad(Reason.MALFORMED)
    return Action(action_id, kind, names, ttl)


def _names(payload: Mapping, max_names: int) -> tuple[BlockName, ...] | None:
    hashes = payload.get("block_hashes")
    if hashes is None:
        return None
    if not isinstance(hashes, list):
        raise _Bad(Reason.MALFORMED)
    if len(hashes) > max_names:
        raise _Bad(Reason.OVERSIZED)
    names: dict[BlockName, None] = {}
    for h in hashes:
        if isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= U64:
            names[h] = None
        elif isinstance(h, str) and 0 < len(h) <= 2048 and len(h) % 2 == 0:
            try:
                names[bytes.fromhex(h)] = None
            except ValueError:
                raise _Bad(Reason.MALFORMED) from None
        else:
            raise _Bad(Reason.MALFORMED)
    return tuple(names)


def _text(value: Any) -> str:
    """An id or version as logs may show it: printable ASCII, at most 128 characters (else its repr, cut)."""
    text = value if isinstance(value, str) else repr(value)
    return text if ID_RE.fullmatch(text) else ascii(text)[:128]


def event_hash(key: bytes, vllm_keys: bool) -> int:
    """A key's 64-bit event hash: the low 64 bits of its block hash (a vLLM key's, without the group index)
    read big-endian, as vLLM publishes hashes as ints and KV-aware routers index them."""
    return int.from_bytes(key[:-4] if vllm_keys else key, "big") & U64


def resolve(names: tuple[BlockName, ...] | None, request_keys: Sequence[bytes], vllm_keys: bool) -> list[bytes]:
    """The keys an action names: the request's (``names`` None); else, in the request's order, those of its keys
    an event hash names (each cache group's), then the keys named in full."""
    if names is None:
        return list(dict.fromkeys(request_keys))
    hashes = {n for n in names if isinstance(n, int)}
    matched = [k for k in request_keys if event_hash(k, vllm_keys) in hashes] if hashes else []
    return list(dict.fromkeys([*matched, *(n for n in names if isinstance(n, bytes))]))


def store_hint(envelope: Any, max_ttl_s: int) -> tuple[HintAction, int] | None:
    """The retention the request's own blocks get as they are stored: the last kv.retain or kv.release of the
    request's scope; None when there is none or the envelope is unreadable (it costs the hint, never the request)."""
    try:
        parsed = parse(envelope, max_ttl_s, 1 << 16)
    except InvalidArgument:
        return None
    scoped = [a for a in parsed.actions if a.names is None and a.kind in (Kind.RETAIN, Kind.RELEASE)]
    return (scoped[-1].kind.hint, scoped[-1].ttl_s) if scoped else None


@dataclass
class EnvelopeCounts:
    """Actions by (action type label, outcome), and the log's rate limit. Thread-safe."""

    LOG_EVERY_S: ClassVar[float] = 10.0  # a warning about actions set aside, at most this often
    actions: Counter = field(default_factory=Counter)
    envelopes: int = 0
    _logged: float = float("-inf")
    _quiet: int = 0  # envelopes with an action set aside that were not logged since the last line
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcomes: list[tuple[str, str]]) -> None:
        with self._lock:
            self.envelopes += 1
            self.actions.update(outcomes)

    def may_log(self) -> int | None:
        """None: not now (counted); else how many were not shown before this one."""
        with self._lock:
            now = time.monotonic()
            if now - self._logged < self.LOG_EVERY_S:
                self._quiet += 1
                return None
            self._logged, quiet, self._quiet = now, self._quiet, 0
            return quiet

    def snapshot(self) -> tuple[int, dict[tuple[str, str], int]]:
        with self._lock:
            return self.envelopes, dict(self.actions)
