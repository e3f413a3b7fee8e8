"""A peer written by hand: this test process with its own NIXL agent and raw KVPeer calls."""

from __future__ import annotations

import os

import grpc
import numpy as np

from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.bench.peering_local import Tls
from kvxfer.peering.settings import DEFAULT_UCX_MODULES
from tests.peering.cluster import TOKEN


class Rogue:
    def __init__(self, name: str, address: str, tls: Tls, token: str = TOKEN, identity: str | None = None,
                 certificate: bool = True) -> None:
        """``identity``: the name its TLS client certificate carries (default: ``name``); ``certificate``: False
        shows none."""
        self.name = name
        cert, key = tls.issue(identity or name) if certificate else (None, None)
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca.read_bytes(),
                                             private_key=key.read_bytes() if key else None,
                                             certificate_chain=cert.read_bytes() if cert else None)
        self.channel = grpc.secure_channel(address, creds)
        self.stub = pb_grpc.KVPeerStub(self.channel)
        self.auth = (("authorization", f"Bearer {token}"),)
        self._agent = None

    def call(self, method: str, **fields):
        """A raw KVPeer call; lookups, leases and reservations name the daemon's own group ("rank0") unless told."""
        if method in ("PeerLookup", "PeerLease", "PeerReserve"):
            fields.setdefault("cache_group", "rank0")
        request = getattr(pb, f"{method}Request")(peer=self.name, **fields)
        return getattr(self.stub, method)(request, timeout=10, metadata=self.auth)

    @property
    def agent(self):
        if self._agent is None:
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            os.environ.setdefault("UCX_MODULES", DEFAULT_UCX_MODULES)  # (as a daemon's agent: see PeeringSettings)
            from nixl_cu13._api import nixl_agent, nixl_agent_config
            self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=True, backends=[]))
            self._agent.create_backend("UCX", {})
        return self._agent

    def connect(self) -> str:
        answer = self.call("PeerConnect", agent_metadata=self.agent.get_agent_metadata())
        got = self.agent.add_remote_agent(answer.agent_metadata)
        return got.decode() if isinstance(got, bytes) else got

    def read(self, peer: str, addresses: list[int], nbytes: int, metadata: bytes) -> tuple[str, np.ndarray]:
        """READ each address's ``nbytes`` with NIXL; ("DONE" | "ERR" | "REFUSED", the bytes)."""
        return self.xfer("READ", peer, addresses, nbytes, metadata, np.zeros(len(addresses) * nbytes, dtype=np.uint8))

    def xfer(self, op: str, peer: str, addresses: list[int], nbytes: int, metadata: bytes,
             out: np.ndarray) -> tuple[str, np.ndarray]:
        """``op`` (READ or WRITE) between ``out`` and each address's ``nbytes`` with NIXL."""
        ag = self.agent
        if metadata:
            ag.add_remote_agent(metadata)
        ag.register_memory([(out.ctypes.data, out.nbytes, 0, "")], "DRAM")
        local = ag.get_xfer_descs([(out.ctypes.data + i * nbytes, nbytes, 0) for i in range(len(addresses))], "DRAM")
        remote = ag.get_xfer_descs([(a, nbytes, 0) for a in addresses], "DRAM")
        try:
            handle = ag.initialize_xfer(op, local, remote, peer)
        except Exception:  # noqa: BLE001 - NIXL refuses descriptors it holds no registration for
            return "REFUSED", out
        state = ag.transfer(handle)
        while state == "PROC":
            state = ag.check_xfer_state(handle)
        ag.release_xfer_handle(handle)
        return state, out

    def close(self) -> None:
        self.channel.close()


def flip_byte(pid: int, address: int) -> None:
    """Flip one byte of another process's memory (the host tier's bytes of a stored block)."""
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(address)
        byte = mem.read(1)
        mem.seek(address)
        mem.write(bytes([byte[0] ^ 0x5A]))
