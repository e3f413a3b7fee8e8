"""``kvxfer bench policy-bounds TRACE``: how much of the gap between LRU and Belady a policy could close,
and what it would have to know to close it.

Each bound is a policy run through the real block index exactly as ``bench policy`` runs LRU and Belady
(lookup, load of the hit prefix, two-phase store, evictions); it ranks the evictable slots by what it is
told, the deeper block of a tie first (a block is worth nothing without its parent):

- ``history-oracle``: Belady's next use, but only for blocks read before; a block on its first read
  knows nothing and goes first, least recently used first (after blocks read before that are never
  read again). The most a policy could reach that predicted a block's future perfectly from its past.
- ``hazard``: the chance a block is read within the next ``H`` requests, given its reads so far (1 to
  6 or more) and the requests since its last read, counted from this very trace (fitted in
  hindsight): what ranking by frequency and recency could do with the best table there is.
- ``queue-Q``: LRU, except that a block one of the next ``Q`` requests reads goes last: what an
  engine's queue of ``Q`` waiting requests would tell the tier.

None is a policy the daemon could run (each knows the trace); they say where the gap is.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvxfer.bench import policy
from kvxfer.bench.common import Progress, save
from kvxfer.core.records import TierKind
from kvxfer.core.text_table import format_table
from kvxfer.index.block_index import BlockIndex
from kvxfer.index.eviction import Evictable, EvictionPolicy

MAX_COUNT = 6  # reads so far, capped: the hazard table's rows
QUEUES = (8, 32, 128)


class Ranked(EvictionPolicy):
    """Slots ranked by a score of their features, computed when victims are wanted (highest goes first)."""

    def __init__(self, capacity: int, score: Callable[[Ranked, np.ndarray], np.ndarray]) -> None:
        self.score = score
        self.now = 0  # the request being replayed
        self.entry = np.zeros(capacity, dtype=bool)
        self.last = np.zeros(capacity, dtype=np.int64)  # the request that last read the block
        self.count = np.zeros(capacity, dtype=np.int64)  # reads of the block so far
        self.depth = np.zeros(capacity, dtype=np.int64)  # its position in that request
        self.next_use = np.zeros(capacity, dtype=np.int64)  # the request that reads it next (oracle)

    def set(self, slot: int, now: int, count: int, depth: int, next_use: int) -> None:
        self.entry[slot] = True
        self.last[slot], self.count[slot], self.depth[slot], self.next_use[slot] = now, count, depth, next_use

    def used(self, slots: np.ndarray) -> None:
        pass  # the bench sets each slot's features

    def forget(self, slots: np.ndarray) -> None:
        self.entry[slots] = False

    def victims(self, n: int, evictable: Evictable) -> np.ndarray:
        candidates = np.flatnonzero(self.entry)
        return self.ordered(candidates[evictable(candidates)])[:n]

    def ordered(self, slots: np.ndarray) -> np.ndarray:
        return slots[np.lexsort((-self.depth[slots], -self.score(self, slots)))]


def history_oracle(requests: int) -> Callable[[Ranked, np.ndarray], np.ndarray]:
    def score(p: Ranked, s: np.ndarray) -> np.ndarray:
        known = np.where(p.next_use[s] == policy.NEVER, 4 * requests, p.next_use[s])
        return np.where(p.count[s] >= 2, known, 3 * requests - p.last[s]).astype(np.float64)
    return score


def queue(q: int, requests: int) -> Callable[[Ranked, np.ndarray], np.ndarray]:
    def score(p: Ranked, s: np.ndarray) -> np.ndarray:
        waiting = p.next_use[s] <= p.now + q
        return (np.where(waiting, 0, requests) + requests - p.last[s]).astype(np.float64)
    return score


@dataclass(frozen=True)
class Hazard:
    """Per count of reads so far, the sorted gaps (in requests) from each read to the next (never: NEVER)."""

    gaps: list[np.ndarray]
    horizon: int

    @classmethod
    def fit(cls, trace: policy.Trace, horizon: int) -> Hazard:
        rows: list[list[int]] = [[] for _ in range(MAX_COUNT + 1)]
        counts: dict[int, int] = {}
        for i, blocks in enumerate(trace.requests):
            for b, use in zip(blocks, trace.next_use[i]):
                counts[b] = counts.get(b, 0) + 1
                rows[min(counts[b], MAX_COUNT)].append(policy.NEVER if use == policy.NEVER else use - i)
        return cls([np.sort(np.asarray(r, dtype=np.int64)) for r in rows], horizon)

    def score(self, p: Ranked, s: np.ndarray) -> np.ndarray:
        chance = np.zeros(len(s))
        age = p.now - p.last[s]
        capped = np.minimum(p.count[s], MAX_COUNT)
        for c in range(1, MAX_COUNT + 1):
            pick = capped == c
            gaps = self.gaps[c]
            if not pick.any() or not len(gaps):
                continue
            a = age[pick]
            alive = len(gaps) - np.searchsorted(gaps, a, side="right")
            soon = np.searchsorted(gaps, a + self.horizon, side="right") - (len(gaps) - alive)
            chance[pick] = np.where(alive > 0, soon / np.maximum(alive, 1), 0.0)
        return -chance


def replay(trace: policy.Trace, capacity: int, score: Callable[[Ranked, np.ndarray], np.ndarray]) -> int:
    """Blocks read from a ``capacity``-slot index whose policy ranks slots by ``score``."""
    ranked = Ranked(capacity, score)
    index = BlockIndex(TierKind.HOST, capacity, ranked)
    counts: dict[int, int] = {}
    hits = 0
    for i, blocks in enumerate(trace.requests):
        ranked.now = i
        keys = [b.to_bytes(8, "little", signed=True) for b in blocks]
        present = index.contains(policy.NAMESPACE, keys)
        prefix = next((k for k, p in enumerate(present) if not p), len(keys))
        if prefix:
            index.complete_load(index.prepare_load(policy.NAMESPACE, keys[:prefix]).slots)
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        for k, b in enumerate(blocks):  # blocks held already: their features before room is made
            if present[k]:
                ranked.set(index.locate(policy.NAMESPACE, keys[k]), i, counts[b], k, trace.next_use[i][k])
        plan = index.prepare_store(policy.NAMESPACE, keys)
        for slot, k in zip(plan.slots, plan.positions):
            ranked.set(slot, i, counts[blocks[k]], k, trace.next_use[i][k])
        index.complete_store(plan.slots, [1] * len(plan.slots))
        hits += prefix
    return hits


def bounds(trace: policy.Trace, horizon: int) -> dict[str, Callable[[Ranked, np.ndarray], np.ndarray]]:
    n = len(trace.requests)
    found = {"history-oracle": history_oracle(n), f"hazard (H={horizon})": Hazard.fit(trace, horizon).score}
    found.update({f"queue-{q}": queue(q, n) for q in QUEUES})
    return found


def run(args: argparse.Namespace) -> int:
    trace = policy.load(args.trace, args.requests)
    distinct, reads = trace.distinct, trace.reads
    shares = [float(s) for s in args.shares.split(",")]
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise SystemExit("--shares: comma-separated shares of the distinct blocks, each in (0, 1]")
    if args.horizon < 1:
        raise SystemExit("--horizon: at least 1 request")
    print(f"{len(trace.requests)} requests, {reads} block reads, {distinct} distinct blocks")
    named = bounds(trace, args.horizon)
    progress = Progress(len(shares) * (2 + len(named)))
    rows, results = [], []
    for share in shares:
        capacity = max(1, round(distinct * share))
        ratio = {}
        for name in ("lru", "belady"):
            ratio[name] = policy.replay(trace, capacity, name)[0] / reads
            progress.step(f"{capacity} blocks ({share:.0%}), {name}: hit ratio {ratio[name]:.3f}")
        gap = ratio["belady"] - ratio["lru"]
        closed = {}
        for name, score in named.items():
            ratio[name] = replay(trace, capacity, score) / reads
            closed[name] = (ratio[name] - ratio["lru"]) / gap if gap > 0 else 0.0
            progress.step(f"{capacity} blocks ({share:.0%}), {name}: hit ratio {ratio[name]:.3f}, "
                          f"{closed[name]:+.2f} of the gap")
        results.append({"share": share, "capacity_blocks": capacity, "hit_ratio": ratio, "gap_closed": closed})
        rows.append([f"{share:.0%}", f"{ratio['lru']:.3f}", f"{ratio['belady']:.3f}",
                     *(f"{ratio[n]:.3f} ({closed[n]:+.2f})" for n in named)])
    print(format_table(["share of distinct blocks", "LRU", "Belady", *named], rows,
                       {"(x)": "the share of the gap between LRU and Belady the bound closes"}))
    save(args, {"trace": args.trace, "requests": len(trace.requests), "reads": reads, "distinct": distinct,
                "bounds": list(named), "results": results}, plot)
    return 0


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rows = results["bounds"], results["results"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * width for i in range(len(rows))], [r["gap_closed"][name] for r in rows], width, label=name)
    ax.axhline(1 / 3, color="black", linestyle="--", linewidth=1, label="a third of the gap")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"{r['share']:.0%}" for r in rows])
    ax.set_xlabel("tier capacity, share of the trace's distinct blocks")
    ax.set_ylabel("share of the LRU-to-Belady gap closed")
    ax.set_title(f"what a policy would need to know ({results['requests']} requests)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format trace: one JSON object a line with hash_ids")
    p.add_argument("--shares", default="0.05,0.1,0.25", help="tier capacities, as shares of the distinct blocks")
    p.add_argument("--horizon", type=int, default=100, help="the hazard bound's horizon, in requests")
    p.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0: all)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the gap closed by each bound here (PNG)")
