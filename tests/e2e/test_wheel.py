"""`make wheel`'s sdist and wheel, installed as a user would: a clean venv, extras included, run from
outside the checkout (issue 31, item 1)."""

import os
import subprocess
import sys
import time
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def run(*argv, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_wheel_installs_in_a_clean_venv_and_serves(tmp_path):
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, ROOT)  # = make wheel
    wheels, sdists = list(dist.glob("kvxfer-*.whl")), list(dist.glob("kvxfer-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    for needed in ("kvxfer/transfer/costs.json", "kvxfer/v1/kvxfer_pb2.py", "service/program.py",
                   "kvxfer/integrations/vllm/__init__.py"):
        assert needed in names
    for module in ("core/_fastpath", "index/_tables", "index/_use_order"):  # the C bookkeeping, built
        assert any(n.startswith(f"kvxfer/{module}.") and n.endswith(".so") for n in names), module
    assert any(n.startswith("kvxfer/transfer/_fused.") and n.endswith(".so") for n in names)
    assert not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    run(sys._base_executable, "-m", "venv", venv)  # not this venv's packages: a clean one
    run(venv / "bin" / "pip", "install", "-q", "-c", ROOT / "constraints.txt", f"{wheels[0]}[test,bench]")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    kvxfer = venv / "bin" / "kvxfer"
    here = {"cwd": tmp_path, "env": env}  # outside the checkout: only the installed package is importable
    probe = run(venv / "bin" / "python", "-c",
                "import kvxfer, kvxfer.core._fastpath, kvxfer.index._tables, kvxfer.index._use_order; "
                "from kvxfer.transfer import native, planner; planner.CostTable.load(); "
                "print(kvxfer.__file__, native.load() is not None)", **here)
    assert str(venv) in probe.stdout and probe.stdout.split()[-1] == "True", probe.stdout
    run(venv / "bin" / "pip", "check", **here)
    sock = tmp_path / "k.sock"
    check = run(kvxfer, "serve", "--check", "--socket", sock, "--device", "cpu", **here)
    assert "configuration OK" in check.stdout
    daemon = subprocess.Popen([kvxfer, "serve", "--socket", sock, "--metrics-listen", "", "--num-blocks", "16"],
                              stderr=subprocess.PIPE, text=True, **here)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([kvxfer, "health", "--target", f"unix:{sock}"], capture_output=True,
                             **here).returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr.read()[-3000:]
            time.sleep(0.3)
        status = run(kvxfer, "status", "--target", f"unix:{sock}", **here)
        assert "rank0" in status.stdout
    finally:
        daemon.terminate()
        assert daemon.wait(60) == 0
