"""Real daemons that are each other's peers on loopback: TLS, a token, NIXL over UCX."""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from kvxfer.client import Client
from service.launch import DaemonProcess
from tests.e2e.conftest import SMALL_POOL, start_daemon
from tests.helpers import read_block, write_block

TOKEN = "peer-s3cret-token"
TRANSPORTS = {"shm": "", "tcp": "tcp"}  # UCX_TLS: its default (shared memory, cma) or TCP alone


@dataclass(frozen=True)
class Tls:
    cert: Path
    key: Path
    token: Path


def make_tls(where: Path) -> Tls:
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is needed (installed by .ci/run)")
    cert, key, token = where / "cert.pem", where / "key.pem", where / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    token.write_text(TOKEN + "\n")
    return Tls(cert, key, token)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peering_configs(names: list[str], tls: Tls, transport: str = "shm", pools: dict | None = None,
                    also: tuple[str, ...] = (), per_daemon: dict | None = None, **peering) -> dict[str, dict]:
    """Daemon configs for ``names``, each the peer of all others and of ``also`` (peers not started
    here: a test's own hand-written peer). ``per_daemon``: name -> peering settings of that one."""
    ports = {name: free_port() for name in [*names, *also]}
    configs = {}
    for name in names:
        peers = [{"name": other, "address": f"127.0.0.1:{ports[other]}", "tls_ca": str(tls.cert),
                  "token_file": str(tls.token)} for other in [*names, *also] if other != name]
        configs[name] = {"listen": f"127.0.0.1:{ports[name]}", "tls_cert": str(tls.cert), "tls_key": str(tls.key),
                         "token_file": str(tls.token), "pools": [(pools or {}).get(name, SMALL_POOL)],
                         "peering": {"name": name, "peers": peers, "ucx_net_devices": "lo",
                                     "ucx_tls": TRANSPORTS[transport], **peering,
                                     **(per_daemon or {}).get(name, {})}}
    return configs


def start_cluster(names: list[str], tls: Tls, transport: str = "shm", **kwargs) -> dict[str, DaemonProcess]:
    configs = peering_configs(names, tls, transport, **kwargs)
    started: dict[str, DaemonProcess] = {}
    try:
        for name in names:
            started[name] = start_daemon(configs[name])
    except BaseException:
        for d in started.values():
            d.cleanup()
        raise
    return started


def client(daemon: DaemonProcess, namespace: str = "peers", **kwargs) -> Client:
    return Client(daemon.target, namespace, pool_id="rank0", token=TOKEN, **kwargs)


def fill(c: Client, slots: list[int], seed: int) -> dict[int, torch.Tensor]:
    """Random bytes into each pool block; returns what each holds."""
    pool = c.map_pool()
    g = torch.Generator().manual_seed(seed)
    written = {}
    for slot in slots:
        data = torch.randint(0, 256, (pool.layout.block_bytes,), dtype=torch.uint8, generator=g)
        write_block(pool.storage, pool.layout, slot, data)
        written[slot] = data
    return written


def block(c: Client, slot: int) -> torch.Tensor:
    pool = c.map_pool()
    return read_block(pool.storage, pool.layout, slot)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]
