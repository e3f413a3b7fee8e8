"""Issue 47 item 1: the device check runs on the machine it will get. A bare interpreter (a venv without pip)
with an older protobuf and grpcio of its own runs the stages the simulator can run, on the carried wheels
(unpacked first on the path, whatever is installed), and says first what it loaded from where."""

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from kvxfer.devcheck import bootstrap
from tests.conftest import ROOT
from tests.cudasim.region import Region


NOT_ON_THE_MACHINE = ("pip", "grpc", "google", "protobuf", "yaml", "_yaml", "pyyaml", "redis", "prometheus_client",
                      "prometheus-client", "xxhash")


def carry(dist: str, directory: Path) -> Path:
    """A wheel of an installed distribution, as ``make devcheck-wheels`` would fetch it (its files, its tag)."""
    d = importlib.metadata.distribution(dist)
    tag = next(line.split(":", 1)[1].strip() for line in d.read_text("WHEEL").splitlines() if line.startswith("Tag:"))
    wheel = directory / f"{d.metadata['Name'].replace('-', '_')}-{d.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        for file in d.files:
            path = Path(d.locate_file(file))
            if path.is_file() and "__pycache__" not in file.parts and not str(file).startswith(".."):
                whl.write(path, str(file))
    return wheel


def test_a_bare_interpreter_with_old_protobuf_and_grpcio_runs_the_check_on_the_carried_wheels(tmp_path):
    wheels = tmp_path / "devcheck-wheels"
    wheels.mkdir()
    for dist in sorted(set(bootstrap.PACKAGES.values())):
        carry(dist, wheels)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = bare / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for module, version in (("google/protobuf", "3.20.3"), ("grpc", "1.48.2")):  # what the machine has
        (site / module).mkdir(parents=True)
        (site / module / "__init__.py").write_text(f"__version__ = {version!r}\n")
    # torch, numpy, Triton and the rest come with the machine: this environment's, after the bare site's own;
    # not pip, nor what the wheels carry (those must come from the wheels)
    machine = tmp_path / "machine"
    machine.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(NOT_ON_THE_MACHINE):
            (machine / entry.name).symlink_to(entry)
    (site / "machine.pth").write_text(f"{machine}\n")
    assert subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode != 0  # no pip
    probe = "import grpc, google.protobuf as p; print(grpc.__version__, p.__version__)"
    old = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert old == ["1.48.2", "3.20.3"]  # without the bootstrap, the old ones load

    region = tmp_path / "gpus"
    Region.create(region)
    out = tmp_path / "out"
    done = subprocess.run([str(python), "-m", "tests.e2e.devcheck_bare", str(wheels), str(region), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1",
                               "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    first, *_, last = done.stdout.strip().splitlines()
    target = json.loads(last)
    assert first.startswith("[devcheck] loaded: ")
    said = dict(item.split(" ", 1) for item in first[len("[devcheck] loaded: "):].split("; "))
    report = json.loads(Path(target["report"]).read_text())
    unpacked = report["prepared"]["packages"]["target"]
    assert sorted(report["prepared"]["packages"]["unpacked"]) == sorted(w.name for w in wheels.iterdir())
    for module in bootstrap.PACKAGES:  # every one from the carried wheels, none from the machine
        version, _, where = said[module].partition(" from ")
        assert version == importlib.metadata.version(bootstrap.PACKAGES[module]) and where.startswith(unpacked), said
    assert target["status"] == 0, report
    assert [s["stage"] for s in report["stages"]] == ["daemon_over_grpc", "staging_on_the_gpu"]
    assert all(s["result"]["bit_identical"] for s in report["stages"])
