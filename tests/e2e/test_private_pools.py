"""A private registered pool (its group registered without ``share_events``) tells which keys it holds to its
registrant only: keys are hashes of prompt prefixes, so whether a tenant's cache holds a guessed prompt is itself
what prefix-cache isolation protects. Before, any client admitted by the daemon could Lookup naming the pool and
learn it ("hits 56, found 149 of 152") while Restore and Delete were refused."""

import secrets

import pytest
import torch

from kvxfer.client import Client, KVSpec, Layout, PoolHandle
from kvxfer.core.errors import InvalidArgument, PermissionDenied
from kvxfer.core.records import Medium, TierKind

pytestmark = pytest.mark.e2e
SPEC = KVSpec(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
KEYS = [b"prompt-%d" % i for i in range(4)]


def _register(client: Client, pool_id: str, path, **kwargs) -> None:
    client.register_pool(pool_id, SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(path)),
                         cache_group=pool_id, **kwargs)
    client.offload(list(zip(range(1, 5), KEYS)), pool_id=pool_id)


def test_a_private_pool_answers_lookups_and_stats_to_its_registrant_only(make_daemon, tmp_path):
    daemon = make_daemon()
    path = tmp_path / "engine"
    path.write_bytes(bytes(SPEC.nbytes))
    with Client(daemon.target, "app") as owner, Client(daemon.target, "app") as other:
        _register(owner, "engine0", path)
        assert owner.lookup(KEYS, pool_ids=["engine0"]).hits == 4
        assert owner.stats("engine0")[0].pool_id == "engine0"
        other.pool_info("engine0")  # (its descriptor is no secret: which keys it holds is)
        with pytest.raises(PermissionDenied, match="registrant"):
            other.lookup(KEYS, pool_ids=["engine0"])
        with pytest.raises(PermissionDenied, match="registrant"):
            other.lookup(KEYS, pool_ids=["rank0", "engine0"])  # nor beside a pool it may ask
        with pytest.raises(PermissionDenied, match="registrant"):
            other.stats("engine0")
        assert "engine0" in [s.pool_id for s in other.stats()]  # every pool's counts, as /metrics shows them
        # A group that shows its keys to routers (share_events) answers anyone's Lookup, as its events do.
        _register(owner, "engine1", path, share_events=True)
        other.pool_info("engine1")
        assert other.lookup(KEYS, pool_ids=["engine1"]).tiers == [TierKind.HOST] * 4


def test_a_chosen_token_lets_the_engines_other_processes_ask(make_daemon, tmp_path):
    """vLLM's scheduler looks up what its workers registered: each rank registers with a token it chose, hands
    it to the scheduler, and registers with it again after the daemon restarts."""
    daemon = make_daemon()
    path = tmp_path / "engine"
    path.write_bytes(bytes(SPEC.nbytes))
    token = secrets.token_bytes(32)
    with Client(daemon.target, "app") as worker, Client(daemon.target, "app") as scheduler:
        _register(worker, "engine0", path, chosen_token=token)
        scheduler.present({"engine0": token})
        assert scheduler.lookup(KEYS, pool_ids=["engine0"]).hits == 4
        scheduler.present({"engine0": secrets.token_bytes(32)})
        with pytest.raises(PermissionDenied):
            scheduler.lookup(KEYS, pool_ids=["engine0"])
        for bad in (b"short", b"x" * 65):
            with pytest.raises(InvalidArgument, match="chosen_token"):
                worker.register_pool("engine2", SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(path)),
                                     chosen_token=bad)
        assert [p.pool_id for p in worker.pools() if p.pool_id == "engine2"] == []  # refused: nothing registered
