"""The import rules of the layers (docs/design.md): checked, not hoped for."""

import ast
import json
import subprocess
from pathlib import Path

from tests.conftest import PYTHON, ROOT, python_env

SERVER_SIDE = ("kvxfer.index", "kvxfer.serving", "kvxfer.transfer", "kvxfer.tiers", "service")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([PYTHON, "-c", code], env=python_env(), cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_the_client_imports_no_server_internals():
    loaded = _loaded_after("import kvxfer.client")
    assert [m for m in loaded if m.startswith(SERVER_SIDE)] == []
    assert "kvxfer.records" in loaded and "kvxfer.wire" in loaded


def test_from_kvxfer_import_client_works_and_records_stay_light():
    loaded = _loaded_after("from kvxfer import Client; assert Client.__name__ == 'Client'")
    assert "kvxfer.client" in loaded
    light = _loaded_after("import kvxfer.records")
    assert "torch" not in light and "grpc" not in light
    vocabulary = _loaded_after("import kvxfer.validate, kvxfer.errors, kvxfer.tables")  # issue 48: no torch
    assert "torch" not in vocabulary and "kvxfer.geometry.layout" not in vocabulary


def test_the_library_never_imports_the_daemon():
    offenders = []
    for path in (ROOT / "kvxfer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "service" or
                          n.startswith("service.")]
    assert offenders == []


def test_benchmarks_and_harnesses_live_in_kvxfer_bench_and_the_daemon_package_holds_the_daemon():
    """Issue 48: ``service/`` is the daemon alone; every benchmark (and the launcher of real daemons that
    benchmarks and tests use) is a ``kvxfer.bench`` module, which starts the daemon as a program."""
    from kvxfer.cli import BENCHES

    harnesses = [p.name for p in (ROOT / "service").glob("*.py")
                 if p.name.startswith(("bench", "launch", "peer_lmcache", "peering_local"))]
    assert harnesses == [] and all(module.startswith("kvxfer.bench.") for _, module, _ in BENCHES)
    assert "torch" not in _loaded_after("import kvxfer.defaults")


def test_peering_the_daemon_and_the_pool_managers_reach_a_cache_group_through_its_methods_alone():
    """Issue 48: the lease and push code reached into ``group.index`` and ``group.host``, the manager completed
    its stores on ``group.index``, promotion took the group apart into seven arguments. (The manager hands
    ``group.host`` to its copy engine: the tier the bytes move into.)"""
    import re

    reach = {"kvxfer/peering": r"group\.(index|host)\b", "service": r"group\.(index|host)\b",
             "kvxfer/serving": r"group\.index\b|host_index|store_lock"}
    offenders = [f"{p.relative_to(ROOT)}:{n}" for package, pattern in reach.items()
                 for p in (ROOT / package).rglob("*.py") if p.name != "group.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert offenders == []


def test_the_engine_integrations_use_the_client_and_the_vocabulary_alone():
    """Issue 48: the backends reached into memory/, geometry/ and events/; they take what they need from
    ``kvxfer.client`` (which re-exports it) and the vocabulary."""
    allowed = ("kvxfer.client", "kvxfer.records", "kvxfer.errors", "kvxfer.validate", "kvxfer.integrations")
    offenders = []
    for path in (ROOT / "kvxfer" / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.startswith("kvxfer") and not n.startswith(allowed)]
    assert offenders == []


def test_the_library_s_packages_import_each_other_without_a_cycle():
    """Issue 48: serving and peering imported each other (for types). Every import counts, also one made
    for type checking alone: the packages of ``kvxfer`` form layers, and imports go one way."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "kvxfer").rglob("*.py"):
        if "v1" in path.parts:
            continue
        rel = path.relative_to(ROOT / "kvxfer")
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.startswith("kvxfer.") and name.split(".")[1] != source:
                    graph.setdefault(source, set()).add(name.split(".")[1])
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, " -> ".join(path + (package,))
        if package not in done:
            for imported in sorted(graph.get(package, ())):
                visit(imported, path + (package,))
            done.add(package)

    for package in sorted(graph):
        visit(package, ())


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
            "import service.cli\n"
            "service.cli.parser()\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('obstore', 'boto3')))))")
    out = subprocess.run([PYTHON, "-c", code], env=python_env(), cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
