"""Canonical blocks across tensor-parallel sizes and layouts (issue 34): splits, manifests, assembly.

The example, worked by hand: 2 layers, 4 KV heads, blocks of 2 tokens, K and V of one int8
element. A canonical block is [L, H, N, KV, D] = 2 x 4 x 2 x 2 x 1 = 32 bytes; the byte of
(layer l, head h, token n, part kv) is at 16 l + 4 h + 2 n + kv. Rank 1 of TP=2 holds heads 2
and 3: in its BLHNC pool, a block is 16 bytes and (l, local head j, n, kv) is at 8 l + 4 j + 2 n + kv.
"""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.core.errors import FailedPrecondition, Internal, InvalidArgument
from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import PRESETS, KVSpec, Layout, PoolLayout
from kvxfer.geometry.sharding import Manifest, Sharding, head_range, stored_format
from kvxfer.memory.pool import Pool
from kvxfer.serving.assembly import Assembly, heads_mask
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.transfer.copy_engine import CompletedHandle
from kvxfer.transfer.shard import blocks_view
from tests.strategies import layouts

BLHNC = PRESETS["BLHNC"]


def spec_of(total_heads, tp, layers=2, blocks=6, block_size=2, head_size=1, dtype=torch.int8, parts=2):
    heads = max(1, total_heads // tp)
    return KVSpec(layers, blocks, block_size, heads, head_size, dtype, parts)


class Engine:
    """The rank pools of one tensor-parallel engine, each with its manager, in one cache group."""

    def __init__(self, group, total_heads, tp, layout=BLHNC, model="m", **geometry):
        self.pools, self.managers = [], []
        for rank in range(tp):
            sharding = Sharding(model, rank, tp, total_heads)
            pool = Pool.create(f"e{id(self)}-r{rank}", spec_of(total_heads, tp, **geometry), layout, shm_dir=None,
                               sharding=sharding)
            self.pools.append(pool)
            self.managers.append(PoolManager(pool, group))

    def offload(self, pairs):
        return [m.offload("ns", pairs).outcomes for m in self.managers]

    def restore(self, pairs):
        return [m.restore("ns", pairs).outcomes for m in self.managers]

    def close(self):
        for m, p in zip(self.managers, self.pools):
            m.close()
            p.close()


def group_for(total_heads, tp, capacity=16, model="m", **geometry):
    stored, manifest = stored_format(PoolLayout(spec_of(total_heads, tp, **geometry), BLHNC),
                                     Sharding(model, 0, tp, total_heads))
    return CacheGroup("g", stored, capacity, manifest=manifest)


# -- splits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("total, tp, rank, heads", [
    (8, 2, 1, (4, 8)), (8, 8, 3, (3, 4)), (4, 1, 0, (0, 4)),
    (2, 8, 5, (1, 2)),  # 4 replicas of each head: rank 5 holds head 5 // 4
    (1, 4, 3, (0, 1)),  # an MLA latent: every rank holds it
])
def test_heads_split_as_vllm_splits_them(total, tp, rank, heads):
    assert head_range(total, tp, rank) == heads == Sharding("m", rank, tp, total).heads


@pytest.mark.parametrize("total, tp", [(3, 2), (2, 3), (6, 4)])
def test_uneven_splits_are_refused_with_the_reason(total, tp):
    with pytest.raises(InvalidArgument, match="evenly"):
        Sharding("m", 0, tp, total)


@pytest.mark.parametrize("bad", [dict(model=""), dict(model="a\nb"), dict(tp_rank=2), dict(tp_rank=-1),
                                 dict(tp_size=0), dict(total_kv_heads=0), dict(tp_size=True)])
def test_bad_shardings_are_refused(bad):
    fields = dict(model="m", tp_rank=0, tp_size=2, total_kv_heads=4) | bad
    with pytest.raises(InvalidArgument):
        Sharding(**fields)


def test_a_pool_must_hold_its_ranks_share_of_heads():
    with pytest.raises(InvalidArgument, match="holds 2 of the model's 4"):
        Sharding("m", 0, 2, 4).check(spec_of(4, 1))


# -- the example by hand -----------------------------------------------------------------------
def test_two_ranks_assemble_the_canonical_block_worked_by_hand():
    group = group_for(4, 2)
    engine = Engine(group, 4, 2)
    for rank, pool in enumerate(engine.pools):  # byte (l, j, n, kv) of rank r's block 1: its canonical offset
        raw = pool.storage[16:32]
        for l_, j, n, kv in [(l_, j, n, kv) for l_ in range(2) for j in range(2) for n in range(2) for kv in range(2)]:
            raw[8 * l_ + 4 * j + 2 * n + kv] = 16 * l_ + 4 * (2 * rank + j) + 2 * n + kv
    assert engine.offload([(1, b"k")]) == [[Outcome.DONE], [Outcome.DONE]]
    plan = group.index.prepare_load("ns", [b"k"])
    assert group.host.buffer[plan.slots[0]].tolist() == list(range(32))
    group.index.complete_load(plan.slots)
    assert group.host.slot_bytes == 32 and engine.pools[0].layout.block_bytes == 16
    engine.close()


# -- any TP size and layout to any other ----------------------------------------------------------
def _tp_sizes(total):
    return [t for t in (1, 2, 3, 4, 6, 8) if total % t == 0 or t % total == 0]


@st.composite
def cases(draw):
    total = draw(st.sampled_from([1, 2, 4, 6]))
    parts = 1 if total == 1 and draw(st.booleans()) else 2
    geometry = dict(layers=draw(st.integers(1, 3)), block_size=draw(st.integers(1, 3)),
                    head_size=draw(st.integers(1, 3)), parts=parts,
                    dtype=draw(st.sampled_from([torch.int8, torch.bfloat16, torch.float32, torch.float8_e4m3fn])))
    return total, geometry, draw(st.sampled_from(_tp_sizes(total))), draw(st.sampled_from(_tp_sizes(total))), \
        draw(layouts()), draw(layouts()), draw(st.permutations([1, 2, 3, 4, 5]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_blocks_stored_by_one_split_and_layout_restore_into_any_other_head_by_head(case):
    total, geometry, tp_a, tp_b, layout_a, layout_b, targets = case
    group = group_for(total, tp_a, **geometry)
    a, b = Engine(group, total, tp_a, layout_a, **geometry), Engine(group, total, tp_b, layout_b, **geometry)
    try:
        words = blocks_view(a.pools[0].storage, a.pools[0].layout)
        reference = torch.randint(1, 100, (6, *words.shape[1:2], total, *words.shape[3:]), dtype=words.dtype)
        for pool in a.pools:
            first, end = pool.descriptor.sharding.heads
            blocks_view(pool.storage, pool.layout).copy_(reference[:, :, first:end])
        keys = [bytes([k]) for k in range(1, 6)]
        outcomes = a.offload(list(zip(range(1, 6), keys)))
        assert all(o is Outcome.DONE for o in outcomes[0])
        assert all(o in (Outcome.DONE, Outcome.ALREADY_PRESENT) for rank in outcomes for o in rank)
        assert group.index.stats().ready == 5 and len(group.assembly) == 0
        assert b.restore(list(zip(keys, targets))) == [[Outcome.DONE] * 5] * tp_b
        for pool in b.pools:
            first, end = pool.descriptor.sharding.heads
            got = blocks_view(pool.storage, pool.layout)
            for source, target in zip(range(1, 6), targets):
                assert torch.equal(got[target], reference[source, :, first:end])
    finally:
        a.close()
        b.close()


def test_an_mla_latent_is_stored_once_not_once_a_rank():
    group = group_for(1, 4, parts=1, head_size=4)
    engine = Engine(group, 1, 4, parts=1, head_size=4)
    for pool in engine.pools:
        pool.storage.fill_(7)
    outcomes = engine.offload([(1, b"k"), (2, b"l")])
    assert outcomes[0] == [Outcome.DONE] * 2 and outcomes[1:] == [[Outcome.ALREADY_PRESENT] * 2] * 3
    assert engine.managers[0].stats().offloaded.bytes == 2 * engine.pools[0].layout.block_bytes
    assert sum(m.stats().offloaded.blocks for m in engine.managers) == 2
    engine.close()


# -- what is never visible ---------------------------------------------------------------------------
def test_a_block_is_invisible_until_every_rank_wrote_its_heads():
    group = group_for(4, 2)
    engine = Engine(group, 4, 2)
    assert engine.managers[0].offload("ns", [(1, b"k")]).outcomes == [Outcome.DONE]
    assert engine.managers[0].lookup("ns", [b"k"]).hits == 0
    assert engine.managers[1].restore("ns", [(b"k", 2)]).outcomes == [Outcome.NOT_FOUND]
    assert engine.managers[1].offload("ns", [(1, b"k")]).outcomes == [Outcome.DONE]
    assert engine.managers[0].lookup("ns", [b"k"]).hits == 1
    engine.close()


def test_a_rank_that_never_comes_leaves_nothing_visible_and_frees_the_slot():
    clock = [0.0]
    group = group_for(4, 2, capacity=2)
    group.assembly = Assembly(4, timeout_s=10, clock=lambda: clock[0])
    engine = Engine(group, 4, 2)
    assert engine.managers[0].offload("ns", [(1, b"k"), (2, b"l")]).outcomes == [Outcome.DONE] * 2
    assert engine.managers[0].offload("ns", [(3, b"m")]).outcomes == [Outcome.RESOURCE_EXHAUSTED]
    clock[0] = 11
    engine.managers[0].reap()
    assert group.index.stats().used == 0 and len(group.assembly) == 0
    assert engine.offload([(3, b"m")]) == [[Outcome.DONE]] * 2
    assert engine.managers[0].lookup("ns", [b"k", b"m"]).tiers[1] is not None
    engine.close()


def test_a_failed_slice_drops_the_block_and_no_rank_publishes_it(monkeypatch):
    group = group_for(4, 2)
    engine = Engine(group, 4, 2)
    monkeypatch.setattr(engine.managers[1].engine, "submit", lambda batch: CompletedHandle(Internal("copy failed")))
    assert engine.managers[0].offload("ns", [(1, b"k")]).outcomes == [Outcome.DONE]
    assert engine.managers[1].offload("ns", [(1, b"k")]).outcomes == [Outcome.FAILED]
    assert len(group.assembly) == 0 and group.index.stats().used == 0
    assert engine.managers[0].lookup("ns", [b"k"]).hits == 0
    engine.close()


def test_a_corrupt_canonical_block_is_reported_and_dropped_for_every_rank():
    group = group_for(4, 2)
    engine = Engine(group, 4, 2)
    engine.offload([(1, b"k")])
    plan = group.index.prepare_load("ns", [b"k"])
    group.host.buffer[plan.slots[0], 5] ^= 1
    group.index.complete_load(plan.slots)
    assert engine.managers[1].restore("ns", [(b"k", 2)]).outcomes == [Outcome.DATA_LOSS]
    assert engine.managers[0].restore("ns", [(b"k", 2)]).outcomes == [Outcome.NOT_FOUND]
    engine.close()


def test_ranks_offloading_at_once_publish_every_block_exactly_once():
    group = group_for(8, 8, capacity=64)
    engine = Engine(group, 8, 8)
    pairs = [(b, bytes([b])) for b in range(1, 6)]
    threads = [threading.Thread(target=m.offload, args=("ns", pairs)) for m in engine.managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert group.index.stats().ready == 5 and len(group.assembly) == 0
    engine.close()


# -- manifests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("other", [dict(model="m2"), dict(dtype=torch.bfloat16), dict(block_size=4),
                                   dict(layers=3), dict(head_size=2)])
def test_a_pool_of_another_manifest_cannot_join(other):
    group = group_for(4, 2)
    model = other.pop("model", "m")
    with pytest.raises(FailedPrecondition, match="cannot join"):
        Engine(group, 4, 2, model=model, **other)


def test_manifests_differ_with_everything_a_blocks_bytes_mean():
    base = Manifest.of(spec_of(4, 2), Sharding("m", 0, 2, 4))
    assert base == Manifest.of(spec_of(4, 4), Sharding("m", 3, 4, 4))  # another split: the same blocks
    others = [Manifest.of(spec_of(4, 2), Sharding("m2", 0, 2, 4)),
              Manifest.of(spec_of(8, 4), Sharding("m", 0, 4, 8)),
              Manifest.of(spec_of(4, 2, dtype=torch.uint8), Sharding("m", 0, 2, 4))]
    assert len({base.digest, *(m.digest for m in others)}) == 4


def test_canonical_groups_and_per_rank_groups_never_mix():
    group = group_for(4, 1)
    pool = Pool.create("plain", spec_of(4, 1), BLHNC, shm_dir=None)
    with pytest.raises(FailedPrecondition, match="cannot join"):
        PoolManager(pool, group)
    pool.close()


def test_heads_mask():
    assert heads_mask(2, 4) == 0b1100 and heads_mask(0, 1) == 1
    assert Layout.parse("BLHNC") == BLHNC


def test_ranks_restoring_a_pinned_block_verify_it_once_and_a_new_pin_run_verifies_again(monkeypatch):
    group = group_for(4, 2)
    engine = Engine(group, 4, 2)
    engine.offload([(1, b"k")])
    hashed = []
    for manager in engine.managers:
        original = manager.copier.tier_checksums
        monkeypatch.setattr(manager.copier, "tier_checksums",
                            lambda slots, original=original: hashed.append(list(slots)) or original(slots))
    held = group.index.prepare_load("ns", [b"k"])  # another restore in flight: the block stays pinned
    assert engine.restore([(b"k", 2)]) == [[Outcome.DONE]] * 2
    assert [s for call in hashed for s in call] == held.slots  # verified once for both ranks, in the same run
    group.index.complete_load(held.slots)  # the run ends: nothing pins the block
    group.host.buffer[held.slots[0], 3] ^= 1  # and then a byte flips
    assert engine.managers[1].restore("ns", [(b"k", 3)]).outcomes == [Outcome.DATA_LOSS]  # a new run: checked
    engine.close()


def test_ranks_verifying_the_same_blocks_at_once_hash_each_once_and_agree():
    group = group_for(8, 8, capacity=64, blocks=20)
    engine = Engine(group, 8, 8, blocks=20)
    pairs = [(b, bytes([b])) for b in range(1, 9)]
    engine.offload(pairs)
    held = group.index.prepare_load("ns", [k for _, k in pairs])
    group.host.buffer[held.slots[3], 0] ^= 1  # one block is bad
    results = {}
    threads = [threading.Thread(target=lambda m=m: results.setdefault(m, m.restore("ns", [(k, b + 10) for b, k in
                                                                                          pairs]).outcomes))
               for m in engine.managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for outcomes in results.values():  # (a rank that comes after the bad block was dropped: not found)
        assert outcomes[3] in (Outcome.DATA_LOSS, Outcome.NOT_FOUND) and outcomes.count(Outcome.DONE) == 7
    assert Outcome.DATA_LOSS in [o[3] for o in results.values()]
    group.index.complete_load(held.slots)
    engine.close()


def test_a_failing_reservation_or_checksum_leaves_no_entry_behind(monkeypatch):
    """The index refusing a reservation (a bug) leaves the entries another rank claimed expirable; a
    checksum pass that fails at publication forgets the entries (never visible, slots free)."""
    clock = [0.0]
    group = group_for(4, 2, capacity=4)
    group.assembly = Assembly(4, timeout_s=10, clock=lambda: clock[0])
    engine = Engine(group, 4, 2)
    assert engine.managers[0].offload("ns", [(1, b"k")]).outcomes == [Outcome.DONE]

    def broken(namespace, keys):
        raise Internal("reservation failed")

    monkeypatch.setattr(group, "prepare_store", broken)
    with pytest.raises(Internal):
        engine.managers[1].offload("ns", [(1, b"k"), (2, b"new")])
    monkeypatch.undo()
    clock[0] = 11
    engine.managers[0].reap()
    assert len(group.assembly) == 0 and group.index.stats().used == 0  # the claimed entry expired

    monkeypatch.setattr(engine.managers[1].copier, "tier_checksums", lambda slots: (_ for _ in ()).throw(
        Internal("hash failed")))
    engine.managers[0].offload("ns", [(1, b"k")])
    with pytest.raises(Internal):
        engine.managers[1].offload("ns", [(1, b"k")])
    assert len(group.assembly) == 0 and group.index.stats().used == 0
    engine.close()
