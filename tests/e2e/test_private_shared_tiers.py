"""A private cache group's blocks on the tiers other nodes read (a shared filesystem, Redis, a bucket, a Mooncake
Store cluster) are found and read only by a registrant holding the group's chosen token, on any node; a group
registered without one keeps its blocks to its node. Before, a second daemon's new private group of the same name
got Lookup hits and restored the first node's blocks byte-exact, for the values were named by the group's name
alone. Every case runs on real daemons sharing the real medium."""

import importlib.util
import os
import secrets
import shutil

import numpy as np
import pytest
import torch

from kvxfer.bench import launch
from kvxfer.client import Client, KVSpec, Layout, PoolHandle
from kvxfer.core.records import Medium, Outcome, TierKind
from tests.e2e.conftest import SMALL_POOL
from tests.helpers import until

pytestmark = pytest.mark.e2e
SPEC = KVSpec(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
BLOCK = SPEC.nbytes // SPEC.num_blocks  # 16 KiB: a 1 MiB host tier holds 64 of them
KEYS = [b"tenant-prompt-%03d" % i for i in range(96)]  # the first 32 leave the host tier for the shared one
GROUP = "tenantA"
SECRET = "a-shared-tier-secret-of-32-bytes\n"
KIND = {"shared_fs": TierKind.SHARED_FS, "remote": TierKind.REMOTE, "object": TierKind.OBJECT,
        "mooncake": TierKind.MOONCAKE}


@pytest.fixture(params=list(KIND))
def medium(request, tmp_path):
    """(config section name, the section, the daemons' environment) of one shared medium, serving."""
    name = request.param
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    if name == "shared_fs":
        (tmp_path / "share").mkdir()
        yield name, {"path": str(tmp_path / "share"), "secret_file": str(secret)}, {}
    elif name == "remote":
        if shutil.which("redis-server") is None:
            pytest.skip("needs Debian's redis-server (.ci/run installs it)")
        from tests.e2e.redis_server import RedisServer

        server = RedisServer()
        yield name, server.config(timeout_ms=1000, secret_file=str(secret)), {}
        server.close()
    elif name == "object":
        from kvxfer.bench.s3_server import S3Server

        server = S3Server()
        yield name, {"url": f"s3://{server.bucket}/private", "endpoint": server.endpoint, "allow_http": True,
                     "timeout_ms": 2000, "secret_file": str(secret)}, server.env
        server.close()
    else:
        if importlib.util.find_spec("mooncake") is None:
            pytest.skip("kvxfer[mooncake] not installed (make install installs it)")
        from kvxfer.bench.mooncake_master import MooncakeMaster

        master = MooncakeMaster()
        yield name, master.section(timeout_ms=1000, secret_file=str(secret), segment_mib=16), {}
        master.close()


def _daemon(medium) -> launch.DaemonProcess:
    name, section, env = medium
    return launch.spawn({"grace_period_s": 5, "pools": [SMALL_POOL], name: section}, env=env)


class Engine:
    """A registrant: its pool is a file it wrote, registered in ``GROUP`` on one daemon."""

    def __init__(self, daemon, path, token: bytes | None) -> None:
        path.write_bytes(bytes(SPEC.nbytes))
        self.path, self.client = path, Client(daemon.target, "tenant", timeout=20)
        self.pool = f"engine-{path.name}"
        self.client.register_pool(self.pool, SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(path)),
                                  cache_group=GROUP, host_capacity_mib=1, chosen_token=token or b"")

    def write(self, block: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            os.pwrite(f.fileno(), data, block * BLOCK)

    def read(self, block: int) -> bytes:
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), BLOCK, block * BLOCK)

    def offload(self, keys: list[bytes]) -> dict[bytes, bytes]:
        shadow = {}
        for first in range(0, len(keys), 32):
            batch = keys[first:first + 32]
            for j, key in enumerate(batch):
                shadow[key] = np.random.default_rng(abs(hash(key))).integers(0, 256, BLOCK, np.uint8).tobytes()
                self.write(1 + j, shadow[key])
            assert self.client.offload([(1 + j, k) for j, k in enumerate(batch)], pool_id=self.pool).outcomes \
                == [Outcome.DONE] * len(batch)
        return shadow

    def tiers(self, keys: list[bytes]) -> list:
        return self.client.lookup(keys, pool_ids=[self.pool]).tiers

    def restore(self, keys: list[bytes]) -> list[Outcome]:
        return self.client.restore([(k, 1 + j) for j, k in enumerate(keys)], pool_id=self.pool,
                                   partial=True).outcomes

    def close(self) -> None:
        self.client.close()


def test_a_private_groups_blocks_reach_only_the_holders_of_its_token_on_any_node(medium, tmp_path):
    kind = KIND[medium[0]]
    token = secrets.token_bytes(32)
    daemons = [_daemon(medium) for _ in range(4)]  # the writer's node, and three others sharing the medium
    writer_node, right_node, wrong_node, tokenless_node = daemons
    engines: list[Engine] = []
    try:
        writer = Engine(writer_node, tmp_path / "a", token)
        engines.append(writer)
        shadow = writer.offload(KEYS)
        until(lambda: writer.tiers(KEYS[:16]) == [kind] * 16, f"the writer's evictions reached {kind.name}", 90)
        right = Engine(right_node, tmp_path / "b", token)
        wrong = Engine(wrong_node, tmp_path / "c", secrets.token_bytes(32))
        tokenless = Engine(tokenless_node, tmp_path / "d", None)
        engines += [right, wrong, tokenless]
        # Another node's group of the same name finds nothing without the token, and reads nothing.
        for other in (wrong, tokenless):
            assert other.tiers(KEYS[:16]) == [None] * 16
            assert other.restore(KEYS[:8]) == [Outcome.NOT_FOUND] * 8
            assert all(other.read(1 + j) == bytes(BLOCK) for j in range(8))
        # The daemon's own group of that name (shared) asks other names too.
        with Client(wrong_node.target) as plain:
            assert plain.lookup(KEYS[:16], pool_ids=["rank0"]).tiers == [None] * 16
        # The token's holder on another node finds them, and reads them byte-exact.
        assert right.tiers(KEYS[:16]) == [kind] * 16
        assert right.restore(KEYS[:8]) == [Outcome.DONE] * 8
        assert all(right.read(1 + j) == shadow[k] for j, k in enumerate(KEYS[:8]))
        # A group without a chosen token keeps its own blocks to its node: none reach the shared medium.
        kept = tokenless.offload([b"kept-%03d" % i for i in range(96)])
        assert tokenless.tiers(list(kept)[:32]) == [None] * 32  # evicted, and gone: nowhere below
        with Client(tokenless_node.target, "tenant") as c:
            assert kind not in [t.tier for s in c.stats() for t in s.tiers if s.pool_id == tokenless.pool]
    finally:
        for engine in engines:
            engine.close()
        for daemon in daemons:
            daemon.cleanup()
