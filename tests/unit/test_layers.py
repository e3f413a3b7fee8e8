"""The layout's rules (docs/design.md, Layout): checked, not hoped for."""

import ast
import json
import subprocess
from collections import defaultdict

from tests.conftest import PYTHON, ROOT, python_env

SERVER_SIDE = ("kvxfer.index", "kvxfer.serving", "kvxfer.transfer", "kvxfer.tiers", "service")
#: The library's packages, bottom floor first: a package imports only packages on lower floors (docs/design.md).
FLOORS = [
    ["v1"],  # the API's generated code
    ["core"],  # the vocabulary: errors, records, validation, defaults, slots, breaker, tables; no torch
    ["geometry", "events", "engine"],  # what a pool and a block are; what a tier announces; the engine's kernels
    ["memory", "index"],  # pools' memory; the tiers' books (touch no bytes)
    ["wire"],  # what the client and the daemon exchange: protobuf mappings, the lane's and the descriptor socket's frames
    ["peering", "client"],  # daemon-to-daemon leases; the engine-side client
    ["tiers", "integrations"],  # host memory and the lower tiers; the engine backends
    ["transfer"],  # copy engines (chosen by medium; no policy)
    ["serving", "cli"],  # pools as the daemon serves them; the command-line tools
    ["bench"],  # benchmarks and the launcher of real daemons
    ["devcheck"],  # the GPU machine's check
]
FLOOR = {package: n for n, floor in enumerate(FLOORS) for package in floor}


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([PYTHON, "-c", code], env=python_env(), cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def _imports(path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
    return names


def test_the_package_root_holds_packages_alone():
    """Every module lives in the package of its concern; the root keeps ``__init__`` (the version, and
    ``Client`` on first use) and nothing else, C sources included."""
    loose = sorted(p.name for p in (ROOT / "kvxfer").iterdir() if p.is_file() and p.suffix in (".py", ".c", ".h"))
    assert loose == ["__init__.py"]
    packages = sorted(p.name for p in (ROOT / "kvxfer").iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(FLOOR), "a new package needs its floor in FLOORS and docs/design.md"


def test_imports_go_down_the_floors():
    """Every import, also one made for type checking alone, goes to a package on a lower floor: none goes
    up and none sideways, so the packages form layers without a cycle."""
    offenders = []
    for path in (ROOT / "kvxfer").rglob("*.py"):
        rel = path.relative_to(ROOT / "kvxfer")
        if len(rel.parts) == 1:
            continue  # kvxfer/__init__.py: the top, importing the client on first use
        source = rel.parts[0]
        for name in _imports(path):
            target = name.split(".")[1] if name.startswith("kvxfer.") else None
            if target is not None and target != source and FLOOR[target] >= FLOOR[source]:
                offenders.append(f"{rel}: {name} ({source} is on floor {FLOOR[source]}, {target} on {FLOOR[target]})")
    assert offenders == []


def test_no_two_modules_share_a_name_for_different_things():
    """A module's name says what it is without its folder. Names repeat only for one role in sibling
    packages (each lower tier's ``store``, each engine's ``naming``) and for each package's ``settings``."""
    by_name = defaultdict(list)
    for path in [*(ROOT / "kvxfer").rglob("*.py"), *(ROOT / "service").rglob("*.py")]:
        if path.name not in ("__init__.py", "__main__.py") and "v1" not in path.parts:
            by_name[path.name].append(path.relative_to(ROOT))
    clashes = {name: [str(p) for p in paths] for name, paths in by_name.items()
               if len(paths) > 1 and name != "settings.py" and len({p.parent.parent for p in paths}) > 1}
    assert clashes == {}


def test_the_client_imports_no_server_internals():
    loaded = _loaded_after("import kvxfer.client")
    assert [m for m in loaded if m.startswith(SERVER_SIDE)] == []
    assert "kvxfer.core.records" in loaded and "kvxfer.wire.messages" in loaded


def test_from_kvxfer_import_client_works_and_the_core_stays_light():
    loaded = _loaded_after("from kvxfer import Client; from kvxfer.client import Client as C; assert Client is C")
    assert "kvxfer.client.daemon_client" in loaded
    core = [f"kvxfer.core.{p.stem}" for p in (ROOT / "kvxfer" / "core").glob("*.py") if p.stem != "__init__"]
    light = _loaded_after(f"import {', '.join(core)}")
    assert [m for m in light if m.startswith(("torch", "grpc", "kvxfer.")) and not
            m.startswith(("kvxfer.core", "kvxfer.v1"))] == []


def test_the_library_never_imports_the_daemon():
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "kvxfer").rglob("*.py")
                 for name in _imports(path) if name == "service" or name.startswith("service.")]
    assert offenders == []


def test_the_daemon_and_the_client_share_the_wire_and_nothing_else():
    """``service/`` takes the wire from ``kvxfer.wire``, never from the client: the engine-side library and the
    server change apart. The wire imports neither."""
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "service").rglob("*.py")
                 for name in _imports(path) if name == "kvxfer.client" or name.startswith("kvxfer.client.")]
    assert offenders == []
    loaded = _loaded_after("import kvxfer.wire.messages, kvxfer.wire.lane_frames, kvxfer.wire.descriptor_frames")
    assert [m for m in loaded if m.startswith(("kvxfer.client", "service"))] == []


def test_serving_knows_no_peering():
    """Peering is a lower tier the cache groups read (``kvxfer.tiers.peer``) and a servicer beside them; the
    pools as the daemon serves them never name it, not even for type checking. The composition root
    (``service/parts.py``) builds both and hands each what it uses."""
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "kvxfer" / "serving").rglob("*.py")
                 for name in _imports(path) if name.startswith("kvxfer.peering")]
    assert offenders == []


def test_benchmarks_and_harnesses_live_in_kvxfer_bench_and_the_daemon_package_holds_the_daemon():
    """``service/`` is the daemon alone; every benchmark (and the launcher of real daemons that
    benchmarks and tests use) is a ``kvxfer.bench`` module, which starts the daemon as a program."""
    from kvxfer.cli.commands import BENCHES

    harnesses = [p.name for p in (ROOT / "service").glob("*.py")
                 if p.name.startswith(("bench", "launch", "peer_lmcache", "peering_local"))]
    assert harnesses == [] and all(module.startswith("kvxfer.bench.") for _, module, _ in BENCHES)
    assert "torch" not in _loaded_after("import kvxfer.core.defaults")


def test_peering_the_daemon_and_the_pool_managers_reach_a_cache_group_through_its_methods_alone():
    """Peering and the pool managers use a cache group's methods, never its index or host tier directly.
    (The manager hands ``group.host`` to its copy engine: the tier the bytes move into.)"""
    import re

    reach = {"kvxfer/peering": r"group\.(index|host)\b", "service": r"group\.(index|host)\b",
             "kvxfer/serving": r"group\.index\b|host_index|store_lock"}
    offenders = [f"{p.relative_to(ROOT)}:{n}" for package, pattern in reach.items()
                 for p in (ROOT / package).rglob("*.py") if p.name != "group.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert offenders == []


def test_the_engine_integrations_use_the_client_and_the_vocabulary_alone():
    """The backends take what they need from ``kvxfer.client`` (which exports it) and the core vocabulary,
    never from memory/, geometry/ or events/ directly."""
    allowed = ("kvxfer.client", "kvxfer.core.records", "kvxfer.core.errors", "kvxfer.core.validate",
               "kvxfer.core.envelope", "kvxfer.integrations")
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "kvxfer" / "integrations").rglob("*.py")
                 for name in _imports(path) if name.startswith("kvxfer") and not name.startswith(allowed)]
    assert offenders == []


def test_the_torch_free_names_of_dtypes_and_presets_are_the_geometry_s():
    """``kvxfer.geometry.names`` lists them for command lines' help without importing torch."""
    from kvxfer.geometry.layout import DTYPES, PRESETS
    from kvxfer.geometry.names import DTYPE_NAMES, PRESET_NAMES

    assert list(DTYPE_NAMES) == list(DTYPES) and list(PRESET_NAMES) == list(PRESETS)
    assert "torch" not in _loaded_after("import kvxfer.geometry.names")


def test_the_kvxfer_program_builds_its_command_line_without_the_optional_packages():
    """The container image has no boto3 (and a plain wheel no obstore, NIXL, pyzmq): ``kvxfer serve`` failed to
    start once a benchmark module imported boto3 at its top."""
    code = ("import sys, json\n"
            "for name in ('obstore', 'boto3', 'botocore', 'nixl', 'nixl_cu13', 'zmq', 'msgspec', 'matplotlib'):\n"
            "    sys.modules[name] = None  # an import of it raises ImportError\n"
            "import service.program\n"
            "service.program.parser()\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('obstore', 'boto3')))))")
    out = subprocess.run([PYTHON, "-c", code], env=python_env(), cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
