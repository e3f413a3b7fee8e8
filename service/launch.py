"""Moved to ``kvxfer.bench.launch`` (issue 48: benchmarks and harnesses live in ``kvxfer.bench``). This name
re-exports it for one more release, for tests and tools written against it; import the new one."""

from kvxfer.bench.launch import ROOT, DaemonProcess, spawn

__all__ = ["ROOT", "DaemonProcess", "spawn"]
