"""``python -m kvxfer.bench.kvcr_envelopes``: the same hint envelopes read by kvxfer and by NVIDIA's KVCR.

Each envelope goes through kvxfer's reader (``kvxfer.core.envelope``: what the daemon does with each action)
and through KVCR's own parser (``kvcr.hint_parser``, what its ``KVCR.submit_hint`` runs first; ``kvcr`` 0.1.1
from PyPI, in an environment of its own: it pulls NIXL's CUDA wheels and a CUDA torch). Prints one row per
envelope; docs/vllm.md (The hint envelope) keeps the table. Without ``kvcr`` installed, the KVCR column says so.
"""

from __future__ import annotations

import logging

from kvxfer.core.envelope import parse
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.text_table import format_table

HASHES = [0x1234, 0x5678]


def _fetch(payload: dict, version: str = "1.0", action_id: str = "f") -> dict:
    return {"action_id": action_id, "action_type": "kv.fetch", "action_version": version, "payload": payload}


def _act(action_type: str, payload: dict, action_id: str = "a") -> dict:
    return {"action_id": action_id, "action_type": action_type, "action_version": "1.0", "payload": payload}


SOURCE = {"source_control_endpoint": "tcp://node-a:25000", "block_hashes": HASHES}
CASES: list[tuple[str, list[dict], str]] = [
    ("kv.fetch 1.0 (source_control_endpoint)", [_fetch(SOURCE)], "0.1"),
    ("kv.fetch 1.0 (source_endpoint)", [_fetch({"source_endpoint": "node-a", "block_hashes": HASHES})], "0.1"),
    ("kv.fetch 2.0", [_fetch(SOURCE, version="2.0")], "0.1"),
    ("protocol_version 0.2", [_fetch(SOURCE)], "0.2"),
    ('kv.fetch mode "move"', [_fetch({**SOURCE, "mode": "move"})], "0.1"),
    ("kv.fetch no_retain", [_fetch({**SOURCE, "no_retain": True})], "0.1"),
    ("kv.fetch, hex keys", [_fetch({**SOURCE, "block_hashes": ["00ff" * 9]})], "0.1"),
    ("two kv.fetch", [_fetch(SOURCE, action_id="f1"),
                      _fetch({**SOURCE, "source_control_endpoint": "tcp://node-c:25000"}, action_id="f2")], "0.1"),
    ("kv.fetch + kv.retain", [_fetch(SOURCE), _act("kv.retain", {"ttl_s": 600})], "0.1"),
    ("kv.retain alone", [_act("kv.retain", {"ttl_s": 600})], "0.1"),
    ("kv.release alone", [_act("kv.release", {})], "0.1"),
    ("kv.prefetch alone", [_act("kv.prefetch", {"block_hashes": HASHES})], "0.1"),
    ("kv.pin (unknown)", [_act("kv.pin", {"ttl_s": 60})], "0.1"),
]


def kvxfer_reads(envelope: dict) -> str:
    try:
        got = parse(envelope, max_ttl_s=3600, max_names=65536)
    except InvalidArgument as exc:
        return f"refused: {exc}"
    taken = [f"{a.action_id}: {a.kind.hint.value}" + (f" from {a.source}" if a.source else "") for a in got.actions]
    aside = [f"{a.action_id}: set aside ({a.reason.value})" for a in got.set_aside]
    return "; ".join(taken + aside) or "nothing"


def kvcr_reads(envelope: dict) -> str:
    try:
        from kvcr.hint_parser import _KVFetchHint
    except ImportError:
        return "(kvcr not installed)"
    try:
        hint = _KVFetchHint.from_hint(envelope)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return f"fetch {len(hint.block_hashes)} blocks from {hint.source_endpoint}"


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="  (log) %(name)s: %(message)s")
    rows = []
    for name, actions, protocol in CASES:
        envelope = {"protocol_version": protocol, "message_id": "m", "actions": actions}
        rows.append([name, kvxfer_reads(envelope), kvcr_reads(envelope)])
    print(format_table(["envelope", "kvxfer", "KVCR 0.1.1 parser"], rows))


if __name__ == "__main__":
    main()
