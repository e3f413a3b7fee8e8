"""CPU time of every process a benchmark involves, beside its wall time.

Wall-clock ratios on a shared 2-core machine move 10-25% from run to run; the CPU time a request
costs (user and system, of the daemon, the client and the engine harness together) moves far
less, and it is what a node pays for the work however busy it is. ``CpuMeter`` reads each
process's CPU clock (Linux's per-process clock: every thread, alive or exited, to the
nanosecond), so one request's share is measured, not the 10 ms ticks of ``/proc/PID/stat``.

``measured`` runs subjects in turn in every repetition (interleaved, so that a slow minute of the
machine hits them all) and keeps each one's wall and CPU seconds; ``Figures`` gives medians and
the ratios to a baseline.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvxfer.bench.common import GB

_CPUCLOCK_SCHED = 2  # Linux: a process's clock id is ((~pid) << 3) | CPUCLOCK_SCHED (user + system, all threads)


def cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` has used so far (OSError: gone, or not visible here)."""
    return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)


class CpuMeter:
    """The CPU seconds of a set of processes (this one included unless told otherwise), summed."""

    def __init__(self, pids: Iterable[int] = (), include_self: bool = True) -> None:
        self._pids: list[int] = ([os.getpid()] if include_self else []) + [p for p in pids if p != os.getpid()]
        self._last: dict[int, float] = {}  # a process's last reading: one that exits keeps what it used

    def add(self, pid: int) -> None:
        if pid not in self._pids:
            self._pids.append(pid)

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    def now(self) -> float:
        for pid in self._pids:
            try:
                self._last[pid] = cpu_seconds(pid)
            except OSError:
                pass  # exited (or reaped): what it used until the last reading still counts
        return sum(self._last.values())


@dataclass
class Samples:
    """One subject's wall and CPU seconds, a pair per repetition."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def median_wall(self) -> float:
        return statistics.median(self.wall)

    def median_cpu(self) -> float:
        return statistics.median(self.cpu)


def measured(subjects: dict[str, Callable[[], object]], reps: int, meter: CpuMeter | Mapping[str, CpuMeter],
             setup: dict[str, Callable[[], object]] | None = None, warmup: int = 1) -> dict[str, Samples]:
    """Wall and CPU seconds of each subject per repetition, the subjects run in turn in every
    repetition. ``meter``: the processes counted, or for each subject its own (a baseline that runs in
    this process alone is not charged for what the idle daemons' threads do meanwhile).
    ``setup[name]`` runs untimed before that subject; the first ``warmup`` repetitions are dropped."""
    out = {name: Samples() for name in subjects}
    for rep in range(warmup + reps):
        for name, fn in subjects.items():
            if setup and name in setup:
                setup[name]()
            counted = meter if isinstance(meter, CpuMeter) else meter[name]
            cpu0 = counted.now()
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
            cpu = counted.now() - cpu0
            if rep >= warmup:
                out[name].wall.append(wall)
                out[name].cpu.append(cpu)
    return out


@dataclass(frozen=True)
class Figures:
    """A subject beside its baseline, from interleaved samples of both (the same bytes each)."""

    wall_ms: float  # the subject's median request
    cpu_ms: float
    cpu_s_per_gb: float  # CPU seconds of every process involved per GB moved (median)
    wall_ratio: float  # subject / baseline, median of per-repetition ratios: above 1 is slower
    cpu_ratio: float
    base_cpu_s_per_gb: float

    @classmethod
    def of(cls, subject: Samples, baseline: Samples, nbytes: int) -> Figures:
        gb = nbytes / GB
        return cls(subject.median_wall() * 1e3, subject.median_cpu() * 1e3, subject.median_cpu() / gb,
                   statistics.median(s / b for s, b in zip(subject.wall, baseline.wall)),
                   statistics.median(s / max(b, 1e-9) for s, b in zip(subject.cpu, baseline.cpu)),
                   baseline.median_cpu() / gb)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


CPU_NOTE = ("user and system seconds of every process involved (the daemons, the client, the engine "
            "harness), read from each process's CPU clock around every request; ratios are medians of "
            "per-repetition ratios to the baseline run beside it: above 1 costs more than the baseline")
