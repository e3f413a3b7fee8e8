"""``kvxfer hint ACTION``: tell a daemon what is coming, as a router or an application would.

    kvxfer hint prefetch --pool P --namespace NS --keys KEY...   # bring the keys up to host memory now
    kvxfer hint retain --ttl 600 --pool P --namespace NS --keys KEY...
    kvxfer hint release --pool P --namespace NS --keys KEY...    # the session ended: evict these first
    kvxfer hint cancel --pool P --request-id R                   # drop the prefetches queued under R
    kvxfer hint --envelope FILE --pool P --namespace NS [--keys KEY...]   # a router's hint envelope (JSON)

Keys are hex, after ``--keys`` or one a line in ``--keys-file`` (``-``: standard input), in
prefix order. With ``--envelope`` (vLLM's ``KvHintsEnvelope`` as JSON, ``-``: standard input; docs/api.md,
The hint envelope) they are the request's blocks: the scope of its actions that name none, and what
their 64-bit block hashes are matched against (``--vllm-keys``: keys are vLLM's offload keys).
The daemon's own pools (``pools:`` in its config) and pools registered with
``share_events`` take hints from anyone who may call the daemon; another registered pool takes
them from its registrant only (its registration token), as its Restores do. The daemon answers the same whatever it
holds (a hint never says which keys are cached); ``kvxfer status`` and the ``kvxfer_tier_hinted_blocks``
and ``kvxfer_prefetch_keys`` metrics show what hints did.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvxfer.cli.status_cmd import connect
from kvxfer.core.envelope import loads, parse
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import HintAction
from kvxfer.core.validate import check_uint32

U32 = (1 << 32) - 1


def keys_of(args: argparse.Namespace) -> list[bytes]:
    """The keys named on the command line and in ``--keys-file``, decoded from hex (InvalidArgument if one is not)."""
    words = list(args.keys)
    if args.keys_file:
        text = sys.stdin.read() if args.keys_file == "-" else _read(args.keys_file)
        words += [w for w in text.split() if w]
    try:
        return [bytes.fromhex(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not _is_hex(w))
        raise InvalidArgument(f"key {bad[:40]!r} is not hex") from None


def run(args: argparse.Namespace) -> int:
    if args.envelope or args.action == HintAction.ENVELOPE.value:
        if args.action not in (None, HintAction.ENVELOPE.value):
            raise InvalidArgument(f"--envelope carries its own actions; drop {args.action!r}")
        return _envelope(args)
    if args.action is None:
        raise InvalidArgument("name an action, or an envelope with --envelope FILE")
    action = HintAction(args.action)
    keys = keys_of(args)
    if action is HintAction.CANCEL and not args.request_id:
        raise InvalidArgument("cancel names the prefetches it drops with --request-id")
    if action is not HintAction.CANCEL and not keys:
        raise InvalidArgument(f"{action.value} names at least one key (hex), or --keys-file")
    check_uint32(args.ttl, "--ttl (seconds)")  # before anything is sent (the daemon bounds it by hints.max_ttl_s)
    client = connect(args, args.timeout)
    with client:
        client.hint(action, keys, ttl_s=args.ttl, request_id=args.request_id, pool_id=args.pool,
                    namespace=args.namespace)
    print(f"{action.value}: sent for {len(keys)} keys" if keys else f"{action.value}: sent for {args.request_id}")
    return 0


def _envelope(args: argparse.Namespace) -> int:
    if not args.envelope:
        raise InvalidArgument("envelope: name the envelope's file with --envelope FILE ('-': standard input)")
    data = (sys.stdin.read() if args.envelope == "-" else _read(args.envelope)).encode()
    parse(loads(data), max_ttl_s=U32, max_names=U32)  # no envelope at all: refused here, before anything is sent
    keys = keys_of(args)
    with connect(args, args.timeout) as client:
        client.hint_envelope(data, keys, vllm_keys=args.vllm_keys, request_id=args.request_id, pool_id=args.pool,
                             namespace=args.namespace)
    print(f"envelope: sent with {len(keys)} request keys (kvxfer_hint_envelope_actions_total says what it did)")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=[a.value for a in HintAction], help="what the keys are for")
    p.add_argument("--envelope", help="a router's hint envelope, JSON ('-': standard input)")
    p.add_argument("--vllm-keys", action="store_true", help="envelope: the keys are vLLM offload keys")
    p.add_argument("--keys", nargs="+", default=[], metavar="KEY", help="keys, hex, in prefix order")
    p.add_argument("--pool", required=True, help="the pool whose cache group holds the keys")
    p.add_argument("--namespace", default="default", help="the keys' namespace")
    p.add_argument("--ttl", type=int, default=0, help="retain: seconds (1 to hints.max_ttl_s); prefetch: retain "
                   "what it brings up this long (0: not retained)")
    p.add_argument("--request-id", default="", help="prefetch: names it for a later cancel; cancel: the one dropped")
    p.add_argument("--keys-file", help="more keys, hex, one a line ('-': standard input)")
    p.add_argument("--target", default="unix:/tmp/kvxfer.sock", help="the daemon (unix:PATH or HOST:PORT)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    p.add_argument("--token-file", help="for a TCP target: the bearer token")
    p.add_argument("--ca", help="for a TCP target: the CA certificate (PEM)")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"{path}: {exc.strerror}") from None


def _is_hex(word: str) -> bool:
    try:
        bytes.fromhex(word)
        return True
    except ValueError:
        return False
