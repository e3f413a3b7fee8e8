"""Canonical blocks through a real daemon (issue 34): the ranks of a TP=2 engine, each its own
process with its own registered pool, store blocks that a TP=1 and a TP=4 engine of other layouts
restore head by head; what is refused, and what never matches."""

import json
import subprocess

import grpc
import pytest

from kvxfer import Client
from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.core.records import Medium
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.geometry.sharding import Sharding
from kvxfer.memory import shm
from kvxfer.memory.pool import PoolHandle
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire import messages as wire
from tests.conftest import PYTHON, ROOT, python_env
from tests.e2e.tp_engine import GEOMETRY

KEYS = [f"{i:02x}" * 8 for i in range(1, 6)]


def engine(daemon, tp: int, layout: str, mode: str, blocks: list[int], model: str = "llama", group: str = "llama",
           total: int = 4) -> list[dict]:
    """Every rank of one engine at once, each in its own process; their results in rank order."""
    procs = [subprocess.Popen([PYTHON, "-m", "tests.e2e.tp_engine", json.dumps(dict(
        target=daemon.target, model=model, group=group, rank=rank, tp=tp, total=total, layout=layout, mode=mode,
        blocks=blocks, keys=KEYS, seed=7))], env=python_env(), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for rank in range(tp)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_tp2_engines_blocks_restore_into_tp1_and_tp4_engines_of_other_layouts(make_daemon):
    daemon = make_daemon()
    stored = engine(daemon, 2, "BLHNC", "store", [1, 2, 3, 4, 5])
    assert [r["outcomes"] for r in stored] == [["done"] * 5] * 2
    rank_bytes = GEOMETRY["num_layers"] * 2 * 4 * 2 * 8 * 2  # L x heads x N x KV x D x 2 bytes, 2 of 4 heads
    assert [r["bytes"] for r in stored] == [5 * rank_bytes] * 2
    for tp, layout, blocks in [(1, "LBHNC", [9, 3, 7, 1, 2]), (4, "flash_attn", [2, 4, 6, 8, 10]),
                               (2, "LHBNC", [5, 4, 3, 2, 1])]:
        restored = engine(daemon, tp, layout, "restore", blocks)
        assert all(r["outcomes"] == ["done"] * 5 and r["same"] for r in restored), (tp, layout, restored)
    with Client(daemon.target) as client:  # the ranks have gone; their group keeps one canonical block a key
        assert all(p.cache_group != "llama" for p in client.stats())


def test_half_an_engine_stores_nothing_and_another_model_never_matches(make_daemon):
    daemon = make_daemon({"cache_group_retention_s": 60})
    (only,) = engine(daemon, 1, "BLHNC", "store", [1, 2, 3, 4, 5], model="other", group="other")
    assert only["outcomes"] == ["done"] * 5
    half = subprocess.run([PYTHON, "-m", "tests.e2e.tp_engine", json.dumps(dict(
        target=daemon.target, model="llama", group="llama", rank=1, tp=2, total=4, layout="BLHNC", mode="store",
        blocks=[1, 2], keys=KEYS[:2], seed=7))], env=python_env(), cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert half.returncode == 0, half.stderr
    restored = engine(daemon, 1, "BLHNC", "restore", [1, 2, 3, 4, 5])  # rank 0's heads never came
    assert restored[0]["outcomes"] == ["not_found"] * 5


def _spec(heads: int) -> KVSpec:
    return KVSpec(num_kv_heads=heads, kv_parts=2, **GEOMETRY)


def test_bad_shardings_and_mismatched_manifests_are_refused_and_change_nothing(make_daemon):
    daemon = make_daemon()
    fd = shm.create_sealed("rank", _spec(4).nbytes)
    blhnc = Layout.parse("BLHNC")
    with Client(daemon.target) as client:
        client.register_pool("r0", _spec(2), blhnc, PoolHandle(Medium.SHM), fd=fd, cache_group="g",
                             sharding=Sharding("m", 0, 2, 4))
        refused = [(_spec(2), Sharding("m", 0, 4, 4), "g", InvalidArgument, "holds 1 of the model.s 4 KV heads, but"),
                   (_spec(2), Sharding("m2", 1, 2, 4), "g", FailedPrecondition, "cannot join"),  # another model
                   (_spec(4), None, "g", FailedPrecondition, "cannot join")]  # a plain pool
        for spec, sharding, group, error, match in refused:
            with pytest.raises(error, match=match):
                client.register_pool("r1", spec, blhnc, PoolHandle(Medium.SHM), fd=fd, cache_group=group,
                                     sharding=sharding)
        for bad in [pb.Sharding(model="m", tp_rank=2, tp_size=2, total_kv_heads=4),
                    pb.Sharding(model="", tp_rank=0, tp_size=2, total_kv_heads=4),
                    pb.Sharding(model="m", tp_rank=0, tp_size=3, total_kv_heads=4),
                    pb.Sharding(model="x" * 600, tp_rank=0, tp_size=2, total_kv_heads=4)]:
            request = pb.RegisterPoolRequest(pool_id="bad", spec=wire.spec_to_pb(_spec(2)), layout="BLHNC",
                                             handle=pb.PoolHandle(medium=pb.MEDIUM_SHM), cache_group="g2",
                                             sharding=bad)
            with pytest.raises(grpc.RpcError) as caught:
                stub(client).RegisterPool(request, timeout=10)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert {d.pool_id for d in client.pools()} == {"r0", "rank0"}  # nothing else registered


def stub(client: Client) -> pb_grpc.KVTransferStub:
    return client._stub
