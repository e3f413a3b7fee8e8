"""Unit checks of the hardening pieces: names, hand-offs, group admission and release,
job bounds per client, the wire-level field counter, and the stale-file sweep."""

import os
import time

import pytest
import torch

from kvxfer.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvxfer.core.records import Medium, PoolRef
from kvxfer.core.validate import check_namespace, check_pool_id, shown
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool, PoolHandle
from kvxfer.memory.shm import FILE_PREFIX, create_sealed, sweep_stale
from kvxfer.serving.handoff import HandOffs
from kvxfer.serving.pool_registry import Limits, PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb
from service.grpc_errors import Malformed, parser

SPEC = KVSpec(2, 8, 4, 2, 8, torch.float16)


def test_names_match_whole_and_are_echoed_short():
    for bad in ("adv\n", "a" * 129, "", "-x", "a b"):
        with pytest.raises(InvalidArgument):
            check_namespace(bad)
    with pytest.raises(InvalidArgument) as err:
        check_pool_id("p" * 1_000_000)
    assert len(str(err.value)) < 200
    check_namespace("qwen2.5-0.5b/BLHNC@16:tenant+1")
    assert len(shown("x" * 10_000)) < 80 and shown("ok") == "'ok'"


def test_handoffs_check_the_descriptor_and_are_bounded(tmp_path):
    offs = HandOffs(max_pending=3, expiry_s=0.2, max_per_uid=2)
    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    with pytest.raises(PermissionDenied, match="reading and writing"):
        offs.accept(os.open(path, os.O_RDONLY), 1, 1, set())
    with pytest.raises(InvalidArgument, match="regular file"):
        offs.accept(os.open(tmp_path, os.O_RDONLY), 1, 1, set())
    st = os.stat(path)
    with pytest.raises(PermissionDenied, match="already serves"):
        offs.accept(os.open(path, os.O_RDWR), 1, 1, {(st.st_dev, st.st_ino)})
    tokens = [offs.accept(os.open(path, os.O_RDWR), 1, 1, set()) for _ in range(2)]
    with pytest.raises(ResourceExhausted, match="uid 1"):
        offs.accept(os.open(path, os.O_RDWR), 1, 1, set())
    offs.accept(os.open(path, os.O_RDWR), 2, 1, set())
    with pytest.raises(ResourceExhausted, match="hand-offs are pending"):
        offs.accept(os.open(path, os.O_RDWR), 3, 1, set())
    handoff = offs.take(tokens[0])
    os.close(handoff.fd)
    with pytest.raises(PermissionDenied):
        offs.take(tokens[0])  # single use
    time.sleep(0.3)
    with pytest.raises(PermissionDenied):
        offs.take(tokens[1])  # expired (and its descriptor closed)
    offs.close()


def _register(registry: PoolRegistry, pool_id: str, uid: int, group: str = ""):
    fd = create_sealed(pool_id, SPEC.nbytes)
    token = registry.accept_handoff(fd, uid, 1)
    return registry.register(pool_id, SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM), token, 1, group)


def test_groups_admit_only_their_creator_and_are_released_after_retention():
    registry = PoolRegistry(Limits(max_pools=8, max_cache_groups=2, cache_group_retention_s=0.2))
    try:
        registry.add(Pool.create("own", SPEC, Layout.parse("BLHNC"), shm_dir=None), 4)
        served, token = _register(registry, "a", uid=1000, group="g")
        with pytest.raises(PermissionDenied, match="another party"):
            _register(registry, "b", uid=1001, group="g")
        with pytest.raises(PermissionDenied, match="another party"):
            _register(registry, "c", uid=1000, group="own")  # the daemon's own group
        ref = PoolRef("a", served.descriptor.epoch)
        with pytest.raises(PermissionDenied, match="registration token"):
            registry.unregister(ref, b"wrong")
        assert registry.unregister(ref, token) == 0
        assert sorted(g.name for g in registry.groups()) == ["g", "own"]  # retained for a restart ...
        served, token = _register(registry, "a2", uid=1000, group="g")  # ... which finds it
        registry.unregister(PoolRef("a2", served.descriptor.epoch), token)
        time.sleep(0.3)
        assert registry.sweep() == ["g"] and [g.name for g in registry.groups()] == ["own"]
        _register(registry, "d", uid=1001, group="g")  # a released name is free again
    finally:
        registry.close()


def test_wire_counter_refuses_long_repeated_fields_before_parsing():
    parse = parser(pb.LookupRequest, {"pools": 8, "keys": 100})
    many_refs = pb.LookupRequest(pools=[pb.PoolRef(pool_id="x", epoch=1)] * 20_000, namespace="n")
    assert isinstance(parse(many_refs.SerializeToString()), Malformed)
    many_keys = pb.LookupRequest(pools=[pb.PoolRef(pool_id="x")], keys=[b"k" * 200] * 400)
    assert "keys" in parse(many_keys.SerializeToString()).reason
    fine = pb.LookupRequest(pools=[pb.PoolRef(pool_id="x")] * 8, keys=[b"k" * 1000] * 90)
    assert parse(fine.SerializeToString()) == fine
    ids = parser(pb.WaitJobsRequest, {"job_ids": 256})
    assert isinstance(ids(pb.WaitJobsRequest(job_ids=range(1, 100_000)).SerializeToString()), Malformed)
    assert ids(pb.WaitJobsRequest(job_ids=range(1, 257)).SerializeToString()).job_ids[-1] == 256
    assert "UTF-8" in parser(pb.StatsRequest)(b"\x0a\x02\xff\xfe").reason


def test_sweep_removes_only_this_users_abandoned_regular_files(shm_dir):
    if os.geteuid() != 0:
        pytest.skip("planting another user's file needs root (CI runs as root)")
    mine = shm_dir / f"{FILE_PREFIX}mine"
    mine.write_bytes(b"x")
    planted = shm_dir / f"{FILE_PREFIX}planted"
    planted.write_bytes(b"x")
    os.chown(planted, 12345, 12345)
    link = shm_dir / f"{FILE_PREFIX}link"
    link.symlink_to(mine)
    removed = sweep_stale(shm_dir)
    assert removed == [mine]
    assert link.is_symlink() and planted.exists()


def test_the_default_limits_leave_most_job_places_to_other_clients():
    from service.config import Config, validate

    config = validate(Config())
    assert config.max_jobs_per_client * 2 <= config.max_queued_jobs


def test_setting_the_queue_bound_alone_derives_the_per_client_bound():
    """max_queued_jobs: 64 alone stopped the daemon (the per-client default, 64, exceeded half of it)."""
    from service.config import Config, ConfigError, validate

    for queued, per_client in ((64, 16), (1, 1), (3, 1), (1000, 250)):
        config = validate(Config(max_queued_jobs=queued))
        assert config.max_jobs_per_client == per_client and config.limits.max_jobs_per_client == per_client
    assert validate(Config(max_queued_jobs=64, max_jobs_per_client=32)).max_jobs_per_client == 32
    with pytest.raises(ConfigError, match="at most half"):
        validate(Config(max_queued_jobs=64, max_jobs_per_client=33))


def test_a_token_must_be_one_printable_word(tmp_path):
    from service.config import Config, ConfigError, validate

    token = tmp_path / "token"
    for bad in ("two words", "x" * 257, "caf\u00e9"):
        token.write_text(bad)
        with pytest.raises(ConfigError, match="printable ASCII"):
            validate(Config(token_file=str(token)))
    token.write_text("ok-token_1\n")
    validate(Config(token_file=str(token)))
