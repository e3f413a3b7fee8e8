"""The config file's ``peering`` section: this daemon among other nodes' daemons (NIXL).

Validated whole at start-up; tokens are read from files (never in the config), every peer
is reached over TLS against a CA file, and names are unique.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.peering.settings import DEFAULT_UCX_MODULES, PeerAddress, PeeringSettings

PEERING_KEYS = {"name", "peers", "ucx_tls", "ucx_net_devices", "ucx_modules", "timeout_ms", "lease_ms",
                "max_lease_ms", "max_leases", "max_leased_blocks", "progress_interval_us", "max_leases_per_peer",
                "max_leased_blocks_per_peer", "host_share", "tls_client_ca", "tls_cert", "tls_key"}
PEER_KEYS = {"name", "address", "tls_ca", "token_file", "server_name"}
MAX_PEERS = 64
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
ADDRESS_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
UCX_LIST_RE = re.compile(r"[A-Za-z0-9_.:,^*-]{1,256}")  # UCX's own list syntax ("tcp", "^cma", "mlx5_0:1", "ib*")
TOKEN_RE = re.compile(r"[\x21-\x7e]{1,256}")
BOUNDS = {"timeout_ms": (1, 600_000), "lease_ms": (1, 600_000), "max_lease_ms": (1, 600_000),
          "max_leases": (1, 1 << 16), "max_leased_blocks": (1, 1 << 26), "progress_interval_us": (1, 100_000),
          "max_leases_per_peer": (1, 1 << 16), "max_leased_blocks_per_peer": (1, 1 << 26)}
MAX_HOST_SHARE = 0.9  # peers never hold the whole of a host tier: the local engine comes first


def peering(raw) -> PeeringSettings | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("peering: must be a mapping with a name and peers")
    unknown = set(raw) - PEERING_KEYS
    if unknown:
        raise ConfigError(f"peering: unknown keys {sorted(unknown)}; allowed: {sorted(PEERING_KEYS)}")
    name = raw.get("name", "")
    if name == "":
        name = socket.gethostname()  # a Kubernetes pod's name: each replica of one config its own
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ConfigError(f"peering.name: 1-63 letters, digits, '_', '.', '-' (this daemon's name among its "
                          f"peers; empty: this host's name), got {shown(name)}")
    numbers = {}
    for key, (low, top) in BOUNDS.items():
        value = raw.get(key, getattr(PeeringSettings, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ConfigError(f"peering.{key}: an integer in [{low}, {top}], got {shown(value)}")
        numbers[key] = value
    share = raw.get("host_share", PeeringSettings.host_share)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= MAX_HOST_SHARE:
        raise ConfigError(f"peering.host_share: the fraction of a host tier peers may hold, in (0, {MAX_HOST_SHARE}], "
                          f"got {shown(share)}")
    numbers["host_share"] = float(share)
    files = {key: raw.get(key, "") for key in ("tls_client_ca", "tls_cert", "tls_key")}
    for key, value in files.items():
        if not isinstance(value, str) or len(value) > 4096 or (value and not Path(value).is_file()):
            raise ConfigError(f"peering.{key}: {shown(value)} is not a readable file")
    if not files["tls_client_ca"]:
        raise ConfigError("peering.tls_client_ca: the CA file peers' client certificates are checked against "
                          "(mutual TLS: a peer is known by the name its certificate carries, the token besides)")
    if bool(files["tls_cert"]) != bool(files["tls_key"]):
        raise ConfigError("peering.tls_cert and peering.tls_key: both or neither (neither: the listener's)")
    numbers.update(files)
    ucx = {}
    for key in ("ucx_tls", "ucx_net_devices", "ucx_modules"):
        value = raw.get(key, DEFAULT_UCX_MODULES if key == "ucx_modules" else "")
        if not isinstance(value, str) or (value and not UCX_LIST_RE.fullmatch(value)):
            raise ConfigError(f"peering.{key}: a UCX list such as 'tcp' or 'eth0,mlx5_0:1', got {shown(value)}")
        ucx[key] = value
    peers = raw.get("peers", [])
    if not isinstance(peers, list) or len(peers) > MAX_PEERS:
        raise ConfigError(f"peering.peers: a list of at most {MAX_PEERS} peers")
    parsed = tuple(_peer(i, p) for i, p in enumerate(peers))
    names = [p.name for p in parsed]
    if len(set(names)) != len(names):
        raise ConfigError("peering.peers: names must be distinct")
    # One list for a whole fleet (the chart's StatefulSet shares one config): each daemon skips its own entry.
    return PeeringSettings(name, tuple(p for p in parsed if p.name != name), **ucx, **numbers)


def _peer(i: int, raw) -> PeerAddress:
    where = f"peering.peers[{i}]"
    if not isinstance(raw, dict) or set(raw) - PEER_KEYS or not {"name", "address", "tls_ca", "token_file"} <= set(raw):
        raise ConfigError(f"{where}: a mapping of name, address, tls_ca, token_file (and server_name)")
    text = {key: raw.get(key, "") for key in PEER_KEYS}
    if not all(isinstance(v, str) and len(v) <= 4096 for v in text.values()):
        raise ConfigError(f"{where}: every value is a string")
    if not NAME_RE.fullmatch(text["name"]):
        raise ConfigError(f"{where}.name: 1-63 letters, digits, '_', '.', '-', got {shown(text['name'])}")
    match = ADDRESS_RE.fullmatch(text["address"])
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{where}.address: HOST:PORT of its TLS listener, got {shown(text['address'])}")
    for key in ("tls_ca", "token_file"):
        if not Path(text[key]).is_file():
            raise ConfigError(f"{where}.{key}: {shown(text[key])} is not a readable file")
    token = Path(text["token_file"]).read_text().strip()
    if not TOKEN_RE.fullmatch(token):
        raise ConfigError(f"{where}.token_file: must hold 1-256 printable ASCII characters without spaces")
    if text["server_name"] and not re.fullmatch(r"[A-Za-z0-9_.-]{1,253}", text["server_name"]):
        raise ConfigError(f"{where}.server_name: a host name, got {shown(text['server_name'])}")
    return PeerAddress(text["name"], text["address"], text["tls_ca"], token, text["server_name"])
