"""Make a bare GPU machine able to run the device check before anything of the daemon is imported.

The machines lent have CUDA, torch, Triton and numpy but not the daemon's other packages,
and no network: ``make devcheck-wheels`` downloads their cp312 wheels into
``devcheck-wheels/`` (git-ignored; carried with the working tree), and ``prepare``
installs the missing ones into a temporary target (``pip install --no-index --no-deps
--target``), visible to this process and the ones it starts. It also builds the C copy
loops in place where a compiler exists (saying which copy loop runs where none does),
and points Triton at a writable cache.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: The daemon's imports a lent machine may lack -> the distribution that provides each.
PACKAGES = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
            "google.protobuf": "protobuf", "yaml": "pyyaml", "redis": "redis",
            "prometheus_client": "prometheus-client", "xxhash": "xxhash"}
WHEELS = "devcheck-wheels"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _missing(packages: dict[str, str]) -> list[str]:
    missing = []
    for module, dist in packages.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing too
            found = False
        if not found:
            missing.append(dist)
    return missing


def install_missing(wheels: Path, packages: dict[str, str] = PACKAGES) -> dict:
    """Install the carried wheels of missing packages into a temporary target on ``sys.path`` (and
    on PYTHONPATH, for the daemon and tests the check starts)."""
    missing = _missing(packages)
    if not missing:
        return {"missing": []}
    files = {_normal(w.name.split("-")[0]): w for w in sorted(wheels.glob("*.whl"))} if wheels.is_dir() else {}
    found = [files[_normal(d)] for d in missing if _normal(d) in files]
    absent = [d for d in missing if _normal(d) not in files]
    if absent:
        raise RuntimeError(f"missing {absent} and no wheel for them in {wheels}: run `make devcheck-wheels` where "
                           "there is a network and carry that folder")
    target = tempfile.mkdtemp(prefix="kvxfer-devcheck-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target,
                    *map(str, found)], check=True)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH", "")) if p)
    importlib.invalidate_caches()
    return {"missing": missing, "installed_from": [w.name for w in found], "target": target}


def build_extensions(root: Path) -> str:
    """The C copy loops built in place where a compiler exists; which copy loop runs, in words."""
    if not (root / "setup.py").is_file():
        return "an installed kvxfer: its C copy loops as built at install"
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "no C compiler: the copy loops run in numpy (slower on the host side)"
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"C build failed ({done.stderr.strip().splitlines()[-1:]}): the copy loops run in numpy"
    return "C copy loops built in place"


def writable_triton_cache() -> str:
    """Triton compiles a launcher at run time into its cache: a writable one, if the default is not."""
    current = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    probe = Path(current)
    try:
        probe.mkdir(parents=True, exist_ok=True)
        if os.access(probe, os.W_OK):
            return current
    except OSError:
        pass
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvxfer-devcheck-triton-")
    return os.environ["TRITON_CACHE_DIR"]


def prepare(root: Path) -> dict:
    """Everything the check needs that a bare machine may lack; what was done, for the report."""
    return {"packages": install_missing(root / WHEELS), "copy_loop": build_extensions(root),
            "triton_cache_dir": writable_triton_cache()}
