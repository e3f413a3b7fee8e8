"""Timing, progress and table helpers shared by the benchmarks."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

GB = 1e9


def interleaved(subjects: dict[str, Callable[[], object]], reps: int,
                setup: dict[str, Callable[[], object]] | None = None, warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of each subject per repetition, the subjects run in turn in every repetition.

    ``setup[name]`` runs untimed before that subject; the first ``warmup`` repetitions are dropped.
    """
    times: dict[str, list[float]] = {name: [] for name in subjects}
    for rep in range(warmup + reps):
        for name, fn in subjects.items():
            if setup and name in setup:
                setup[name]()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed)
    return times


class Progress:
    """One line per step on stderr, so long runs show where they are."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.stream = stream  # None: whatever sys.stderr is when a step is printed

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        print(f"[{self.done}/{self.total} {elapsed:6.1f}s] {label}", file=self.stream or sys.stderr, flush=True)


FASTER = "throughput / the baseline's, median of per-repetition ratios: above 1 is faster than the baseline"
SLOWER = "time / the baseline's: above 1 is slower than the baseline"


def human_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def add_block_arguments(p, blocks: int = 1024, reps: int = 3) -> None:
    """--blocks, the block geometry (default: the embedded pool's, 192 KiB blocks) and --reps."""
    p.add_argument("--blocks", type=int, default=blocks)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=2, help="KV heads")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=reps)


def save(args, results, plot: Callable[[object, str], None] | None = None) -> None:
    """Write a finished run's results as JSON (``--json``) and its plot (``--plot``), when asked."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if plot is not None and getattr(args, "plot", None):
        plot(results, args.plot)


def wait_for(check, what: str, seconds: float = 120) -> None:
    """Poll ``check`` until it holds; a bench that waits longer than ``seconds`` stops, saying for what."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {what}: not within {seconds:g} s")
        time.sleep(0.02)
