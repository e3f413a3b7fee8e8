"""``python -m kvxfer.devcheck --out DIR`` (``make devcheck``; ``kvxfer devcheck`` where installed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvxfer.devcheck.report import run_stages

NO_GPU_EXIT = 3
ROOT = Path(__file__).resolve().parents[2]  # the checkout (the device check runs from one)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="devcheck-out", help="directory for devcheck.json")
    p.add_argument("--quick", action="store_true", help="smaller bandwidth measurements (a first look)")


def run(args: argparse.Namespace) -> int:
    from kvxfer.devcheck.bootstrap import REEXEC, loaded, prepare

    prepared = prepare(ROOT)  # before the daemon's modules are imported: they come from the carried wheels
    if prepared["packages"]["reexec"]:  # one was imported before: this process keeps it; a new one will not
        os.environ[REEXEC] = prepared["packages"]["target"]
        os.execv(sys.executable, [sys.executable, "-m", "kvxfer.devcheck", "--out", args.out,
                                  *(["--quick"] if args.quick else [])])
    print("[devcheck] loaded: " + "; ".join(loaded()), flush=True)  # the first line: what, from where
    try:
        import torch
    except ImportError:  # a Python without torch (make devcheck runs the system python3): one line
        print(f"kvxfer devcheck: {sys.executable} has no torch; run it with the Python that has torch "
              "and CUDA (make devcheck PYTHON=...)")
        return NO_GPU_EXIT
    if not torch.cuda.is_available():
        print("kvxfer devcheck: no GPU here (torch sees no CUDA device); nothing to check; README.md (Status) says what "
              "has not run on a GPU")
        return NO_GPU_EXIT
    print(f"[devcheck] prepared: {prepared}", flush=True)
    from kvxfer.devcheck import stages
    from kvxfer.devcheck.plot import plot

    status = run_stages(args.out, stages.STAGES, quick=args.quick, prepared=prepared)
    report = json.loads((Path(args.out) / "devcheck.json").read_text())
    try:
        plot(report, str(Path(args.out) / "devcheck.png"))
    except ImportError:
        print("kvxfer devcheck: matplotlib is not installed; no plot (python -m kvxfer.devcheck.plot draws one later)")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvxfer devcheck", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
