"""The device check's driver and bootstrap, on CPU: what a lent GPU machine runs first must not fail
on its own plumbing (packages from carried wheels, time caps, a writable Triton cache)."""

import importlib
import json
import os
import sys
import time
import zipfile

import pytest

from kvxfer.devcheck import bootstrap
from kvxfer.devcheck.report import run_stages


def _wheel(directory, name: str, version: str = "1.0") -> None:
    """A minimal pure-Python wheel providing module ``name`` (VALUE = 42)."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


def test_the_carried_wheels_come_first_whatever_is_installed(tmp_path, monkeypatch):
    """Issue 47 item 1: the lent machine may have no pip and older protobuf and grpcio: the carried wheels
    are unpacked (no pip) first on the path, also where a version of them is installed."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv(bootstrap.REEXEC, raising=False)
    monkeypatch.setattr(bootstrap.tempfile, "tempdir", str(tmp_path))  # (the unpacked wheels go there)
    installed = tmp_path / "site"  # an older version installed on the machine
    (installed / "kvxfer_probe_old").mkdir(parents=True)
    (installed / "kvxfer_probe_old" / "__init__.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(installed))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "kvxfer_probe_pkg")
    _wheel(wheels, "kvxfer_probe_old")
    packages = {"kvxfer_probe_pkg": "kvxfer-probe-pkg", "kvxfer_probe_old": "kvxfer-probe-old", "json": "stdlib"}
    done = bootstrap.unpack(wheels, packages)
    assert done["unpacked"] == ["kvxfer_probe_old-1.0-py3-none-any.whl", "kvxfer_probe_pkg-1.0-py3-none-any.whl"]
    assert sys.path[0] == done["target"] and not done["reexec"]
    assert importlib.import_module("kvxfer_probe_pkg").VALUE == 42
    assert importlib.import_module("kvxfer_probe_old").VALUE == 42  # the carried one, not the installed one
    assert os.environ["PYTHONPATH"] == f"{done['target']}{os.pathsep}/somewhere"  # for the daemon it starts too
    assert any(line.startswith(f"kvxfer_probe_old 1.0 from {done['target']}") for line in bootstrap.loaded(packages))
    again = bootstrap.unpack(wheels, packages)  # imported before the bootstrap: the check must start again
    assert again["reexec"] and again["imported_before"] == ["kvxfer_probe_old", "kvxfer_probe_pkg"]
    with pytest.raises(RuntimeError, match="make devcheck-wheels"):
        bootstrap.unpack(wheels, {"kvxfer_not_carried": "kvxfer-not-carried"})


def test_only_wheels_this_interpreter_loads_are_unpacked():
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    import platform

    arch = platform.machine()
    assert bootstrap.loadable("x-1.0-py3-none-any.whl")
    assert bootstrap.loadable(f"x-1.0-{here}-{here}-manylinux_2_17_{arch}.manylinux2014_{arch}.whl")
    assert bootstrap.loadable(f"x-1.0-cp39-abi3-manylinux2014_{arch}.whl")  # the stable ABI of 3.9 and later
    assert not bootstrap.loadable(f"x-1.0-cp399-abi3-manylinux2014_{arch}.whl")
    assert not bootstrap.loadable("x-1.0-cp27-cp27mu-manylinux1_x86_64.whl")
    assert not bootstrap.loadable(f"x-1.0-{here}-{here}-win_amd64.whl")
    assert not bootstrap.loadable("not-a-wheel.whl")


def test_every_package_the_daemon_needs_has_a_wheel_in_the_makefile():
    makefile = (bootstrap.Path(__file__).parents[2] / "Makefile").read_text()
    carried = makefile.split("DEVCHECK_WHEELS :=")[1].split("devcheck-wheels:")[0]
    for dist in bootstrap.PACKAGES.values():
        assert f"{dist}==" in carried, dist


def test_an_unwritable_triton_cache_is_replaced(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "ok"))
    assert bootstrap.writable_triton_cache() == str(tmp_path / "ok")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/proc/kvxfer-cannot-write-here")
    replaced = bootstrap.writable_triton_cache()
    assert replaced != "/proc/kvxfer-cannot-write-here" and os.access(replaced, os.W_OK)


def test_a_stage_past_its_cap_is_stopped_and_the_budget_skips_the_rest(tmp_path):
    def quick(ctx):
        return {"prepared": ctx["prepared"]}

    def hangs(ctx):
        time.sleep(30)

    def broken(ctx):
        raise KeyError("a typo in the report code")

    status = run_stages(str(tmp_path), [("quick", quick), ("hangs", hangs, 0.5), ("broken", broken),
                                        ("late", quick)], prepared={"copy_loop": "x"}, budget_s=2.0)
    report = json.loads((tmp_path / "devcheck.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert status == 1 and report["prepared"] == {"copy_loop": "x"}
    assert stages["quick"]["ok"] and stages["quick"]["result"] == {"prepared": {"copy_loop": "x"}}
    assert "StageTimeout" in stages["hangs"]["error"] and stages["hangs"]["seconds"] < 2
    assert "KeyError" in stages["broken"]["error"]
    assert stages["late"]["ok"] and report["failed_stages"] == 2
    over = run_stages(str(tmp_path), [("hangs", hangs, 5), ("never", quick)], budget_s=1.0)
    report = json.loads((tmp_path / "devcheck.json").read_text())
    assert over == 1 and report["stages"][1] == {"stage": "never", "ok": False,
                                                 "skipped": "the run's time budget was spent"}
