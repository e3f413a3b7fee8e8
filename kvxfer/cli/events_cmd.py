"""``kvxfer events``: the daemon's KV events, one line a batch, as ``kubectl get --watch`` prints.

Each line: the event's number, its time, what happened (stored, removed, cleared), the tier and
cache group, the namespace, how many blocks and why they went, and the first key (hex). Without
``--follow`` it prints what the daemon still holds from ``--from`` on and exits once nothing more
comes for ``--timeout`` seconds; with it, it goes on until interrupted. A ``RESYNC`` line says
events were missed (the daemon's buffer moved past them, or the daemon restarted).
"""

from __future__ import annotations

import argparse
import sys
import time

from kvxfer.cli.status_cmd import connect
from kvxfer.core.errors import DeadlineExceeded, KvxferError
from kvxfer.events.event_records import TierEvent

HEADER = f"{'SEQ':>8}  {'TIME':<12}  {'EVENT':<8} {'TIER':<9} {'GROUP':<12} {'NAMESPACE':<16} {'BLOCKS':>6}  " \
         f"{'REASON':<9} FIRST KEY"


def line(event: TierEvent) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.timestamp)) + f".{int(event.timestamp * 1000) % 1000:03d}"
    first = event.keys[0].hex()[:24] if event.keys else "-"
    reason = event.reason.value if event.reason else "-"
    return (f"{event.sequence:>8}  {when:<12}  {event.kind.value:<8} {event.tier.value:<9} "
            f"{event.cache_group[:12]:<12} {event.namespace[:16] or '-':<16} {len(event.keys):>6}  {reason:<9} {first}")


def run(args: argparse.Namespace) -> int:
    client = connect(args)
    print(HEADER, flush=True)
    try:
        with client:
            for batch in client.watch_events(args.namespace or ["default"], from_sequence=args.from_sequence,
                                             timeout=None if args.follow else args.timeout):
                if batch.resync:
                    since = batch.events[0].sequence if batch.events else batch.next_sequence
                    print(f"{'RESYNC':>8}  events before {since} are gone: take a snapshot", flush=True)
                for event in batch.events:
                    print(line(event), flush=True)
    except DeadlineExceeded:
        return 0
    except KvxferError as exc:
        print(f"kvxfer events: {args.target}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="unix:/tmp/kvxfer.sock", help="the daemon (unix:PATH or HOST:PORT)")
    p.add_argument("--namespace", action="append", help="a namespace to watch (repeat for more; default: default)")
    p.add_argument("--from", dest="from_sequence", type=int, default=1,
                   help="the first event wanted (1: every one the daemon still holds; 0: from the next)")
    p.add_argument("--follow", action="store_true", help="keep watching (like kubectl get --watch)")
    p.add_argument("--timeout", type=float, default=2.0, help="without --follow: stop after this many quiet seconds")
    p.add_argument("--token-file", help="for a TCP target: the bearer token")
    p.add_argument("--ca", help="for a TCP target: the CA certificate (PEM)")
