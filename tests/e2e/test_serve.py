"""`kvxfer serve` as operators meet it: configuration errors, TLS + token on TCP, grpcurl."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from kvxfer.client import Client
from kvxfer.core.errors import Unauthenticated
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from service import config as service_config
from tests.conftest import PYTHON, ROOT, python_env
from tests.e2e.conftest import SMALL_POOL

pytestmark = pytest.mark.e2e
GRPCURL = str(Path(sys.executable).parent / "grpcurl")

BAD_CONFIGS = {
    "unknown setting": ({"sockett": "/tmp/x.sock"}, "unknown settings ['sockett' (did you mean 'socket'?)]"),
    "bad mode": ({"socket_mode": "999"}, "expected an octal mode"),
    "bad workers": ({"workers": 0}, "workers: must be at least 1"),
    "bad level": ({"log_level": "loud"}, "log_level"),
    "tcp without tls": ({"listen": "127.0.0.1:7777"}, "refusing to serve without TLS and a token"),
    "bad listen": ({"listen": "nowhere", "tls_cert": "/etc/hostname", "tls_key": "/etc/hostname",
                    "token_file": "/etc/hostname"}, "must be HOST:PORT"),
    "missing socket dir": ({"socket": "/nonexistent/dir/k.sock"}, "does not exist"),
    "bad layout": ({"pools": [{**SMALL_POOL, "layout": "XYZ"}]}, "unknown layout"),
    "bad dtype": ({"pools": [{**SMALL_POOL, "spec": {"dtype": "float64"}}]}, "unknown dtype"),
    "bad spec key": ({"pools": [{**SMALL_POOL, "spec": {"num_layer": 3}}]}, "unknown keys ['num_layer']"),
    "spec not a mapping": ({"pools": [{**SMALL_POOL, "spec": "abc"}]}, "pools[0].spec: must be a mapping"),
    "zero blocks": ({"pools": [{**SMALL_POOL, "spec": {"num_blocks": 0}}]}, "pools[0]: spec.num_blocks"),
    "bad device": ({"pools": [{**SMALL_POOL, "device": "tpu"}]}, "device"),
    "tiny host tier": ({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.001}]}, "holds no block"),
    "duplicate pool ids": ({"pools": [SMALL_POOL, SMALL_POOL]}, "ids must be unique"),
    "bad group": ({"socket_group": "no-such-group-kvx"}, "unknown group"),
    "socket path too long": ({"socket": "/tmp/" + "s" * 110}, "too long"),
    "newline pool id": ({"pools": [{**SMALL_POOL, "id": "evil\n"}]}, "pools[0].id"),
    "huge pool id": ({"pools": [{**SMALL_POOL, "id": "p" * 100_000}]}, "long)"),
    "per-client above pool bound": ({"max_jobs_per_client": 300}, "max_jobs_per_client"),
    "one client may fill the queue": ({"max_jobs_per_client": 256}, "one client can never take every job place"),
    "no GPU copy deadline": ({"gpu_copy_deadline_s": 0}, "gpu_copy_deadline_s"),
    "batch above maximum": ({"max_batch_blocks": 70000}, "max_batch_blocks"),
    "negative retention": ({"cache_group_retention_s": -1}, "cache_group_retention_s"),
    "no copy threads": ({"copy_threads": 0}, "copy_threads: must be 1-64"),
    "too many copy threads": ({"copy_threads": 1000}, "copy_threads: must be 1-64"),
    "removed shm setting": ({"shm_dir": "/dev/shm"}, "unknown settings ['shm_dir'"),
    "fractional workers": ({"workers": 2.7}, "expected an integer"),  # was truncated to 2 (issue 31)
    "fractional copy threads": ({"copy_threads": 1.9}, "copy_threads (from config file"),
}


def test_a_bad_value_names_where_it_came_from(tmp_path):
    """Issue 31, item 5: an environment variable or a flag is named in the message, not only the setting."""
    with pytest.raises(service_config.ConfigError, match="workers \\(from environment variable KVXFER_WORKERS\\)"):
        service_config.load(None, env={"KVXFER_WORKERS": "abc"})
    with pytest.raises(service_config.ConfigError, match="log_level"):
        service_config.load(None, env={}, overrides={"log_level": "loud"})
    with pytest.raises(service_config.ConfigError, match="socket_mode \\(from flag --socket-mode\\)"):
        service_config.load(None, env={}, overrides={"socket_mode": "abc"})


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_is_a_one_line_error(tmp_path, case):
    settings, message = BAD_CONFIGS[case]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), **settings}))
    proc = subprocess.run([PYTHON, "-m", "service.program", "serve", "--config", str(path)], env=python_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and len(lines[0]) < 1000, proc.stderr[:2000]
    assert "Traceback" not in proc.stderr


def test_environment_and_flags_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"workers": 3, "log_level": "debug"}))
    cfg = service_config.load(str(path), env={"KVXFER_WORKERS": "5", "KVXFER_SOCKET_MODE": "0600"},
                              overrides={"log_level": "warning"})
    assert (cfg.workers, cfg.socket_mode, cfg.log_level) == (5, 0o600, "warning")
    assert cfg.pools[0].id == "rank0" and cfg.pools[0].spec.num_layers == 24  # the embedded default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is installed by .ci/run")
def test_tcp_needs_tls_and_token(make_daemon, tmp_path):
    cert, key, token = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    token.write_text("s3cret-token\n")
    port = _free_port()
    daemon = make_daemon({"listen": f"127.0.0.1:{port}", "tls_cert": str(cert), "tls_key": str(key),
                          "token_file": str(token)})
    target = f"127.0.0.1:{port}"
    with Client(target, root_certificates=cert.read_bytes(), token="s3cret-token") as client:
        assert client.pools()[0].pool_id == "rank0"
    with Client(target, root_certificates=cert.read_bytes(), token="wrong") as client:
        with pytest.raises(Unauthenticated):
            client.pools()
    with Client(daemon.target) as client:  # the socket needs the token as well
        with pytest.raises(Unauthenticated):
            client.pools()
    with Client(daemon.target, token="s3cret-token") as client:
        assert client.pools()[0].pool_id == "rank0"
    with grpc.insecure_channel(target) as channel:  # plaintext to a TLS port fails
        stub = pb_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetPoolInfo(pb.GetPoolInfoRequest(), timeout=5, metadata=(("authorization", "Bearer s3cret-token"),))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpcurl_lists_describes_and_calls_through_reflection(make_daemon):
    daemon = make_daemon()

    def grpcurl(*args: str, data: str | None = None) -> str:
        flags = ["-d", data] if data is not None else []  # flags before the address (the socket path)
        proc = subprocess.run([GRPCURL, "-plaintext", "-unix", *flags, daemon.socket, *args], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    services = grpcurl("list").split()
    assert {"kvxfer.v1.KVTransfer", "grpc.health.v1.Health"} <= set(services)
    methods = grpcurl("list", "kvxfer.v1.KVTransfer").split()
    assert {f"kvxfer.v1.KVTransfer.{m}" for m in ("GetPoolInfo", "Offload", "Restore", "Lookup", "Delete",
                                                  "Stats")} <= set(methods)
    assert "repeated uint32 slots" in grpcurl("describe", "kvxfer.v1.OffloadRequest")
    info = json.loads(grpcurl("kvxfer.v1.KVTransfer/GetPoolInfo", data="{}"))
    pool = info["pools"][0]
    assert pool["layout_name"] == "BLHNC" and pool["handle"]["medium"] == "MEDIUM_MEMFD"
    offload = {"pool": {"pool_id": "rank0", "epoch": pool["epoch"]}, "namespace": "grpcurl", "slots": [3],
               "keys": ["a2V5"]}
    reply = json.loads(grpcurl("kvxfer.v1.KVTransfer/Offload", data=json.dumps(offload)))
    assert reply["statuses"] == ["BLOCK_STATUS_DONE"]
    stats = json.loads(grpcurl("kvxfer.v1.KVTransfer/Stats", data="{}"))
    assert stats["pools"][0]["tiers"][0]["used_blocks"] == "1"
    assert json.loads(grpcurl("grpc.health.v1.Health/Check"))["status"] == "SERVING"


def test_every_socket_gets_the_configured_mode_and_group(make_daemon):
    import grp
    import os
    import stat

    group = grp.getgrgid(os.getgid()).gr_name
    daemon = make_daemon({"socket_mode": "0600", "socket_group": group})
    for path in (daemon.socket, daemon.socket + ".fd", daemon.socket + ".lane"):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == os.getgid()
    with Client(daemon.target) as client:  # the pool is a sealed memfd: no file to mode
        assert client.pool_info().handle.path == ""


def test_a_cuda_pool_without_a_gpu_is_a_one_line_error_naming_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "pools": [{**SMALL_POOL, "device": "cuda:0"}]}))
    proc = subprocess.run([PYTHON, "-m", "service.program", "serve", "--config", str(path)], env=python_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "cuda:0" in lines[0] and ("driver" in lines[0] or "device" in lines[0] or "cuda-python" in lines[0])


def test_the_start_up_log_names_each_pools_copy_engine(make_daemon):
    daemon = make_daemon({"copy_threads": 3})
    ready = [json.loads(line) for line in daemon.log_text().splitlines() if '"pool ready"' in line]
    assert [r["copy_engine"] for r in ready] == ["CpuCopyEngine (C loop, 3 threads)"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is installed by .ci/run")
def test_health_checks_a_tls_daemon_and_tells_a_tls_failure_from_an_absent_daemon(make_daemon, tmp_path):
    """Issue 50: ``kvxfer health`` had no ``--ca`` nor ``--token-file``, and a certificate the client does not
    trust read as "no daemon answers"."""
    def cert(name: str) -> Path:
        path = tmp_path / f"{name}.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / name),
                        "-out", str(path), "-days", "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
        return path

    served, stranger, token = cert("served"), cert("stranger"), tmp_path / "token"
    token.write_text("s3cret-token\n")
    port = _free_port()
    make_daemon({"listen": f"127.0.0.1:{port}", "tls_cert": str(served), "tls_key": str(tmp_path / "served"),
                 "token_file": str(token)})

    def health(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "service.program", "health", "--timeout", "10", *args], env=python_env(),
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    ok = health("--target", f"127.0.0.1:{port}", "--ca", str(served), "--token-file", str(token))
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    untrusted = health("--target", f"127.0.0.1:{port}", "--ca", str(stranger), "--token-file", str(token))
    assert untrusted.returncode == 1 and "TLS handshake" in untrusted.stderr, untrusted.stderr
    absent = health("--target", f"127.0.0.1:{_free_port()}", "--ca", str(served), "--token-file", str(token))
    assert absent.returncode == 1 and "no daemon answers" in absent.stderr, absent.stderr
    for result in (ok, untrusted, absent):
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 1
