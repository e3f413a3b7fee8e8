"""The CPU image the chart ships, built from the repository's Dockerfile and run (issue 29).

No image registry can be reached here, so the Dockerfile's base (``python:3.11-slim-bookworm``)
is made with mmdebstrap from Debian's packages and imported under that name; torch comes
from a local index of the CPU wheel and its dependencies (``TORCH_INDEX_URL``), the rest
from the package registry. The container then runs as the chart runs it: as its non-root
user, with a read-only root filesystem, the config mounted read-only and the socket
directory shared with the host, where a client checks health and offloads and restores a
block bit-exact through it.

Podman needs, on these machines: runc (crun refuses the hybrid cgroup hierarchy), the
cgroupfs manager, and no default ulimits (raising them is not permitted in the sandbox).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvxfer import Client
from kvxfer.records import Outcome

ROOT = Path(__file__).resolve().parents[2]
BASE = "docker.io/library/python:3.11-slim-bookworm"
IMAGE = "localhost/kvxfer:ci-cpu"
FREE_NEEDED = 6 << 30
BASE_PACKAGES = "python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates,passwd"
#: The host's package-registry settings, mounted into the build (proxy CA, local wheel indexes).
HOST_PIP = ["/etc/pip.conf", "/etc/xdg/pip", "/etc/ssl/certs/ca-certificates.crt", "/opt/wheels", "/opt/pypi",
            "/opt/pypi-more"]
CONFIG = """socket: /run/kvxfer/kvxfer.sock
socket_mode: "0666"
metrics_listen: ""
pools:
  - id: rank0
    device: cpu
    spec: {num_layers: 4, num_blocks: 64, block_size: 16, num_kv_heads: 2, head_size: 32, dtype: float16}
    host_capacity_mib: 4
"""


def _podman(conf: Path, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", *args]
    out = subprocess.run(cmd, env={**os.environ, "CONTAINERS_CONF": str(conf)}, capture_output=True, text=True,
                         timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args[:2])} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                             f"{out.stderr[-3000:]}")
    return out


def _torch_index(directory: Path) -> None:
    """A PEP 503 index of the CPU torch wheel and its dependencies, downloaded as pip resolves them here."""
    wheels = directory / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(wheels),
                    f"torch=={torch.__version__.split('+')[0]}"], check=True, timeout=600)
    for wheel in wheels.glob("*.whl"):
        project = wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")
        page = directory / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        with (page / "index.html").open("a") as html:
            html.write(f'<a href="../../wheels/{wheel.name}">{wheel.name}</a>\n')


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if not all(shutil.which(tool) for tool in ("podman", "runc", "mmdebstrap")):
        pytest.skip("needs podman, runc and mmdebstrap (.ci/run installs them)")
    work = tmp_path_factory.mktemp("image")
    free = shutil.disk_usage(work).free
    if free < FREE_NEEDED:  # the build's layers and pip's unpacked wheels; a full disk is no verdict on the image
        pytest.skip(f"the image build needs {FREE_NEEDED >> 30} GiB free under {work}, {free / 2**30:.1f} GiB is")
    conf = work / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    if _podman(conf, "image", "exists", BASE, check=False).returncode != 0:
        subprocess.run(["mmdebstrap", "--quiet", "--variant=apt", f"--include={BASE_PACKAGES}", "bookworm",
                        str(work / "base.tar")], check=True, timeout=600)
        _podman(conf, "import", str(work / "base.tar"), BASE)
        (work / "base.tar").unlink()
    _torch_index(work / "index")
    mounts = [f"--volume={path}:{path}:ro" for path in HOST_PIP if Path(path).exists()]
    start = time.monotonic()
    _podman(conf, "build", "--no-cache", "--target", "kvxfer", "--pull=never", "--build-arg", "VARIANT=cpu",
            "--build-arg", "TORCH_INDEX_URL=file:///idx/simple", f"--volume={work / 'index'}:/idx:ro", *mounts,
            "-t", IMAGE, str(ROOT), timeout=1500)
    print(f"image built in {time.monotonic() - start:.0f} s")
    yield conf, work
    _podman(conf, "rmi", "-f", IMAGE, check=False)


def test_the_cpu_image_serves_as_non_root_on_a_read_only_root(image):
    conf, work = image
    config, run = work / "config", work / "run"
    config.mkdir()
    run.mkdir()
    run.chmod(0o777)  # the container's user (uid 1000) makes the socket here
    (config / "kvxfer.yaml").write_text(CONFIG)
    name = f"kvxfer-ci-{os.getpid()}"
    _podman(conf, "run", "-d", "--name", name, "--read-only", "--tmpfs", "/var/cache/kvxfer",
            f"--volume={config}:/etc/kvxfer/config:ro", f"--volume={run}:/run/kvxfer", IMAGE)
    try:
        deadline = time.monotonic() + 60
        while not (run / "kvxfer.sock").exists():
            assert time.monotonic() < deadline, _podman(conf, "logs", name, check=False).stderr[-3000:]
            time.sleep(0.2)
        assert _podman(conf, "exec", name, "id", "-u").stdout.strip() == "1000"
        assert _podman(conf, "exec", name, "touch", "/x", check=False).returncode != 0  # read-only root
        with Client(f"unix:{run / 'kvxfer.sock'}", timeout=30) as client:
            assert client.health(timeout=10) == "SERVING"
            pool = client.map_pool("rank0")
            span = pool.layout.block_bytes
            data = torch.randint(0, 256, (span,), dtype=torch.uint8)
            pool.storage[span:2 * span] = data
            assert client.offload([(1, b"image")], pool_id="rank0").outcomes == [Outcome.DONE]
            assert client.restore([(b"image", 5)], pool_id="rank0").outcomes == [Outcome.DONE]
            assert torch.equal(pool.storage[5 * span:6 * span], data)
        assert '"level": "error"' not in _podman(conf, "logs", name).stderr
    finally:
        _podman(conf, "rm", "-f", name, check=False)
