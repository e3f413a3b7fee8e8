"""``kvxfer bench sglang`` end to end at a tiny size, with SGLang's own controller (figures are not checked)."""

import json

from service import program as cli


def test_bench_sglang_splits_the_backend_from_sglang_and_checks_the_bytes(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert cli.main(["bench", "sglang", "--pages", "64", "--layers", "2", "--reps", "2", "--host-mib", "64",
                     "--subjects", "kvxfer zero copy", "file", "--dir", str(tmp_path), "--json", str(out), "--plot", str(png)]) == 0
    assert "set backend / copy" in capsys.readouterr().out
    rows = {r["subject"]: r for r in json.loads(out.read_text())["subjects"]}
    assert set(rows) == {"kvxfer zero copy", "file", "copy"}
    for name in ("kvxfer zero copy", "file"):
        row = rows[name]
        assert 0 < row["set backend / copy"] <= row["set / copy"] and 0 < row["get backend / copy"] <= row["get / copy"]
        assert row["set SGLang ms"] >= 0 and row["get SGLang ms"] >= 0
        assert row["set CPU s/GB"] > 0 and row["get CPU s/GB"] > 0 and row["set CPU / copy"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_steps_follows_a_hicache_batch_into_the_daemon(tmp_path, capsys):
    """``kvxfer bench steps --steps sglang``: each named step resolves, and a real write-through's batches are
    stamped in SGLang's process and in the daemon it started."""
    import sys

    from kvxfer.bench import step_hooks
    from kvxfer.bench.steps import STEP_SETS

    for step in STEP_SETS["sglang"]:
        assert callable(step_hooks.resolve(step)), step
    out = tmp_path / "steps.json"
    assert cli.main(["bench", "steps", "--steps", "sglang", "--json", str(out), "--", sys.executable, "-m",
                     "service.program", "bench", "sglang", "--pages", "64", "--layers", "2", "--reps", "1",
                     "--host-mib", "64", "--subjects", "kvxfer zero copy", "--dir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    where = {}
    for row in results["steps"]:
        where.setdefault(row["step"], set()).add(row["process"])
    assert len(where["KvxferStore.batch_set_v1"]) == 1 and len(where["CheckedCopier.to_host"]) == 1
    assert where["KvxferStore.batch_set_v1"] != where["CheckedCopier.to_host"]  # two processes
    assert [e["step"] for e in results["timeline"]][:2] == ["KvxferStore.batch_set_v1", "PageMover._move"]
    assert "CheckedCopier.to_host" in {e["step"] for e in results["timeline"]}
