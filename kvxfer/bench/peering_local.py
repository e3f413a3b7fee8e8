"""Daemons that peer on one machine (loopback): a CA, a certificate per daemon, a token, their configs.

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
    """A CA (``ca``: what every daemon checks the others' certificates against) and a token file."""

    ca: Path
    ca_key: Path
    token: Path

    def issue(self, name: str) -> tuple[Path, Path]:
        """A certificate (and its key) for daemon ``name``: its TLS listener's (localhost, 127.0.0.1) and its
        identity when it calls its peers (the name in the subject and as a DNS name). Made once."""
        where = self.ca.parent
        cert, key = where / f"{name}.pem", where / f"{name}.key"
        if not cert.exists():
            csr = where / f"{name}.csr"
            ext = where / f"{name}.ext"
            ext.write_text(f"subjectAltName=DNS:{name},DNS:localhost,IP:127.0.0.1\n"
                           "extendedKeyUsage=serverAuth,clientAuth\n")
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj",
                     f"/CN={name}")
            _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
                     "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))
        return cert, key


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is needed to make certificates for loopback peers")
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def self_signed(where: Path, token: str) -> Tls:
    """A CA of its own and a token file in ``where``; ``Tls.issue`` makes each daemon's certificate."""
    ca, ca_key, token_file = where / "ca.pem", where / "ca.key", where / "token"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", "/CN=kvxfer test CA")
    token_file.write_text(token + "\n")
    return Tls(ca, ca_key, token_file)


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
        peers = [{"name": other, "address": f"127.0.0.1:{ports[other]}", "tls_ca": str(tls.ca),
                  "token_file": str(tls.token)} for other in [*names, *also] if other != name]
        cert, key = tls.issue(name)
        configs[name] = {"listen": f"127.0.0.1:{ports[name]}", "tls_cert": str(cert), "tls_key": str(key),
                         "token_file": str(tls.token), "pools": [pools[name]],
                         "peering": {"name": name, "peers": peers, "ucx_net_devices": "lo",
                                     "tls_client_ca": str(tls.ca),
                                     "ucx_tls": TRANSPORTS[transport], **peering,
                                     **(per_daemon or {}).get(name, {})}}
    return configs
