"""Stage runner: each stage's result lands in devcheck.json as soon as it is known."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

Stage = Callable[[dict], dict]


def run_stages(out: str, stages: list[tuple[str, Stage]], quick: bool = False) -> int:
    """Run every stage (a failed one does not stop the others); 0 when all passed."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "devcheck.json"
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stages": []}
    context: dict = {"quick": quick}
    failed = 0
    for name, stage in stages:
        start = time.perf_counter()
        print(f"[devcheck] {name} ...", flush=True)
        try:
            entry = {"stage": name, "ok": True, "result": stage(context)}
        except Exception as exc:  # a stage's failure is a result: record it and go on
            failed += 1
            entry = {"stage": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=8)}
        entry["seconds"] = round(time.perf_counter() - start, 3)
        report["stages"].append(entry)
        _write(path, report)
        print(f"[devcheck] {name}: {'ok' if entry['ok'] else 'FAILED ' + entry['error']} "
              f"({entry['seconds']} s)", flush=True)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["failed_stages"] = failed
    _write(path, report)
    return 0 if failed == 0 else 1


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)  # a reader never sees half a file
