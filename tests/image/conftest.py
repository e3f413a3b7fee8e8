"""The CPU image the chart ships, built once from the repository's Dockerfile for the image tests.

No image registry can be reached here, so the Dockerfile's base (``python:3.11-slim-bookworm``)
is made with mmdebstrap from Debian's packages and imported under that name; torch comes
from a local index of the CPU wheel and its dependencies (``TORCH_INDEX_URL``), the rest
from the package registry.

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

ROOT = Path(__file__).resolve().parents[2]
BASE = "docker.io/library/python:3.11-slim-bookworm"
IMAGE = "localhost/kvxfer:ci-cpu"
FREE_NEEDED = 6 << 30
BASE_PACKAGES = "python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates,passwd"
#: The host's package-registry settings, mounted into the build (proxy CA, local wheel indexes).
HOST_PIP = ["/etc/pip.conf", "/etc/xdg/pip", "/etc/ssl/certs/ca-certificates.crt", "/opt/wheels", "/opt/pypi",
            "/opt/pypi-more"]


def podman(conf: Path, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
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


@pytest.fixture(scope="session")
def image(tmp_path_factory):
    if not all(shutil.which(tool) for tool in ("podman", "runc", "mmdebstrap")):
        pytest.skip("needs podman, runc and mmdebstrap (.ci/run installs them)")
    work = tmp_path_factory.mktemp("image")
    free = shutil.disk_usage(work).free
    if free < FREE_NEEDED:  # the build's layers and pip's unpacked wheels; a full disk is no verdict on the image
        pytest.skip(f"the image build needs {FREE_NEEDED >> 30} GiB free under {work}, {free / 2**30:.1f} GiB is")
    conf = work / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    # Each container, pod and volume holds a lock number in podman's lock segment (/dev/shm/libpod_lock). Where
    # /dev/shm was cleared and /var/lib/containers kept, the fresh segment hands out numbers old objects still
    # hold: a new pod drew the lock of a kept volume it then used, and `kube play` deadlocked on itself.
    podman(conf, "system", "renumber")
    if podman(conf, "image", "exists", BASE, check=False).returncode != 0:
        subprocess.run(["mmdebstrap", "--quiet", "--variant=apt", f"--include={BASE_PACKAGES}", "bookworm",
                        str(work / "base.tar")], check=True, timeout=600)
        podman(conf, "import", str(work / "base.tar"), BASE)
        (work / "base.tar").unlink()
    _torch_index(work / "index")
    mounts = [f"--volume={path}:{path}:ro" for path in HOST_PIP if Path(path).exists()]
    start = time.monotonic()
    podman(conf, "build", "--no-cache", "--target", "kvxfer", "--pull=never", "--build-arg", "VARIANT=cpu",
            "--build-arg", "TORCH_INDEX_URL=file:///idx/simple", f"--volume={work / 'index'}:/idx:ro", *mounts,
            "-t", IMAGE, str(ROOT), timeout=1500)
    print(f"image built in {time.monotonic() - start:.0f} s")
    yield conf, work
    podman(conf, "rmi", "-f", IMAGE, check=False)


