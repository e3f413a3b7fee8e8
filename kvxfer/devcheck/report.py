"""Stage runner: each stage's result lands in devcheck.json as soon as it is known.

Each stage has a time cap (a stage past it is stopped and recorded as failed) and the
whole run a budget: stages left when it is spent are recorded as skipped, so a run cut
short by the lent machine's limit still reports what it measured, most valuable first.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

Stage = Callable[[dict], dict]
#: Seconds a stage may run unless it says otherwise, and the whole run's budget.
STAGE_CAP_S, BUDGET_S = 120.0, 480.0


class StageTimeout(Exception):
    """A stage ran past its time cap."""


def _expire(signum, frame) -> None:
    raise StageTimeout("past its time cap")


def run_stages(out: str, stages: list[tuple], quick: bool = False, prepared: dict | None = None,
               budget_s: float = BUDGET_S, settings: dict | None = None) -> int:
    """Run every stage ((name, fn) or (name, fn, cap_s); a failed one does not stop the others);
    0 when all passed. ``prepared``: what the bootstrap did, recorded first; ``settings``: given to
    every stage (sizes, the daemon's command: the tests run stages on the CUDA simulator so)."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "devcheck.json"
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "prepared": prepared or {},
                    "stages": []}
    context: dict = {"quick": quick, "prepared": prepared or {}, **(settings or {})}
    failed, began = 0, time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _expire)
    for name, stage, *cap in stages:
        start = time.perf_counter()
        left = budget_s - (start - began)
        if left <= 1:
            report["stages"].append({"stage": name, "ok": False, "skipped": "the run's time budget was spent"})
            failed += 1
            continue
        print(f"[devcheck] {name} ...", flush=True)
        try:
            signal.setitimer(signal.ITIMER_REAL, min(cap[0] if cap else STAGE_CAP_S, left))
            entry = {"stage": name, "ok": True, "result": stage(context)}
        except Exception as exc:  # a stage's failure (or time-out) is a result: record it and go on
            failed += 1
            entry = {"stage": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=8)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        entry["seconds"] = round(time.perf_counter() - start, 3)
        report["stages"].append(entry)
        _write(path, report)
        print(f"[devcheck] {name}: {'ok' if entry['ok'] else 'FAILED ' + entry['error']} "
              f"({entry['seconds']} s)", flush=True)
    signal.signal(signal.SIGALRM, previous)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["failed_stages"] = failed
    _write(path, report)
    return 0 if failed == 0 else 1


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)  # a reader never sees half a file
