"""Stamps the start and end of named functions in this process (``kvxfer bench steps``).

Loaded at interpreter start by the ``sitecustomize`` that ``kvxfer bench steps`` puts first on
``PYTHONPATH``, so every Python process of the measured command (daemons and engines too) stamps
the same steps. A step is ``module:function`` or ``module:Class.method``; it is wrapped when its
module is first imported (or at once, if it already is). Each call appends one line to
``<dir>/steps.<pid>.tsv``: the step, its start and end on the monotonic clock (one clock for every
process on a machine) and the thread. The first line names the process (its argv).

A profiling aid, never loaded by the daemon itself: each wrapped call costs one line written to
that file (``kvxfer bench steps`` measures it in its own process and prints it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable

ENV_DIR = "KVXFER_STEPS_DIR"  # where records go
ENV_STEPS = "KVXFER_STEPS"  # the steps, comma-separated


class Recorder:
    """Writes one line a call to this process's file, kept open and line-buffered (one write a call, so
    that a process killed mid-run keeps what it recorded); a lock, as calls end on many threads. A
    forked child gets a file and a lock of its own."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._open()
        os.register_at_fork(after_in_child=self._open)

    def _open(self) -> None:
        self._lock = threading.Lock()
        self._file = open(os.path.join(self.directory, f"steps.{os.getpid()}.tsv"), "a", buffering=1)
        self._file.write("# " + " ".join(sys.argv).replace("\n", " ") + "\n")

    def record(self, step: str, start: float, end: float) -> None:
        line = f"{step}\t{start:.7f}\t{end:.7f}\t{threading.current_thread().name}\n"
        with self._lock:
            self._file.write(line)


def timed(step: str, fn: Callable, recorder: Recorder) -> Callable:
    """``fn`` stamped as ``step`` (a coroutine function stays one)."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def stamped_async(*args, **kwargs):
            start = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                recorder.record(step, start, time.monotonic())
        return stamped_async

    @functools.wraps(fn)
    def stamped(*args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.record(step, start, time.monotonic())
    return stamped


def wrap_module(module, names: list[str], recorder: Recorder) -> None:
    """Wrap ``names`` (``function`` or ``Class.method``) in ``module``; a name it lacks is skipped."""
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = getattr(module, owner_name, None) if owner_name else module
        raw = owner.__dict__.get(attr) if owner is not None else None
        if raw is None:
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(owner, attr, type(raw)(timed(name, raw.__func__, recorder)))
        elif callable(raw):
            setattr(owner, attr, timed(name, raw, recorder))


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps a module's steps right after the module runs."""

    def __init__(self, steps: dict[str, list[str]], recorder: Recorder) -> None:
        self.steps, self.recorder = steps, recorder

    def find_spec(self, fullname, path=None, target=None):
        names = self.steps.get(fullname)
        if names is None:
            return None
        sys.meta_path.remove(self)  # find it the usual way
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            wrap_module(module, names, self.recorder)
        spec.loader.exec_module = exec_module
        return spec


def parse(steps: str) -> dict[str, list[str]]:
    """``"a.b:f,a.b:C.m"`` -> {"a.b": ["f", "C.m"]}."""
    out: dict[str, list[str]] = {}
    for step in filter(None, (s.strip() for s in steps.split(","))):
        module, sep, name = step.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"a step is module:function or module:Class.method, got {step!r}")
        out.setdefault(module, []).append(name)
    return out


def resolve(step: str):
    """What ``step`` names, imported (a check that a step set still names real functions)."""
    (module, names), = parse(step).items()
    owner = importlib.import_module(module)
    for part in names[0].split("."):
        owner = getattr(owner, part)
    return owner


def install(directory: str, steps: str) -> None:
    recorder = Recorder(directory)
    wanted = parse(steps)
    for module, names in wanted.items():
        if module in sys.modules:
            wrap_module(sys.modules[module], names, recorder)
    sys.meta_path.insert(0, _Finder({m: n for m, n in wanted.items() if m not in sys.modules}, recorder))


def install_from_environment() -> None:
    if os.environ.get(ENV_DIR) and os.environ.get(ENV_STEPS):
        install(os.environ[ENV_DIR], os.environ[ENV_STEPS])
