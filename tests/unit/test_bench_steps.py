"""``kvxfer bench steps``: every Python process of the measured command stamps the named steps."""

import json
import sys
import textwrap

import pytest

from kvxfer.bench import step_hooks
from kvxfer.bench.steps import STEP_SETS, Call, timeline
from service import program as cli

WORK = textwrap.dedent("""
    import asyncio, subprocess, sys, time

    class Work:
        def outer(self):
            time.sleep(0.002)
            self.inner()
            return Work.helper()

        def inner(self):
            time.sleep(0.001)

        @staticmethod
        def helper():
            return 7

        async def later(self):
            await asyncio.sleep(0.001)

    def main(child):
        w = Work()
        for _ in range(3):
            assert w.outer() == 7
        asyncio.run(w.later())
        if child:  # a process started by the measured one is measured too
            subprocess.run([sys.executable, "-c", "import work; work.main(False)"], check=True)
""")


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "work.py").write_text(WORK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_steps_are_stamped_in_every_process(work, tmp_path, capsys):
    out = tmp_path / "steps.json"
    steps = ["work:Work.outer", "work:Work.inner", "work:Work.helper", "work:Work.later"]
    assert cli.main(["bench", "steps", "--steps", *steps, "--json", str(out), "--",
                     sys.executable, "-c", "import work; work.main(True)"]) == 0
    results = json.loads(out.read_text())
    assert len(results["processes"]) == 2  # the command and the child it started
    counts = {}
    for row in results["steps"]:
        counts.setdefault(row["step"], []).append(row["calls"])
    assert counts == {"Work.outer": [3, 3], "Work.inner": [3, 3], "Work.helper": [3, 3], "Work.later": [1, 1]}
    outer = [r for r in results["steps"] if r["step"] == "Work.outer"]
    assert all(r["p50_ms"] >= 3.0 for r in outer)  # it contains its sleeps: the real call was timed
    # the timeline follows one outer call: it, then its inner and helper calls, in that order and inside it
    events = results["timeline"]
    assert [e["step"] for e in events[:3]] == ["Work.outer", "Work.inner", "Work.helper"]
    assert events[0]["from_ms"] == 0.0 and all(e["to_ms"] <= events[0]["to_ms"] for e in events[1:3])
    assert "Work.inner" in capsys.readouterr().out
    assert results["never"] == [] and results["stamp_us"] > 0


def test_a_forked_child_records_in_a_file_of_its_own_and_unknown_steps_are_named(work, tmp_path, capsys):
    out = tmp_path / "steps.json"
    fork = ("import os, work; pid = os.fork(); work.Work().inner(); "
            "os._exit(0) if pid == 0 else os.waitpid(pid, 0)")
    assert cli.main(["bench", "steps", "--steps", "work:Work.inner", "work:Work.missing", "--json", str(out), "--",
                     sys.executable, "-c", fork]) == 0
    results = json.loads(out.read_text())
    assert [(r["step"], r["calls"]) for r in results["steps"]] == [("Work.inner", 1), ("Work.inner", 1)]
    assert len({r["process"] for r in results["steps"]}) == 2
    assert results["never"] == ["work:Work.missing"]
    assert "never called (or not found): work:Work.missing" in capsys.readouterr().out


def test_the_commands_exit_status_is_kept(work):
    assert cli.main(["bench", "steps", "--steps", "work:Work.outer", "--", sys.executable, "-c",
                     "raise SystemExit(3)"]) == 3


def test_a_malformed_step_is_refused_before_anything_runs(work, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(SystemExit, match="module:function"):
        cli.main(["bench", "steps", "--steps", "work.Work.outer", "--", sys.executable, "-c",
                  f"open({str(marker)!r}, 'w')"])
    assert not marker.exists()


def test_no_command_or_one_that_cannot_run_is_refused_plainly(work):
    with pytest.raises(SystemExit, match="name the command"):
        cli.main(["bench", "steps", "--steps", "work:Work.outer", "--"])
    with pytest.raises(SystemExit, match="cannot run"):
        cli.main(["bench", "steps", "--steps", "work:Work.outer", "--", "/nonexistent/kvxfer-nothing"])


def test_the_sitecustomize_it_hides_still_runs(work, tmp_path, monkeypatch):
    site = tmp_path / "theirs"
    site.mkdir()
    marker = tmp_path / "theirs-ran"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}:{work}")
    assert cli.main(["bench", "steps", "--steps", "work:Work.outer", "--", sys.executable, "-c", "pass"]) == 0
    assert marker.exists()


@pytest.mark.parametrize("step", STEP_SETS["peer-pull"])
def test_each_named_step_exists(step):
    """A renamed function would leave its step silently unstamped: each must resolve."""
    assert callable(step_hooks.resolve(step))


def test_the_timeline_follows_the_median_root_until_the_next():
    calls = [Call(1, "root", s, s + d, "t") for s, d in ((0.0, 0.001), (1.0, 0.003), (2.0, 0.002))]
    calls += [Call(2, "there", 2.5, 2.6, "u"), Call(2, "before", 1.9, 1.95, "u"), Call(3, "root", 0.5, 0.6, "v")]
    events = timeline(sorted(calls, key=lambda c: c.start), "root")
    assert [(e["process"], e["step"]) for e in events] == [(1, "root"), (2, "there")]
    assert events[1]["from_ms"] == pytest.approx(500.0)
