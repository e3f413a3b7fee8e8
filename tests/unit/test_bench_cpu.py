"""``kvxfer.bench.cpu_time``: the CPU time of the processes a benchmark involves, beside its wall time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvxfer.bench.cpu_time import CpuMeter, Figures, Samples, cpu_seconds, measured

BURN = "import sys\nx = 0\nfor i in range(3_000_000): x += i\nsys.stdout.write('done\\n'); sys.stdout.flush()\n" \
       "sys.stdin.read()"


def _burner() -> subprocess.Popen:
    """A child that burns some CPU, says so, then waits (alive) until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "done\n"
    return proc


def test_another_process_is_read_to_the_nanosecond_and_kept_after_it_exits():
    proc = _burner()
    try:
        used = cpu_seconds(proc.pid)
        assert used > 0.01  # three million additions: far more than one 10 ms tick
        meter = CpuMeter([proc.pid], include_self=False)
        first = meter.now()
        assert first >= used
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    with pytest.raises(OSError):
        cpu_seconds(proc.pid)  # reaped: nothing to read
    assert meter.now() == first  # what it used still counts


def test_this_process_is_counted_unless_told_not_to():
    busy = CpuMeter()
    idle = CpuMeter(include_self=False)
    b0, i0 = busy.now(), idle.now()
    sum(i * i for i in range(500_000))
    assert busy.now() > b0 and idle.now() == i0 == 0.0


def test_measured_interleaves_drops_the_warm_up_and_charges_each_subject_its_own_processes():
    calls = []
    proc = _burner()
    try:
        everyone, alone = CpuMeter([proc.pid]), CpuMeter()
        got = measured({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3,
                       meter={"a": everyone, "b": alone}, setup={"b": lambda: calls.append("setup")}, warmup=1)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert calls == ["a", "setup", "b"] * 4
    assert all(len(s.wall) == len(s.cpu) == 3 for s in got.values())
    assert all(c >= 0 for s in got.values() for c in s.cpu)


def test_figures_are_medians_of_per_repetition_ratios():
    subject = Samples(wall=[2.0, 4.0, 30.0], cpu=[1.0, 3.0, 2.0])
    baseline = Samples(wall=[1.0, 1.0, 10.0], cpu=[1.0, 1.0, 1.0])
    f = Figures.of(subject, baseline, nbytes=2_000_000_000)
    assert f.wall_ratio == 3.0 and f.cpu_ratio == 2.0
    assert f.wall_ms == 4000.0 and f.cpu_s_per_gb == 1.0 and f.base_cpu_s_per_gb == 0.5
