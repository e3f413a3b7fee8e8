"""``kvxfer status``: the daemon at a glance, per pool and tier (like ``redis-cli info`` or ``nvidia-smi``).

Two Stats samples ``--interval`` seconds apart give what moved in that interval: the
throughput (bytes / interval) and the bandwidth while moving (bytes / the seconds the
copies took), each way. ``--watch N`` repeats every N seconds; ``--json`` prints the
records instead of a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvxfer.core.errors import InvalidArgument, KvxferError
from kvxfer.core.records import PoolStats, TierKind, TierStats, TransferStats
from kvxfer.core.text_table import format_table

if TYPE_CHECKING:
    from kvxfer.client import Client

MIB = 1 << 20


@dataclass(frozen=True)
class Rate:
    """One direction over an interval: throughput (bytes / wall time) and bandwidth (bytes / copy time)."""

    bytes: int
    blocks: int
    throughput: float  # bytes per second of wall time
    bandwidth: float | None  # bytes per second of copy time; None when nothing moved


def dropped(tier: TierStats) -> int:
    """Blocks sent down to a lower tier that never reached it (a full queue, a failing medium, an index loading, a
    store with no space)."""
    return sum(n for event, n in tier.events.items()
               if event.startswith("demotions_dropped") or event in ("stores_dropped", "stores_no_space"))


def rate(before: TransferStats, after: TransferStats, interval: float) -> Rate:
    moved, seconds = after.bytes - before.bytes, after.seconds - before.seconds
    return Rate(moved, after.blocks - before.blocks, moved / interval if interval > 0 else 0.0,
                moved / seconds if moved and seconds > 0 else None)


def hit_ratio(stats: PoolStats) -> float | None:
    return stats.lookups.hits / stats.lookups.keys if stats.lookups.keys else None


def _mib_s(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def render(before: list[PoolStats], after: list[PoolStats], interval: float) -> str:
    earlier = {s.pool_id: s for s in before}
    pools, tiers = [], []
    for s in after:
        prior = earlier.get(s.pool_id)
        if prior is None or prior.epoch != s.epoch:
            prior = dataclasses.replace(s, offloaded=TransferStats(), restored=TransferStats())
        off, res = rate(prior.offloaded, s.offloaded, interval), rate(prior.restored, s.restored, interval)
        ratio = hit_ratio(s)
        failed = {k: v for k, v in s.outcomes.items() if v and k not in ("done", "already_present")}
        pools.append([s.pool_id, s.cache_group, "-" if ratio is None else f"{ratio:.1%}",
                      f"{_mib_s(off.throughput)} / {_mib_s(off.bandwidth)}",
                      f"{_mib_s(res.throughput)} / {_mib_s(res.bandwidth)}",
                      f"{s.jobs.queued}/{s.jobs.running}/{s.jobs.unclaimed}",
                      ", ".join(f"{k} {v}" for k, v in sorted(failed.items())) or "none"])
        for t in s.tiers:
            row = [s.cache_group, t.tier.value, t.capacity_blocks, t.used_blocks, t.pinned_blocks,
                   f"{t.used_blocks * t.slot_bytes / MIB:.1f} / {t.capacity_blocks * t.slot_bytes / MIB:.1f}",
                   t.evictions, t.events.get("refaults", 0)] if t.has_occupancy else [s.cache_group, t.tier.value,
                                                                                      *["-"] * 6]
            row.append(dropped(t) if t.tier is not TierKind.HOST else "-")
            if t.degraded:
                row[1] += " (degraded)"
            if t.loading:
                row[1] += " (loading)"
            if t.warming:
                row[1] += " (warming)"
            if row not in tiers:  # a group's tiers are shared by its pools
                tiers.append(row)
    return "\n\n".join([
        format_table(["pool", "cache group", "hit ratio", "offload MiB/s (wall / moving)",
                      "restore MiB/s (wall / moving)", "jobs q/r/u", "failed blocks"], pools),
        format_table(["cache group", "tier", "capacity", "used", "pinned", "MiB used / capacity", "evictions",
                      "refaults", "dropped"], tiers)])


def as_json(before: list[PoolStats], after: list[PoolStats], interval: float) -> str:
    earlier = {s.pool_id: s for s in before}
    out = []
    for s in after:
        prior = earlier.get(s.pool_id, s)
        record = dataclasses.asdict(s)
        record["tiers"] = [{**dataclasses.asdict(t), "tier": t.tier.value} for t in s.tiers]
        record["hit_ratio"] = hit_ratio(s)
        record["interval_s"] = interval
        record["offload_rate"] = dataclasses.asdict(rate(prior.offloaded, s.offloaded, interval))
        record["restore_rate"] = dataclasses.asdict(rate(prior.restored, s.restored, interval))
        out.append(record)
    return json.dumps(out, indent=1)


def connect(args: argparse.Namespace, timeout: float = 5.0) -> Client:
    """A client for a tool's ``--target``, ``--token-file`` and ``--ca``; InvalidArgument (exit 2, one
    line) naming a file that cannot be read."""
    from kvxfer.client import Client  # (torch: only when a command runs, not for --help)

    try:
        token = Path(args.token_file).read_text().strip() if args.token_file else None
        ca = Path(args.ca).read_bytes() if args.ca else None
    except OSError as exc:
        raise InvalidArgument(f"{exc.filename}: {exc.strerror}") from None
    return Client(args.target, token=token, root_certificates=ca, timeout=timeout)


def run(args: argparse.Namespace) -> int:
    client = connect(args, args.timeout)
    try:
        with client:
            before = client.stats()
            while True:
                time.sleep(args.interval)
                after = client.stats()
                print((as_json if args.json else render)(before, after, args.interval), flush=True)
                if not args.watch:
                    return 0
                before = after
                time.sleep(max(0.0, args.watch - args.interval))
                if not args.json:
                    print()
    except KvxferError as exc:
        print(f"kvxfer status: {args.target}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="unix:/tmp/kvxfer.sock", help="the daemon (unix:PATH or HOST:PORT)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between the two samples of a rate")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="repeat every SECONDS")
    p.add_argument("--json", action="store_true", help="print records, not tables")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--token-file", help="for a TCP target: the bearer token")
    p.add_argument("--ca", help="for a TCP target: the CA certificate (PEM)")
