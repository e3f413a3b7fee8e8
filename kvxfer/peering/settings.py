"""What the ``peering`` config section says: this daemon's name, its peers, UCX and lease bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_UCX_MODULES = "^efa"


@dataclass(frozen=True)
class PeerAddress:
    """One configured peer: how to reach its TCP listener and how to prove who we are to it."""

    name: str  # its peering.name: the NIXL agent name it answers with
    address: str  # HOST:PORT of its TLS listener
    tls_ca: str  # the CA file its certificate is checked against
    token: str = field(repr=False, default="")  # its listener's token (read from token_file)
    server_name: str = ""  # the name its certificate carries, when not the address's host


@dataclass(frozen=True)
class PeeringSettings:
    name: str  # this daemon's name among its peers (its NIXL agent's name)
    peers: tuple[PeerAddress, ...] = ()
    ucx_tls: str = ""  # UCX_TLS ("tcp", "rc,cuda_copy", ...); "" leaves UCX's choice
    ucx_net_devices: str = ""  # UCX_NET_DEVICES ("eth0", "mlx5_0:1", "lo"); "" leaves UCX's choice
    #: UCX_MODULES, the UCX modules loaded ("" all). Not EFA's by default: the wheel's UCX module for it links
    #: the system's libefa, so a node with rdma-core holds two libibverbs and two libnl, whose destructors
    #: crash the process at exit (SIGSEGV in rtnl_tc_unregister). InfiniBand and RoCE use the bundled mlx5.
    ucx_modules: str = DEFAULT_UCX_MODULES
    timeout_ms: int = 2000  # one peer call, and one read, at most this long; then misses
    lease_ms: int = 5000  # the lease this daemon asks its peers for
    max_lease_ms: int = 30_000  # the longest lease this daemon grants
    max_leases: int = 256  # leases this daemon grants at once, over all peers
    max_leased_blocks: int = 65_536  # blocks pinned for peers at once, over all leases
    max_leases_per_peer: int = 32  # leases and reservations one peer holds at once
    max_leased_blocks_per_peer: int = 16_384  # blocks one peer holds leased or reserved at once
    host_share: float = 0.25  # the most of a cache group's host tier peers hold at once (the engine keeps the rest)
    progress_interval_us: int = 200  # how often NIXL's worker is progressed while a lease granted here is open
    tls_client_ca: str = ""  # the CA callers' certificates are checked against (mutual TLS on the listener)
    tls_cert: str = ""  # this daemon's certificate when it calls its peers (its name as CN or DNS name)
    tls_key: str = ""

    def peer(self, name: str) -> PeerAddress | None:
        return next((p for p in self.peers if p.name == name), None)
