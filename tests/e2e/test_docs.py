"""The docs check: what README and docs/ say runs as they say it.

- every relative link and anchor resolves;
- every documented command parses with the real program: ``kvxfer ...`` with kvxfer's own
  parser (and those that take seconds run: ``layout``, ``serve --check``, and ``status`` and
  ``health`` against a real daemon), ``make X`` against the Makefile, ``helm ... --set`` against the chart's values,
  ``docker build --target`` against the Dockerfile, ``python -m M`` against importable modules;
- README's Python example runs against a real daemon and prints what its comments say;
- the example configuration passes ``serve --check`` and a daemon starts from it;
- the configuration reference lists exactly the daemon's keys.
"""

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from kvxfer.bench import launch
from kvxfer.tiers.registry import LOWER_TIERS
from service import config as service_config
from service import config_peering, config_sections
from service import program as service_cli
from tests.conftest import PYTHON, ROOT, python_env

pytestmark = pytest.mark.e2e
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "helm" / "kvxfer" / "README.md"]
HISTORY = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))  # past runs: their commands as they were then
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def commands(path: Path) -> list[list[str]]:
    """Each simple command of the file's sh blocks, comments and continuations removed."""
    found = []
    for body in blocks(path, "sh"):
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = shlex.split(part)
                except ValueError:  # a quoted JSON argument spanning lines: not a command to parse
                    continue
                if words:
                    found.append(words)
    return found


@pytest.mark.parametrize("doc", DOCS + HISTORY, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{doc.name}: {broken}"


def _values_has(path: str) -> bool:
    node = yaml.safe_load((ROOT / "helm" / "kvxfer" / "values.yaml").read_text())
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(doc):
    parser = service_cli.parser()
    makefile = (ROOT / "Makefile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "Dockerfile").read_text(), re.M))
    checked = 0
    for words in commands(doc):
        program = Path(words[0]).name
        if program == "kvxfer":
            try:
                parser.parse_args(words[1:])
            except SystemExit:
                pytest.fail(f"{doc.name}: {shlex.join(words)} does not parse")
        elif program == "make":
            for target in (w for w in words[1:] if "=" not in w and not w.startswith("-")):
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{doc.name}: make {target}"
        elif program == "helm":
            for i, word in enumerate(words):
                if word == "--set":
                    key = words[i + 1].split("=", 1)[0]
                    assert _values_has(key), f"{doc.name}: helm --set {key} is not a chart value"
        elif program == "docker" and "--target" in words:
            assert words[words.index("--target") + 1] in stages
        elif program.startswith("python") and words[1:2] == ["-m"]:
            module = words[2]
            assert importlib.util.find_spec(module) is not None, f"{doc.name}: python -m {module}"
        else:
            continue
        checked += 1
    if doc.name == "README.md" and doc.parent == ROOT:
        assert checked >= 7  # set-up, the local try, the chart


RUNNABLE = ("layout", "status", "health")  # quick, and safe to run as written (serve only with --check)


def test_the_quick_documented_commands_run():
    daemon = launch.spawn({})  # what make serve runs
    ran = []
    try:
        for doc in DOCS:
            for words in commands(doc):
                if Path(words[0]).name != "kvxfer" or len(words) < 2:
                    continue
                args = words[1:]
                if not (args[0] in RUNNABLE or (args[0] == "serve" and "--check" in args)):
                    continue
                if args[0] in ("status", "health") and "--target" not in args:
                    args += ["--target", daemon.target]  # the documented default socket, moved
                if args[0] == "serve":
                    args += ["--socket", str(daemon.dir / "check.sock")]
                proc = subprocess.run([PYTHON, "-m", "service.program", *args], env=python_env(), cwd=ROOT,
                                      capture_output=True, text=True, timeout=120)
                assert proc.returncode == 0, f"{doc.name}: {shlex.join(words)}\n{proc.stderr[-2000:]}"
                ran.append(args[0])
    finally:
        daemon.cleanup()
    assert {"layout", "status", "health", "serve"} <= set(ran)


def test_the_readme_example_prints_what_it_says():
    (example,) = [b for b in blocks(ROOT / "README.md", "python") if "Client(" in b]
    expected = [line.split("# prints: ", 1)[1].strip() for line in example.splitlines() if "# prints: " in line]
    daemon = launch.spawn({})  # what make serve runs: the embedded default
    try:
        code = example.replace("unix:/tmp/kvxfer.sock", daemon.target)
        proc = subprocess.run([PYTHON, "-c", code], env=python_env(), cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    finally:
        daemon.cleanup()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == expected


def test_the_example_configuration_checks_and_serves(tmp_path):
    example = ROOT / "docs" / "kvxfer.example.yaml"
    proc = subprocess.run([PYTHON, "-m", "service.program", "serve", "--check", "--config", str(example)],
                          env=python_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "configuration OK" in proc.stdout, proc.stderr
    config = yaml.safe_load(example.read_text())
    config["disk"]["path"] = str(tmp_path / "disk")  # the example's paths, moved: tests run side by side
    daemon = launch.spawn({k: v for k, v in config.items() if k not in ("socket", "metrics_listen")})
    try:
        assert daemon.health() == 1  # SERVING
    finally:
        daemon.cleanup()


def test_the_configuration_reference_lists_exactly_the_daemons_keys():
    text = (ROOT / "docs" / "configuration.md").read_text()
    (reference,) = [b for b in blocks(ROOT / "docs" / "configuration.md", "yaml") if "max_concurrent_rpcs" in b]
    documented = yaml.safe_load(reference)
    tiers = {row.section: row.keys for row in LOWER_TIERS if row.parse is not None}
    fields = set(service_config._SCALARS) | set(service_config._SECTIONS) | set(tiers)
    assert set(documented) == fields
    assert set(documented["pools"][0]) == set(service_config.DEFAULT_POOL)
    assert set(documented["pools"][0]["spec"]) == set(service_config.DEFAULT_POOL["spec"])
    for section, keys in tiers.items():
        assert set(documented[section]) == keys, section
    assert set(documented["events"]) == config_sections.EVENTS_KEYS
    assert set(documented["peering"]) == config_peering.PEERING_KEYS
    assert set(documented["peering"]["peers"][0]) == config_peering.PEER_KEYS
    for flag in ("--device", "--layout", "--num-blocks", "--host-capacity-mib", "--allow-overcommit", "--check"):
        assert flag in text


def test_the_docs_name_features_never_tracker_issues():
    """A reader cannot look up the project's tracker: docs name the feature instead."""
    pattern = re.compile(r"\b[Ii]ssues? #?\d+|\(#\d+\)")
    found = [f"{doc.relative_to(ROOT)}: {m.group(0)}" for doc in DOCS + HISTORY
             for m in pattern.finditer(doc.read_text())]
    assert found == []
