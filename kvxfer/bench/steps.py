"""``kvxfer bench steps``: where a request's time goes, step by step, in every process it crosses.

Runs COMMAND (another ``kvxfer bench`` usually) with each of its Python processes, the daemons it
starts too, stamping the start and end of the named steps (``--steps``: a named set, or
``module:function`` and ``module:Class.method`` entries) on the monotonic clock, which every
process of one machine shares. Then prints, per process, each step's calls and their median and
90th-percentile milliseconds, and the merged timeline of one request: the occurrence of
``--root`` (the first step of the set unless named) of median length, in the process that ran it
most, with every step of every process that started from it until the root's next occurrence
(what it left running, such as a release sent after its answer, included).

A profiling aid for docs/benchmarks.md: each stamped call costs one line written to a file (measured
and printed at the end: a step's figure includes that cost for each stamped step nested in it).
Steps never called, or not found, are named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvxfer.bench import step_hooks
from kvxfer.core.text_table import format_table

#: Named sets of steps: a peer pull as the restoring daemon (B) and the holding one (A) run it; SGLang's
#: write-through and prefetch through its kvxfer backend, and the daemon's side of them.
STEP_SETS = {
    "peer-pull": [
        "service.lane_server:Lane._answer",
        "kvxfer.serving.pool_manager:PoolManager.run",
        "kvxfer.serving.group:CacheGroup.pin",
        "kvxfer.serving.promotion:promote",
        "kvxfer.tiers.peer:PeerTier.fetch",
        "kvxfer.peering.link:PeerLink._call",
        "service.peer_servicer:PeerServicer.PeerLease",
        "kvxfer.peering.leases:LeaseTable.grant",
        "kvxfer.peering.agent:Agent.expose",
        "kvxfer.peering.agent:Agent.learn",
        "kvxfer.serving.group:CacheGroup.prepare_store",
        "kvxfer.tiers.peer:PeerTier.read_leased",
        "kvxfer.peering.agent:Agent.read",
        "kvxfer.tiers.peer:PeerTier._verify",
        "kvxfer.serving.group:CacheGroup.publish",
        "kvxfer.tiers.peer:PeerFetch.end",
        "kvxfer.transfer.pipeline:CheckedCopier.to_pool",
        "kvxfer.serving.group:CacheGroup.unpin",
        "kvxfer.peering.link:PeerLink._release_now",
        "service.peer_servicer:PeerServicer.PeerRelease",
        "kvxfer.peering.leases:LeaseTable.release",
        "kvxfer.peering.agent:Agent.withdraw",
    ],
    "sglang": [
        "kvxfer.integrations.sglang.backend:KvxferStore.batch_set_v1",
        "kvxfer.integrations.sglang.backend:KvxferStore.batch_get_v1",
        "kvxfer.integrations.sglang.pages:PageMover._move",
        "kvxfer.client.daemon_client:Client._transfer",
        "service.lane_server:Lane._answer",
        "kvxfer.serving.pool_manager:PoolManager.run",
        "kvxfer.serving.group:CacheGroup.prepare_store",
        "kvxfer.serving.group:CacheGroup.pin",
        "kvxfer.transfer.pipeline:CheckedCopier.to_host",
        "kvxfer.transfer.pipeline:CheckedCopier.to_pool",
        "kvxfer.serving.group:CacheGroup.write_through",
        "kvxfer.serving.group:CacheGroup.publish",
        "kvxfer.serving.group:CacheGroup.unpin",
    ],
}

_SITE = """# made by kvxfer bench steps: stamp steps in this process, then run the sitecustomize this one hides
import importlib.util, os, sys
_spec = importlib.util.spec_from_file_location("_kvxfer_step_hooks", {hooks!r})
_hooks = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_hooks)
_hooks.install_from_environment()
_here = os.path.dirname(os.path.abspath(__file__))  # then the sitecustomize Python would have run
for _entry in sys.path:
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(os.path.join(_entry, "sitecustomize.py")):
        _s = importlib.util.spec_from_file_location("_next_sitecustomize", os.path.join(_entry, "sitecustomize.py"))
        _s.loader.exec_module(importlib.util.module_from_spec(_s))
        break
"""


@dataclass(frozen=True)
class Call:
    process: int
    step: str
    start: float
    end: float
    thread: str

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


def read_calls(directory: Path) -> tuple[list[Call], dict[int, str]]:
    """Every stamped call in ``directory`` (sorted by start) and each process's command line."""
    calls, argv = [], {}
    for path in sorted(directory.glob("steps.*.tsv")):
        pid = int(path.name.split(".")[1])
        for line in path.read_text().splitlines():
            if line.startswith("# "):
                argv[pid] = line[2:]
                continue
            step, start, end, thread = line.split("\t")
            calls.append(Call(pid, step, float(start), float(end), thread))
    calls.sort(key=lambda c: c.start)
    return calls, argv


def summary(calls: list[Call]) -> list[dict]:
    """Per process and step: calls, median and 90th percentile ms."""
    by = defaultdict(list)
    for c in calls:
        by[(c.process, c.step)].append(c.ms)
    rows = []
    for (pid, step), ms in sorted(by.items()):
        ms.sort()
        rows.append({"process": pid, "step": step, "calls": len(ms), "p50_ms": statistics.median(ms),
                     "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))]})
    return rows


def timeline(calls: list[Call], root: str) -> list[dict]:
    """The median-length occurrence of ``root`` (in the process that ran it most) and everything that started
    from it until root's next occurrence there, as offsets in ms from the root's start."""
    counts = defaultdict(int)
    for c in calls:
        if c.step == root:
            counts[c.process] += 1
    if not counts:
        return []
    pid = max(counts, key=counts.get)
    roots = [c for c in calls if c.step == root and c.process == pid]
    chosen = sorted(roots, key=lambda c: c.ms)[len(roots) // 2]
    after = [c.start for c in roots if c.start > chosen.start]
    until = min(after) if after else float("inf")
    return [{"process": c.process, "step": c.step, "from_ms": (c.start - chosen.start) * 1e3,
             "to_ms": (c.end - chosen.start) * 1e3, "thread": c.thread}
            for c in calls if chosen.start <= c.start < until]


def stamp_cost_us(calls: int = 20_000) -> float:
    """Microseconds one stamp adds to a call, measured here: a stamped no-op against the bare one (the
    figures of a timeline include this for every stamped step nested in them)."""
    def noop() -> None:
        return None

    with tempfile.TemporaryDirectory(prefix="kvxfer-steps-cost-") as where:
        stamped = step_hooks.timed("noop", noop, step_hooks.Recorder(where))
        best = []
        for fn in (noop, stamped):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best.append(time.perf_counter() - start)
    return max(0.0, best[1] - best[0]) / calls * 1e6


def run(args: argparse.Namespace) -> int:
    steps = [s for entry in args.steps for s in STEP_SETS.get(entry, [entry])]
    try:
        step_hooks.parse(",".join(steps))  # a malformed step is refused before anything runs
    except ValueError as exc:
        raise SystemExit(f"kvxfer bench steps: {exc}") from None
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("kvxfer bench steps: name the command to measure after --")
    with tempfile.TemporaryDirectory(prefix="kvxfer-steps-") as where:
        site = Path(where) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITE.format(hooks=step_hooks.__file__))
        env = {**os.environ, step_hooks.ENV_DIR: where, step_hooks.ENV_STEPS: ",".join(steps),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
        try:
            code = subprocess.run(command, env=env).returncode
        except OSError as exc:
            raise SystemExit(f"kvxfer bench steps: cannot run {command[0]!r}: {exc.strerror}") from None
        calls, argv = read_calls(Path(where))
    rows = summary(calls)
    names = {pid: f"{pid} ({' '.join(a.split()[:4])[:60]})" for pid, a in argv.items()}
    print(format_table(["process", "step", "calls", "p50 ms", "p90 ms"],
                       [[names.get(r["process"], r["process"]), r["step"], r["calls"], f"{r['p50_ms']:.3f}",
                         f"{r['p90_ms']:.3f}"] for r in rows]))
    called = {r["step"] for r in rows}
    never = [step for step in steps if step.partition(":")[2] not in called]
    if never:
        print(f"\nnever called (or not found): {', '.join(never)}")
    cost = stamp_cost_us()
    print(f"each stamp adds {cost:.1f} us to its call here (a stamped no-op against the bare one)")
    root = args.root or steps[0].partition(":")[2]
    events = timeline(calls, root)
    if events:
        print(f"\none {root} of median length, and what started from it until the next (ms from its start):")
        print(format_table(["process", "from", "to", "step", "thread"],
                           [[e["process"], f"{e['from_ms']:.3f}", f"{e['to_ms']:.3f}", e["step"], e["thread"]]
                            for e in events]))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "processes": argv, "steps": rows, "never": never,
                                               "stamp_us": cost, "root": root, "timeline": events}, indent=2))
    return code


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", nargs="+", default=["peer-pull"],
                   help=f"a named set ({', '.join(STEP_SETS)}) or module:function / module:Class.method entries")
    p.add_argument("--root", help="the step whose median occurrence the timeline follows (default: the first)")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to measure")
