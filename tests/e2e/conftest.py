"""A real daemon subprocess per test (or module), and helpers to run client processes."""

import json
import subprocess

import pytest

from kvxfer.bench import launch
from kvxfer.bench.launch import DaemonProcess
from tests.conftest import PYTHON, ROOT, python_env

SMALL_POOL = {"id": "rank0", "device": "cpu", "layout": "BLHNC",
              "spec": {"num_layers": 4, "num_blocks": 64, "block_size": 16, "num_kv_heads": 2, "head_size": 32,
                       "dtype": "float16"},
              "host_capacity_mib": 2}


def start_daemon(config: dict, wait: bool = True) -> DaemonProcess:
    return launch.spawn({"grace_period_s": 10, "log_level": "debug", "pools": [SMALL_POOL], **config}, wait)


@pytest.fixture
def make_daemon():
    started = []

    def make(config: dict | None = None, wait: bool = True) -> DaemonProcess:
        daemon = start_daemon(config or {}, wait)
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        daemon.cleanup()


@pytest.fixture(scope="module")
def daemon():
    """One daemon shared by a module's tests (they use distinct namespaces)."""
    d = start_daemon({"pools": [SMALL_POOL, {**SMALL_POOL, "id": "lbhnc", "layout": "LBHNC"}]})
    yield d
    d.cleanup()


def run_worker(function: str, *args, timeout: float = 120) -> dict:
    """Run ``tests/e2e/workers.py:function(*args)`` in a new Python process; return its JSON result."""
    proc = subprocess.run([PYTHON, "-m", "tests.e2e.workers", function, json.dumps(args)], env=python_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker {function} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_worker(function: str, *args) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "tests.e2e.workers", function, json.dumps(args)], env=python_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SOCKET_GROUP, ATTACKER, VICTIM = "kvxsock", "kvxatk", "kvxvic"


def _drop_users() -> None:
    for user in (ATTACKER, VICTIM):
        subprocess.run(["userdel", user], capture_output=True)
    subprocess.run(["groupdel", SOCKET_GROUP], capture_output=True)


@pytest.fixture(scope="session")
def unix_users():
    """A socket group and two users in it (an attacker and a victim), created as root and removed after."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the attack tests create Unix users: run them as root (CI does)")
    _drop_users()
    subprocess.run(["groupadd", SOCKET_GROUP], check=True)
    for user in (ATTACKER, VICTIM):
        subprocess.run(["useradd", "-M", "-N", "-g", SOCKET_GROUP, "-s", "/usr/sbin/nologin", user], check=True)
    yield SOCKET_GROUP, ATTACKER, VICTIM
    _drop_users()


def run_as(user: str, function: str, *args, timeout: float = 300) -> dict:
    """Run ``tests/e2e/attacker.py:function(*args)`` as another user; return its JSON result."""
    proc = subprocess.run([PYTHON, "-m", "tests.e2e.attacker", "--user", user, function, json.dumps(args)],
                          env=python_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{function} as {user} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_as(user: str, function: str, *args) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "tests.e2e.attacker", "--user", user, function, json.dumps(args)],
                            env=python_env(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
