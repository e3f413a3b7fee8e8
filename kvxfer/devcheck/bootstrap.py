"""Make a bare GPU machine able to run the device check before anything of the daemon is imported.

The machines lent have CUDA, torch, Triton and numpy, maybe no pip, and the daemon's other packages
missing or at versions of their own (protobuf and grpcio older than the generated code needs), and
no network: ``make devcheck-wheels`` downloads the cp312 wheels of those packages into
``devcheck-wheels/`` (git-ignored; carried with the working tree), and ``unpack`` unpacks every
carried wheel this interpreter can load (a wheel is a zip: no pip) into a temporary directory that
goes first on ``sys.path`` and PYTHONPATH, whatever the machine has installed: the check always runs
on the carried versions, in this process and in those it starts. One of them imported before the
bootstrap cannot be replaced in this process: the check then starts itself again (``reexec``).
``loaded`` says which version of each came from where: the check's first line of output. The
bootstrap also builds the C copy loops in place where a compiler exists (saying which copy loop runs
where none does), and points Triton at a writable cache.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: The daemon's imports a lent machine may lack (or have at other versions) -> the distribution of each.
PACKAGES = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
            "google.protobuf": "protobuf", "yaml": "pyyaml", "redis": "redis",
            "prometheus_client": "prometheus-client", "xxhash": "xxhash", "blake3": "blake3"}
WHEELS = "devcheck-wheels"
REEXEC = "KVXFER_DEVCHECK_SITE"  # set in the restarted check: the directory the wheels were unpacked into


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def loadable(wheel: str) -> bool:
    """Whether this interpreter can load a wheel, by its file name's tags (PEP 427): its Python and ABI
    tags, and a platform of any or this machine's (Linux) architecture."""
    parts = wheel[:-len(".whl")].split("-")
    if len(parts) < 5:
        return False
    pythons, abis, platforms = (set(t.split(".")) for t in parts[-3:])
    major, minor = sys.version_info[:2]
    here = f"cp{major}{minor}"
    # abi3: built for CPython 3.N's stable ABI, loaded by every CPython 3.M with M >= N
    stable = "abi3" in abis and any(re.fullmatch(rf"cp{major}(\d+)", t) and int(t[3:]) <= minor for t in pythons)
    machine = platform.machine()
    return (bool(pythons & {"py3", here, f"py{major}{minor}"}) or stable) \
        and bool(abis & {"none", "abi3", here}) \
        and any(p == "any" or (p.startswith(("linux", "manylinux", "musllinux")) and p.endswith(machine))
                for p in platforms)


def carried(wheels: Path, packages: dict[str, str] = PACKAGES) -> dict[str, Path]:
    """The carried wheel this interpreter loads for each distribution of ``packages`` that has one."""
    wanted = {_normal(d) for d in packages.values()}
    found: dict[str, Path] = {}
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        dist = _normal(wheel.name.split("-")[0])
        if dist in wanted and loadable(wheel.name):
            found.setdefault(dist, wheel)
    return found


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # its parent package is missing; or it is half there
        return False


def unpack(wheels: Path, packages: dict[str, str] = PACKAGES) -> dict:
    """Unpack the carried wheels first on ``sys.path`` (and on PYTHONPATH, for the daemon and tests the
    check starts), whatever is installed. ``reexec``: a module they provide was imported already (its
    installed version would stay in this process): start the check again."""
    site = os.environ.get(REEXEC)
    found = carried(wheels, packages)
    absent = [d for m, d in packages.items() if _normal(d) not in found and not _importable(m)]
    if absent:
        raise RuntimeError(f"missing {absent} and no wheel for them in {wheels} that this Python loads: run "
                           "`make devcheck-wheels` where there is a network and carry that folder")
    if site is None and found:
        site = tempfile.mkdtemp(prefix="kvxfer-devcheck-site-")
        for wheel in found.values():
            with zipfile.ZipFile(wheel) as whl:
                whl.extractall(site)
    if site is not None:
        sys.path[:] = [site] + [p for p in sys.path if p != site]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
        importlib.invalidate_caches()
    early = sorted(m for m, d in packages.items()
                   if m in sys.modules and _normal(d) in found and os.environ.get(REEXEC) is None)
    return {"unpacked": sorted(w.name for w in found.values()), "target": site, "reexec": bool(early),
            "imported_before": early}


def loaded(packages: dict[str, str] = PACKAGES) -> list[str]:
    """"module version from path" for each of ``packages`` as this process imports it."""
    out = []
    for module in packages:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            out.append(f"{module}: not importable ({exc})")
            continue
        version = getattr(mod, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(packages[module])
            except importlib.metadata.PackageNotFoundError:
                version = "?"
        out.append(f"{module} {version} from {Path(mod.__file__).parent}")
    return out


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
    return {"packages": unpack(root / WHEELS), "copy_loop": build_extensions(root),
            "triton_cache_dir": writable_triton_cache()}
