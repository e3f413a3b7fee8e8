"""``kvxfer bench sglang`` end to end at a tiny size, with SGLang's own controller (figures are not checked)."""

import json

from service import cli


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
    assert png.read_bytes()[:4] == b"\x89PNG"
