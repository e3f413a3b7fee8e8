"""The benchmark commands run end to end at tiny sizes (figures are not checked here)."""

import json

import pytest

from service import program as cli


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


def test_bench_kernels_smoke(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert cli.main(["bench", "kernels", "--reps", "3", "--json", str(out)]) == 0
    assert "slot mapping us" in capsys.readouterr().out
    assert [r["tokens"] for r in json.loads(out.read_text())] == [256, 16384]


def test_bench_checksum_smoke(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert cli.main(["bench", "checksum", "--mib", "4", "--reps", "1", "--json", str(out)]) == 0
    assert "pieced_python / copy" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert [r["block"] for r in results] == [64 << 10, 512 << 10, 2 << 20]
    assert all(r["copy_gbps"] > 0 and r["pieced_python_gbps"] > 0 for r in results)


def test_bench_daemon_smoke(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert cli.main(["bench", "daemon", "--pool-mib", "32", "--batch-mib", "4", "--reps", "1", "--calls", "20",
                     "--warmup", "2", "--inflight", "1,2", "--json", str(out)]) == 0
    assert "one-block Offload p50" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["throughput"]["offload_gbps"] > 0 and len(result["jobs_in_flight"]) == 2
    tp = result["throughput"]
    assert all(tp[f"{d}_cpu_s_per_gb"] > 0 and tp[f"{d}_cpu_vs_copy_hash"] > 0 for d in ("offload", "restore"))


def test_bench_lane_smoke(tmp_path, capsys):
    out_json, out_png = tmp_path / "l.json", tmp_path / "l.png"
    assert cli.main(["bench", "lane", "--batches", "1", "4", "--reps", "2", "--json", str(out_json),
                     "--plot", str(out_png)]) == 0
    assert "offload lane / copy" in capsys.readouterr().out
    rows = json.loads(out_json.read_text())["batches"]
    assert [r["blocks"] for r in rows] == [1, 4]
    assert all(r["lane_offload_ms"] > 0 and r["grpc_lookup_ms"] > 0 and r["health_ms"] > 0 for r in rows)
    assert all(r[f"{t}_job_ms"] > 0 and r[f"{t}_wait_send_ms"] > 0 for r in rows for t in ("lane", "grpc"))
    assert all(r[f"{t}_{op}_cpu_s_per_gb"] > 0 and r[f"{t}_{op}_cpu_vs_copy"] > 0
               for r in rows for t in ("lane", "grpc") for op in ("offload", "restore"))
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_bench_bookkeeping_smoke(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert cli.main(["bench", "bookkeeping", "--blocks", "500", "--reps", "2", "--json", str(out)]) == 0
    assert "us per block" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert [r["blocks_per_request"] for r in results] == [500] * 4
    assert all(r["us_per_block"] > 0 for r in results)


def test_bench_lmcache_without_an_lmcache_environment_says_how_to_get_one(tmp_path, capsys):
    assert cli.main(["bench", "lmcache", "--lmcache-python", str(tmp_path / "none" / "python")]) == 2
    assert "make bench-lmcache" in capsys.readouterr().err


def test_bench_demotion_smoke(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert cli.main(["bench", "demotion", "--clients", "2", "--seconds", "1", "--rate", "200", "--host-mib", "8",
                     "--disk-gib", "0.1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    assert "dropped share" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["stored"] > 0 and result["demoted"] > 0 and result["write_errors"] == 0
    assert result["demoted"] + result["dropped"] <= result["stored"]


def test_bench_scale_smoke(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert cli.main(["bench", "scale", "--blocks", "20000", "--batch", "256,1024", "--reps", "20",
                     "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["blocks"] == 20000 and result["fragmented_1024_ms"] > 0 and result["stats_us"] > 0
    assert "fragmented, shuffled / ordered" in capsys.readouterr().out


def test_kvxfer_version_prints_the_installed_version():
    import subprocess
    from importlib.metadata import version

    from tests.conftest import PYTHON, ROOT, python_env

    out = subprocess.run([PYTHON, "-m", "service.program", "--version"], env=python_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"kvxfer {version('kvxfer')}"


HELP_WITHOUT_TORCH = """
import sys
from service import program as cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
print("torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["status", "--help"], ["events", "--help"],
                                  ["serve", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(argv):
    """`kvxfer --help` took torch's import time (1.6 s here) through the tools' and benches' modules."""
    import subprocess

    from tests.conftest import PYTHON, ROOT, python_env

    out = subprocess.run([PYTHON, "-c", HELP_WITHOUT_TORCH, *argv], env=python_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: kvxfer" in out.stdout and out.stdout.splitlines()[-1] == "False"


def test_a_tool_chosen_is_loaded_whole():
    from kvxfer.cli import commands as cli

    args = cli.build_parser(argv=["bench", "checksum", "--mib", "4"]).parse_args(["bench", "checksum", "--mib", "4"])
    assert args.mib == 4 and callable(args.func)
    with pytest.raises(SystemExit):  # the others are listed, not loaded: their options are unknown
        cli.build_parser(argv=["bench", "checksum"]).parse_args(["bench", "disk", "--mib", "4"])


def test_bench_sglang_counts_a_backend_call_once_however_deep_and_on_any_thread():
    """``bench sglang``'s split of SGLang's time: a backend batch call that calls the backend's others
    (SGLang's file backend does) is counted once; calls on other threads count too."""
    import threading
    import time

    from kvxfer.bench.sglang import BackendClock

    class Backend:
        def batch_exists(self, keys):
            time.sleep(0.01)
            return len(keys)

        def batch_get(self, keys):
            self.batch_exists(keys)  # through the clock's wrapper: counted inside this call, not again
            return keys

        def batch_get_v1(self, keys, indices):
            return keys

        def batch_set(self, keys, values):
            time.sleep(0.02)
            return True

        def batch_set_v1(self, keys, indices):
            return [True] * len(keys)

    backend = Backend()
    clock = BackendClock(backend)
    assert backend.batch_get([b"a"]) == [b"a"]
    worker = threading.Thread(target=backend.batch_set, args=([b"a"], None))
    worker.start()
    worker.join()
    get, set_ = clock.take("get"), clock.take("set")
    assert 0.01 <= get < 0.02 + 1.0 and set_ >= 0.02  # (upper bounds: hang guards, not timings)
    assert clock.take("get") == clock.take("set") == 0.0
