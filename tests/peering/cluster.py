"""Real daemons that are each other's peers on loopback: TLS, a token, NIXL over UCX."""

from __future__ import annotations

from pathlib import Path

import torch

from kvxfer.client import Client
from kvxfer.bench.launch import DaemonProcess
from kvxfer.bench.peering_local import Tls, peering_configs, self_signed
from tests.e2e.conftest import SMALL_POOL, start_daemon
from tests.helpers import read_block, write_block

TOKEN = "peer-s3cret-token"


def make_tls(where: Path) -> Tls:
    return self_signed(where, TOKEN)


def start_cluster(names: list[str], tls: Tls, transport: str = "shm", **kwargs) -> dict[str, DaemonProcess]:
    """The daemons, each told the others' addresses before any starts: their ports are picked free, and one
    taken meanwhile by another process of a busy machine ("Address already in use") means new ports, again."""
    pools = {name: SMALL_POOL for name in names} | kwargs.pop("pools", {})
    for attempt in range(3):
        configs = peering_configs(names, tls, transport, pools, **kwargs)
        started: dict[str, DaemonProcess] = {}
        try:
            for name in names:
                started[name] = start_daemon(configs[name])
            return started
        except BaseException as exc:
            for d in started.values():
                d.cleanup()
            if attempt == 2 or not (isinstance(exc, RuntimeError) and "Address already in use" in str(exc)):
                raise
    raise AssertionError("unreachable")


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
