"""The Mooncake Store tier's settings and its config section (``mooncake``).

The MAC secret comes from a file named in the section, never from the config itself, and never
appears in a repr.
"""

from __future__ import annotations

import importlib.util
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.record import Seal
from kvxfer.tiers.sections import bounded, mapping, mib, seal, secret

KEYS = frozenset({"master", "metadata", "protocol", "device", "local_hostname", "segment_mib", "buffer_mib",
                  "key_prefix", "timeout_ms", "max_inflight", "write_through", "secret_file", "workers", "audit_s",
                  "mac"})
PROTOCOLS = ("tcp", "rdma")
RDMA_DEVICES = Path("/sys/class/infiniband")  # where the kernel lists this node's RDMA devices
HOST_PORT = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,253}:[0-9]{1,5}")
METADATA = re.compile(r"(https?://[A-Za-z0-9_.:\[\]-]{1,253}(/[A-Za-z0-9_./-]{0,200})?|P2PHANDSHAKE)")
PREFIX = re.compile(r"[A-Za-z0-9_.:/-]{0,64}")
DEVICES = re.compile(r"[A-Za-z0-9_.:,-]{0,256}")


@dataclass(frozen=True)
class MooncakeSettings:
    """The Mooncake Store cluster this daemon joins: its master, metadata server and transport."""

    master: str  # HOST:PORT of mooncake_master's RPC
    metadata: str  # its metadata server: http://HOST:PORT/metadata, or P2PHANDSHAKE
    protocol: str = "tcp"  # "tcp" or "rdma"
    device: str = ""  # RDMA devices ("mlx5_0,mlx5_1"); "" for TCP or all
    local_hostname: str = ""  # this daemon's address as other clients reach its segment ("": its host's address)
    segment_bytes: int = 0  # memory this daemon lends the cluster's pool (0: a client that lends none)
    buffer_bytes: int = 64 << 20  # the client's own transfer buffer
    key_prefix: str = "kvxfer:"  # every name this tier writes starts with it (and its MAC covers it)
    timeout_s: float = 2.0  # one call into the store, at most; past it a miss or a dropped store
    max_inflight: int = 256  # demotions staged in memory
    write_through: bool = False  # every stored block goes down too, not only those the host tier evicts
    workers: int = 4  # threads calling into the store (stuck ones included)
    audit_s: int = 30  # how often the blocks this daemon put are asked after (Mooncake's evictions, announced)
    secret: bytes = field(default=b"", repr=False)  # shared by the daemons of a cluster: values carry a MAC
    seal: Seal = Seal.BLAKE3  # the MAC values are written with (``mac``; both are read)

    @property
    def staged_blocks(self) -> int:
        """Blocks of each cache group's that its write queue may hold in memory."""
        return self.max_inflight

    @property
    def client_bytes(self) -> int:
        """Host memory each cache group's client takes at its join: the segment it lends and its transfer buffer."""
        return self.segment_bytes + self.buffer_bytes

    @property
    def hostname(self) -> str:
        """Where other clients reach this one's segment: ``local_hostname``, else this host's name resolved (in
        Kubernetes, the pod's IP: the kubelet's /etc/hosts maps its name to it). Asked on a store thread."""
        if self.local_hostname:
            return self.local_hostname
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()


def _text(raw: dict, key: str, pattern: re.Pattern, default: str, what: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ConfigError(f"mooncake.{key}: {what}, got {shown(value)}")
    return value


def parse(raw) -> MooncakeSettings | None:
    """The ``mooncake`` section: a Mooncake Store cluster (its master and metadata server), checked whole."""
    raw = mapping("mooncake", raw, KEYS, "with a master and a metadata server")
    if raw is None:
        return None
    if importlib.util.find_spec("mooncake") is None:
        raise ConfigError("mooncake: the Mooncake Store client is not installed: pip install 'kvxfer[mooncake]' "
                          "(its wheel needs Debian's libibverbs1, even over TCP)")
    master = _text(raw, "master", HOST_PORT, "", "HOST:PORT of mooncake_master's RPC (rpc_port)")
    metadata = _text(raw, "metadata", METADATA, "", "http://HOST:PORT/metadata (the master's HTTP metadata server) "
                     "or P2PHANDSHAKE")
    protocol = raw.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"mooncake.protocol: one of {', '.join(PROTOCOLS)}, got {shown(protocol)}")
    device = _text(raw, "device", DEVICES, "", "RDMA device names, comma-separated")
    hostname = _text(raw, "local_hostname", re.compile(r"[A-Za-z0-9_.:-]{0,253}"), "", "this node's address")
    prefix = _text(raw, "key_prefix", PREFIX, "kvxfer:", "at most 64 of letters, digits and _.:/-")
    write_through = raw.get("write_through", False)
    if not isinstance(write_through, bool):
        raise ConfigError(f"mooncake.write_through: true or false, got {shown(write_through)}")
    given = raw.get("segment_mib", 0)
    segment = 0 if given == 0 and not isinstance(given, bool) else mib("mooncake", raw, "segment_mib", 0, 1 << 20)
    buffer = mib("mooncake", raw, "buffer_mib", 64, 1 << 16)
    for key, nbytes in (("segment_mib", segment), ("buffer_mib", buffer)):
        if nbytes and nbytes < 16 << 20:  # (Mooncake refuses less at setup)
            raise ConfigError(f"mooncake.{key}: at least 16 MiB (Mooncake's least){' or 0' * (key == 'segment_mib')}, "
                              f"got {shown(raw[key])}")
    settings = MooncakeSettings(master, metadata, protocol, device, hostname, segment, buffer, prefix,
                                bounded("mooncake", raw, "timeout_ms", 2000, 60_000) / 1000,
                                bounded("mooncake", raw, "max_inflight", 256, 65536), write_through,
                                bounded("mooncake", raw, "workers", 4, 64),
                                bounded("mooncake", raw, "audit_s", 30, 3600), secret("mooncake", raw),
                                seal("mooncake", raw))
    why = missing_devices(settings)
    if why is not None:  # (a transport that cannot work on this node: the tier would never join)
        raise ConfigError(why)
    return settings


def missing_devices(settings: MooncakeSettings, root: Path = RDMA_DEVICES) -> str | None:
    """Why ``protocol: rdma`` cannot work on this node (no RDMA device, or a named one absent), or None."""
    if settings.protocol != "rdma":
        return None
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not present:
        return f"mooncake.protocol: rdma, but this node has no RDMA device ({root} is empty or absent); use tcp"
    named = [d for d in settings.device.split(",") if d]
    absent = [d for d in named if d not in present]
    if absent:
        return f"mooncake.device: {', '.join(absent)} not on this node (it has {', '.join(present)})"
    return None

