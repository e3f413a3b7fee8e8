"""Start-up as an operator meets it (issue 31, items 4, 6, 7): devices first, memory checked,
listeners bound before anything is allocated, the common settings as flags, --check."""

import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from kvxfer.client import Client
from kvxfer.core.errors import ResourceExhausted
from kvxfer.core.records import Medium
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory import room
from kvxfer.memory.pool import PoolHandle
from service import config as service_config
from service import preflight
from tests.conftest import PYTHON, ROOT, python_env

pytestmark = pytest.mark.e2e
GIB = 1 << 30


def serve(tmp_path: Path, *flags: str, config: dict | None = None, timeout: float = 120):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "metrics_listen": "", **(config or {})}))
    return subprocess.run([PYTHON, "-m", "service.program", "serve", "--config", str(path), *flags], env=python_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_the_room_is_the_smaller_of_memavailable_and_the_cgroups(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   8388608 kB\n")  # 8 GiB
    (tmp_path / "cg" / "pod").mkdir(parents=True)
    (tmp_path / "proc_cgroup").write_text("0::/pod\n")
    (tmp_path / "cg" / "pod" / "memory.max").write_text(str(4 * GIB))
    (tmp_path / "cg" / "pod" / "memory.current").write_text(str(GIB))
    measured = room.measure(tmp_path / "cg", meminfo, tmp_path / "proc_cgroup")
    assert (measured.available, measured.cgroup_limit, measured.usable) == (8 * GIB, 4 * GIB, 3 * GIB)
    (tmp_path / "cg" / "pod" / "memory.max").write_text("max\n")  # v2's "no limit"
    assert room.measure(tmp_path / "cg", meminfo, tmp_path / "proc_cgroup").usable == 8 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * GIB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(GIB // 2))
    assert room.measure(v1, meminfo, tmp_path / "none").usable == GIB + GIB // 2
    with pytest.raises(ResourceExhausted, match=r"needs 3\.0 GiB; 1\.5 GiB free here"):
        room.ensure(3 * GIB, "this", room.measure(v1, meminfo, tmp_path / "none"))


def test_the_need_counts_cpu_pools_one_host_tier_a_group_and_disk_queues(tmp_path):
    pool = {"id": "a", "device": "cpu", "spec": {"num_blocks": 1024}, "host_capacity_mib": 512}
    raw = {"pools": [pool, {**pool, "id": "b", "cache_group": "a"}], "disk": {"path": str(tmp_path / "d"),
                                                                             "capacity_mib": 1024, "queue_blocks": 100}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), **raw}))
    cfg = service_config.load(str(tmp_path / "c.yaml"), env={})
    need = preflight.memory_need(cfg)
    block = cfg.pools[0].spec.block_bytes
    tier = (512 << 20) // block * block
    assert (need.pools, need.host_tiers, need.staging, need.registered) == (2 * 1024 * block, tier, 100 * block,
                                                                            512 << 20)
    tight = room.Room(available=need.total - 1, cgroup_limit=None)
    figures = ("CPU pools 384 MiB, host tiers 512 MiB, lower-tier staging 19 MiB, registered pools' host tiers "
               "512 MiB")
    with pytest.raises(ResourceExhausted, match=f"{figures}.*--allow-overcommit"):
        preflight.check(cfg, tight)
    assert preflight.check(service_config.load(str(tmp_path / "c.yaml"), env={},
                                               overrides={"allow_overcommit": True}), tight).pools[0].device == "cpu"
    assert not (tmp_path / "d").exists()  # validation changed nothing: the disk tier makes its directory


def test_the_registered_pools_host_tiers_count_too(tmp_path):
    """Issue 50: 64 GiB of registered host tiers passed --check on a 20 GiB host."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"),
                                                     "registered_host_capacity_mib": 16 << 10, "registered_ranks": 4}))
    cfg = service_config.load(str(tmp_path / "c.yaml"), env={})
    assert preflight.memory_need(cfg).registered == 64 << 30
    with pytest.raises(ResourceExhausted, match="registered pools' host tiers 64.0 GiB.*registered_host_capacity_mib"):
        preflight.check(cfg, room.Room(available=20 << 30, cgroup_limit=None))
    for bad in ({"registered_ranks": -1}, {"registered_ranks": 9}, {"registered_ranks": 2, "allow_register": False}):
        with pytest.raises(service_config.ConfigError, match="registered_ranks"):
            service_config.load(None, env={}, overrides=bad)
    quiet = service_config.load(None, env={}, overrides={"registered_ranks": 0, "allow_register": False})
    assert preflight.memory_need(quiet).registered == 0
    # allow_register false alone (registered_ranks left at its default): loaded, nothing counted for registrations
    closed = service_config.load(None, env={}, overrides={"allow_register": False})
    assert closed.registered_ranks == 1 and preflight.memory_need(closed).registered == 0


def test_a_configuration_larger_than_the_machine_is_refused_in_one_line_before_allocating(tmp_path):
    huge = int(room.measure().usable * 1.5) // (192 << 10)  # blocks of the default geometry
    line = one_line(serve(tmp_path, "--num-blocks", str(huge), "--device", "cpu"), 1, "memory:", "GiB free here",
                    "--allow-overcommit")
    assert "CPU pools" in line
    one_line(serve(tmp_path, "--host-capacity-mib", "100000000", "--device", "cpu"), 1, "host tiers")
    # Asked for anyway, a mapping the kernel refuses is still one line.
    one_line(serve(tmp_path, "--host-capacity-mib", "100000000", "--allow-overcommit", "--device", "cpu"), 1,
             "host tier: cannot map")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for a machine without a GPU")
def test_a_gpu_asked_for_where_there_is_none_is_one_line_naming_the_pool(tmp_path):
    one_line(serve(tmp_path, "--device", "cuda"), 1, "pools[0].device: cuda:", "--device cpu")


def test_a_busy_metrics_port_fails_before_the_pools_are_allocated(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = serve(tmp_path, "--metrics-listen", f"127.0.0.1:{port}", "--log-level", "info")
    assert proc.returncode == 1 and "cannot listen on" in proc.stderr, proc.stderr[-2000:]
    assert "pool ready" not in proc.stderr  # nothing was allocated before the refusal


def test_check_prints_what_would_be_served_and_changes_nothing(tmp_path):
    disk = tmp_path / "var" / "kvxfer"
    proc = serve(tmp_path, "--check", "--device", "cpu", "--layout", "LBHNC", "--num-blocks", "64",
                 "--host-capacity-mib", "16", config={"disk": {"path": str(disk), "capacity_mib": 1024}})
    assert proc.returncode == 0, proc.stderr
    assert "pool rank0: cpu, LBHNC, 64 blocks of 196608 bytes, host tier 16.0 MiB" in proc.stdout
    assert "configuration OK" in proc.stdout
    assert not disk.exists() and not (tmp_path / "k.sock").exists()


def test_flags_set_every_configured_pool(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"pools": [{"id": "r0"}, {"id": "r1", "spec": {"block_size": 8}}]}))
    cfg = service_config.load(str(tmp_path / "c.yaml"), env={},
                              pool_overrides={"device": "cpu", "num_blocks": 32, "layout": "LBHNC"})
    assert [(p.id, p.device, p.spec.num_blocks, p.layout.name, p.spec.block_size) for p in cfg.pools] == \
        [("r0", "cpu", 32, "LBHNC", 16), ("r1", "cpu", 32, "LBHNC", 8)]


def test_a_registration_whose_host_tier_cannot_fit_is_refused(make_daemon):
    """A registered pool's host tier is checked when it is made: RESOURCE_EXHAUSTED, and the daemon serves on."""
    # A TiB a registration may ask for; none is expected at start (registered_ranks 0: --check counts none)
    daemon = make_daemon({"registered_host_capacity_mib": 1 << 20, "registered_ranks": 0})
    spec = KVSpec(2, 16, 4, 2, 8, torch.float16)
    engine = daemon.shm_dir / "engine"
    engine.write_bytes(bytes(spec.nbytes))
    with Client(daemon.target) as client:
        with pytest.raises(ResourceExhausted, match="the host tier of pool .eng. needs 1024.0 GiB"):
            client.register_pool("eng", spec, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(engine)),
                                 host_capacity_mib=1 << 20)
        client.register_pool("eng", spec, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(engine)),
                             host_capacity_mib=4)
        assert client.health() == "SERVING"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cert(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    return cert, key


@pytest.mark.parametrize("case", ["another certificate's key", "swapped"])
def test_a_certificate_and_a_key_that_do_not_match_are_refused_by_check_in_one_line(tmp_path, case):
    """Issue 50: they passed ``serve --check``, then ``serve`` died in a 40-line traceback at bind."""
    (cert, key), (_, other_key) = _cert(tmp_path, "a"), _cert(tmp_path, "b")
    token = tmp_path / "token"
    token.write_text("a-token\n")
    pair = {"another certificate's key": (cert, other_key), "swapped": (key, cert)}[case]
    config = {"listen": f"127.0.0.1:{_free_port()}", "tls_cert": str(pair[0]), "tls_key": str(pair[1]),
              "token_file": str(token)}
    for flags in (("--check",), ()):
        one_line(serve(tmp_path, *flags, config=config), 2, "tls_cert, tls_key", "not a certificate and its")


def test_a_busy_listen_port_is_one_line_naming_the_cause(tmp_path):
    cert, key = _cert(tmp_path, "a")
    token = tmp_path / "token"
    token.write_text("a-token\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = {"listen": f"127.0.0.1:{busy.getsockname()[1]}", "tls_cert": str(cert), "tls_key": str(key),
                  "token_file": str(token)}
        proc = serve(tmp_path, "--log-level", "error", config=config)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "cannot listen on 127.0.0.1:" in proc.stderr and "Address already in use" in proc.stderr


def test_publishing_events_without_pyzmq_is_refused_by_check(tmp_path):
    """Issue 50: a plain wheel passed ``--check`` with ``events.publish`` set, then ``serve`` failed on zmq."""
    blocker = tmp_path / "no_zmq"
    blocker.mkdir()
    (blocker / "zmq.py").write_text("raise ImportError('No module named zmq', name='zmq')\n")  # as if absent
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "metrics_listen": "",
                                    "events": {"publish": "tcp://127.0.0.1:5599"}}))
    env = {**python_env(), "PYTHONPATH": f"{blocker}:{python_env().get('PYTHONPATH', '')}"}
    proc = subprocess.run([PYTHON, "-m", "service.program", "serve", "--check", "--config", str(path)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    one_line(proc, 2, "events.publish: needs zmq", "kvxfer[events]")


def test_a_misspelt_kvxfer_variable_is_warned_about_with_the_name_meant(tmp_path):
    """Issue 50: ``KVXFER_METRIC_LISTEN`` (for ``KVXFER_METRICS_LISTEN``) was ignored in silence."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "metrics_listen": ""}))
    env = {**python_env(), "KVXFER_METRIC_LISTEN": "127.0.0.1:9999", "KVXFER_NATIVE": "1"}
    proc = subprocess.run([PYTHON, "-m", "service.program", "serve", "--check", "--config", str(path)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: environment variable KVXFER_METRIC_LISTEN names no setting and is ignored "
                        "(did you mean KVXFER_METRICS_LISTEN?)"]


def test_log_format_from_the_flag(tmp_path):
    """Issue 50: ``--log-format`` (json, one object a line, or text) as a flag, like ``--log-level``."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "metrics_listen": ""}))
    proc = subprocess.Popen([PYTHON, "-m", "service.program", "serve", "--config", str(path), "--log-format", "text"],
                            env=python_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # (ends with the daemon; the hang guard is pytest's timeout)
            lines.append(line)
            if "listening" in line:
                break
        assert lines and not any(line.startswith("{") for line in lines) and " info kvxfer.server: listening" in line
    finally:
        proc.terminate()
        proc.wait(60)
    one_line(serve(tmp_path, "--log-format", "xml", "--check"), 2, "log_format", "xml")
