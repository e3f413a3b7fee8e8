"""``kvxfer bench peer-transfer`` end to end at a tiny size: two real daemons, every figure filled (not checked)."""

import json

import pytest

from kvxfer.cli import commands as cli

pytestmark = pytest.mark.e2e


def test_bench_peer_transfer_reports_the_round_trip_nixl_and_cpu_beside_each_pull(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["bench", "peer-transfer", "--transports", "shm", "--batches", "1", "2", "--reps", "2",
                     "--blocks", "16", "--json", str(out)]) == 0
    assert "whole / RTT" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["way"], r["batch"]) for r in rows] == [("pull", 1), ("push", 1), ("pull", 2), ("push", 2)]
    for r in rows:
        assert r["rtt_ms"] > 0 and r["whole_ms"] > 0 and r["nixl_gbps"] > 0 and r["whole_vs_rtt"] > 0
        assert r["cpu_s_per_gb"] > 0 and r["memcpy_cpu_s_per_gb"] > 0 and r["cpu_vs_memcpy"] > 0
