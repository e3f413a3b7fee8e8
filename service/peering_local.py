"""Daemons that peer on one machine (loopback): a self-signed certificate, a token, their configs.

For ``kvxfer bench peer-transfer`` and the tests; a deployment's peers have real certificates
(docs/peering.md).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

TRANSPORTS = {"shm": "", "tcp": "tcp"}  # UCX_TLS: its default (shared memory, cma) or TCP alone


@dataclass(frozen=True)
class Tls:
    cert: Path
    key: Path
    token: Path


def self_signed(where: Path, token: str) -> Tls:
    """A certificate for localhost and 127.0.0.1 (its own CA), its key, and a token file, in ``where``."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is needed to make a certificate for loopback peers")
    cert, key, token_file = where / "cert.pem", where / "key.pem", where / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    token_file.write_text(token + "\n")
    return Tls(cert, key, token_file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peering_configs(names: list[str], tls: Tls, transport: str, pools: dict[str, dict], also: tuple[str, ...] = (),
                    per_daemon: dict | None = None, **peering) -> dict[str, dict]:
    """Daemon configs for ``names``, each the peer of all others and of ``also`` (peers not started
    here). ``pools``: name -> its pool; ``per_daemon``: name -> peering settings of that one only."""
    ports = {name: free_port() for name in [*names, *also]}
    configs = {}
    for name in names:
        peers = [{"name": other, "address": f"127.0.0.1:{ports[other]}", "tls_ca": str(tls.cert),
                  "token_file": str(tls.token)} for other in [*names, *also] if other != name]
        configs[name] = {"listen": f"127.0.0.1:{ports[name]}", "tls_cert": str(tls.cert), "tls_key": str(tls.key),
                         "token_file": str(tls.token), "pools": [pools[name]],
                         "peering": {"name": name, "peers": peers, "ucx_net_devices": "lo",
                                     "ucx_tls": TRANSPORTS[transport], **peering,
                                     **(per_daemon or {}).get(name, {})}}
    return configs
