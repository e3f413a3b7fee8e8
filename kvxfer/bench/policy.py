"""``kvxfer bench policy TRACE``: a request trace replayed through the real block index, for tier sizing.

The trace is Mooncake's format (``../shared/traces``): one JSON object a line with ``hash_ids``, the
prompt's block ids in order (equal ids, equal prefix blocks). Each request reuses only the longest
cached prefix of its blocks (what an engine loads), then stores all of them (what it offloads). For a
cache of C blocks, every request goes through a ``BlockIndex`` of C slots exactly as the daemon's host
tier does (lookup, two-phase load of the hit prefix, two-phase store, evictions), under

- ``lru``: the daemon's policy;
- ``belady``: the offline optimum, the same index with an oracle eviction policy that knows the
  trace: evict the block needed furthest ahead (of two needed by the same request, the later in its
  prefix: it is useless without the earlier), and store no block that is never read again.

It prints the hit ratio of block reads of each at each size (a share of the trace's distinct blocks),
the curve an operator reads to size a tier for their traffic, and plots it (``--plot``); and the
bookkeeping's CPU cost a block under LRU.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np

from kvxfer.bench import policy_hints
from kvxfer.bench.common import Progress, save
from kvxfer.core.records import HintAction, TierKind
from kvxfer.core.text_table import format_table
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.eviction import Evictable, EvictionPolicy, lru

NAMESPACE = "trace"
NEVER = np.iinfo(np.int64).max  # the next use of a block never read again
DEPTH = 1 << 12  # an oracle rank is next use * DEPTH + position in the request (capped): deeper goes first


@dataclass(frozen=True)
class Trace:
    """Requests as lists of block ids, and for each block of each request the request that reads it next."""

    requests: list[list[int]]
    next_use: list[list[int]]

    @property
    def distinct(self) -> int:
        return len({b for r in self.requests for b in r})

    @property
    def reads(self) -> int:
        return sum(len(r) for r in self.requests)


def load(path: str, limit: int = 0) -> Trace:
    """A Mooncake-format trace (``hash_ids`` a line); ``limit``: its first requests only (0: all)."""
    requests = []
    with open(path) as f:
        for line in f:
            if line.strip():
                ids = json.loads(line)["hash_ids"]
                if not all(isinstance(b, int) for b in ids) or len(set(ids)) != len(ids):
                    raise SystemExit(f"{path}: request {len(requests)}: hash_ids must be distinct integers")
                requests.append(ids)
                if limit and len(requests) == limit:
                    break
    return of_requests(requests)


def of_requests(requests: list[list[int]]) -> Trace:
    """A trace of these requests (each a list of distinct block ids), with each block's next use."""
    later: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = [later.get(b, NEVER) for b in requests[i]]
        for b in requests[i]:
            later[b] = i
    return Trace(requests, next_use)


class FurthestNextUse(EvictionPolicy):
    """Belady's: the evictable slot whose block is read furthest ahead goes first. An oracle the bench
    feeds (``next_use``: its rank, ``rank``), not a policy the daemon could run."""

    def __init__(self, capacity: int) -> None:
        self.next_use = np.full(capacity, -1, dtype=np.int64)

    def used(self, slots: np.ndarray) -> None:
        pass  # the bench sets each slot's next use

    def forget(self, slots: np.ndarray) -> None:
        self.next_use[slots] = -1

    def victims(self, n: int, evictable: Evictable) -> np.ndarray:
        candidates = np.flatnonzero(self.next_use >= 0)
        candidates = candidates[evictable(candidates)]
        if len(candidates) <= n:
            return self.ordered(candidates)
        part = np.argpartition(-self.next_use[candidates], n - 1)[:n]
        return self.ordered(candidates[part])

    def ordered(self, slots: np.ndarray) -> np.ndarray:
        return slots[np.argsort(-self.next_use[slots], kind="stable")]


def replay(trace: Trace, capacity: int, policy: str, release: list[bool] | None = None) -> tuple[int, float]:
    """(blocks read from the cache, seconds the index took) for ``trace`` through a ``capacity``-slot index.
    ``policy``: lru, belady, or hinted (the daemon's own index, ``HintedLRU``), where request i's new blocks
    are stored with RELEASE when ``release[i]`` (``kvxfer.bench.policy_hints``)."""
    oracle = FurthestNextUse(capacity) if policy == "belady" else None
    index = BlockIndex(TierKind.HOST, capacity, oracle or (None if policy == "hinted" else lru(capacity)))
    hits, spent = 0, 0.0
    for i, blocks in enumerate(trace.requests):
        keys = [b.to_bytes(8, "little", signed=True) for b in blocks]
        if oracle is not None:
            ranks = [rank(use, k) for k, use in enumerate(trace.next_use[i])]
        start = time.perf_counter()
        present = index.contains(NAMESPACE, keys)
        prefix = next((k for k, p in enumerate(present) if not p), len(keys))
        if prefix:  # the engine loads the hit prefix: those blocks are used
            plan = index.prepare_load(NAMESPACE, keys[:prefix])
            index.complete_load(plan.slots)
        if oracle is not None:  # blocks held already get their next use before room is made
            for k in range(len(keys)):
                if present[k]:
                    oracle.next_use[index.locate(NAMESPACE, keys[k])] = ranks[k]
            stored = next((k for k, use in enumerate(trace.next_use[i]) if use == NEVER), len(keys))
            keys = keys[:stored]  # (a block never read again: nor is any after it)
        plan = index.prepare_store(NAMESPACE, keys)
        if oracle is not None:
            for slot, k in zip(plan.slots, plan.positions):
                oracle.next_use[slot] = ranks[k]
        index.complete_store(plan.slots, [1] * len(plan.slots))
        if release is not None and release[i] and plan.positions:  # what an Offload's RELEASE hint does
            index.hints.hint(NAMESPACE, [keys[k] for k in plan.positions], HintAction.RELEASE)
        spent += time.perf_counter() - start
        hits += prefix
    return hits, spent


def rank(next_use: int, position: int) -> int:
    return NEVER if next_use == NEVER else next_use * DEPTH + min(position, DEPTH - 1)


def _subjects(args: argparse.Namespace, trace: Trace) -> dict[str, tuple[str, list[bool] | None]]:
    """Each replayed subject: its policy and which requests' blocks it stores with RELEASE."""
    subjects = {"lru": ("lru", None)}
    if args.hints is not None:
        subjects["hinted"] = ("hinted", policy_hints.released(trace.requests, args.hints))
        if args.wrong:
            subjects["hinted_wrong"] = ("hinted", policy_hints.released(trace.requests, args.hints, args.wrong))
    subjects["belady"] = ("belady", None)
    return subjects


def _closed(ratio: float, lru_ratio: float, belady: float) -> str:
    """The share of the LRU-to-Belady gap a subject closed (negative: below LRU)."""
    return f"{(ratio - lru_ratio) / (belady - lru_ratio):+.2f}" if belady > lru_ratio else "-"


def run(args: argparse.Namespace) -> int:
    trace = load(args.trace, args.requests)
    distinct, reads = trace.distinct, trace.reads
    shares = [float(s) for s in args.shares.split(",")]
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise SystemExit("--shares: comma-separated shares of the distinct blocks, each in (0, 1]")
    if not 0 <= args.wrong < 1:
        raise SystemExit("--wrong: the share of continuing turns released as well, in [0, 1)")
    subjects = _subjects(args, trace)
    released = subjects.get("hinted", ("", None))[1]
    print(f"{len(trace.requests)} requests, {reads} block reads, {distinct} distinct blocks"
          + (f"; {sum(released)} stored with RELEASE ({args.hints})" if released else ""))
    progress = Progress(len(subjects) * len(shares))
    rows, curve = [], []
    for share in shares:
        capacity = max(1, round(distinct * share))
        ratios = {}
        for name, (policy, release) in subjects.items():
            hits, seconds = replay(trace, capacity, policy, release)
            ratios[name] = hits / reads
            if name == "lru":
                per_block = seconds / reads * 1e6
            elif name == "hinted":
                hinted_per_block = seconds / reads * 1e6
            progress.step(f"{capacity} blocks ({share:.0%}), {name}: hit ratio {hits / reads:.3f}")
        costs = {"hinted_us_per_block": hinted_per_block} if "hinted" in subjects else {}
        curve.append({"share": share, "capacity_blocks": capacity, **ratios, "lru_us_per_block": per_block, **costs})
        row = [f"{share:.0%}", capacity, f"{ratios['lru']:.3f}"]
        for name in [n for n in subjects if n.startswith("hinted")]:
            row += [f"{ratios[name]:.3f}", _closed(ratios[name], ratios["lru"], ratios["belady"])]
        rows.append(row + [f"{ratios['belady']:.3f}", f"{per_block:.2f}"] + [f"{c:.2f}" for c in costs.values()])
    hinted = [f"{args.hints} hit ratio", "gap closed"] if args.hints else []
    wrong = [f"{args.wrong:.0%} wrong: hit ratio", "gap closed"] if args.hints and args.wrong else []
    print(format_table(["share of distinct blocks", "capacity (blocks)", "LRU hit ratio", *hinted, *wrong,
                        "Belady hit ratio", "LRU us a block read", *(["hinted us a block read"] if hinted else [])],
                       rows,
                       {"hit ratio": "blocks read from the cache / blocks read (a request reuses its longest cached "
                                     "prefix)",
                        "gap closed": "(hinted - LRU) / (Belady - LRU): the share of what LRU misses that the hints "
                                      "won back (negative: below LRU)",
                        "LRU us a block read": "the index's CPU time (lookup, load, store, evictions) / blocks read",
                        "hinted us a block read": "the same through the daemon's own index (HintedLRU), its hints "
                                                  "included"}))
    save(args, {"trace": args.trace, "requests": len(trace.requests), "reads": reads, "distinct": distinct,
                "hints": args.hints, "wrong": args.wrong, "curve": curve}, plot)
    return 0


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = results["curve"]
    x = [100 * c["share"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [c["lru"] for c in curve], "o-", label="LRU (the daemon's, no hints)")
    if "hinted" in curve[0]:
        ax.plot(x, [c["hinted"] for c in curve], "^-", label=f"with {results['hints']} hints")
    if "hinted_wrong" in curve[0]:
        ax.plot(x, [c["hinted_wrong"] for c in curve], "v:", label=f"the same, {results['wrong']:.0%} wrong")
    ax.plot(x, [c["belady"] for c in curve], "s--", label="Belady (offline optimum)")
    ax.set_xlabel("tier capacity, % of the trace's distinct blocks")
    ax.set_ylabel("hit ratio of block reads")
    ax.set_title(f"{results['requests']} requests, {results['distinct']} distinct blocks")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format trace: one JSON object a line with hash_ids")
    p.add_argument("--shares", default="0.02,0.05,0.1,0.25,0.5,1",
                   help="tier capacities, as shares of the trace's distinct blocks")
    p.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0: all)")
    p.add_argument("--hints", choices=policy_hints.RULES, help="also replay with the hints an application would "
                   "send (session-end: a conversation's last turn stored with RELEASE; none: the hinted index "
                   "with no hints, which must equal LRU)")
    p.add_argument("--wrong", type=float, default=0.0, help="with --hints: also replay with this share of "
                   "continuing turns released as well (wrong hints)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the hit-ratio curve here (PNG)")
