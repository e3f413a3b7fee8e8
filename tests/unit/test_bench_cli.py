"""The benchmark commands run end to end at tiny sizes (figures are not checked here)."""

import json

from kvxfer import cli


def test_bench_store_smoke(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert cli.main(["bench", "store", "--spans-kib", "16", "--batch", "8", "--layouts", "BLHNC,LBHNC",
                     "--pool-mib", "4", "--min-mib", "1", "--reps", "1", "--json", str(out_json),
                     "--plot", str(out_png)]) == 0
    captured = capsys.readouterr()
    assert "offload/(copy+hash)" in captured.out
    assert "[2/2" in captured.err  # progress
    results = json.loads(out_json.read_text())
    assert [r["descriptors_per_block"] for r in results] == [1, 16]
    assert all(r["offload_gbps"] > 0 and r["restore_gbps"] > 0 for r in results)
    assert out_png.read_bytes()[:4] == b"\x89PNG"
