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

from kvxfer.errors import FailedPrecondition, Internal, InvalidArgument
from kvxfer.geometry.layout import PRESETS, KVSpec, Layout, PoolLayout
from kvxfer.geometry.sharding import Manifest, Sharding, head_range, stored_format
from kvxfer.memory.pool import Pool
from kvxfer.records import Outcome
from kvxfer.serving.assembly import Assembly, heads_mask
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.manager import PoolManager
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.base import CompletedHandle, CopyBatch, Direction
from kvxfer.transfer.shard import ShardCopyEngine, blocks_view
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


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "BLNHC"])
@pytest.mark.parametrize("tp, total", [(2, 4), (4, 2), (1, 4)])
def test_the_c_loop_and_torch_move_the_same_bytes(tp, total, layout, monkeypatch):
    from kvxfer.transfer import shard

    monkeypatch.setattr(shard, "NATIVE_PIECE_BYTES", 16)  # this example's pieces are short
    spec = spec_of(total, tp, layers=3, block_size=4, head_size=8, dtype=torch.bfloat16)
    stored, _ = stored_format(PoolLayout(spec, BLHNC), Sharding("m", 0, tp, total))
    rank = Sharding("m", tp - 1, tp, total)
    pool = Pool.create("p", spec, PRESETS[layout], shm_dir=None, sharding=rank)
    pool.storage.copy_(torch.randint(0, 256, (pool.storage.numel(),), dtype=torch.uint8))
    tiers = [HostTier(5, stored.block_bytes), HostTier(5, stored.block_bytes)]
    engines = [ShardCopyEngine(pool.storage, pool.layout, rank.heads, tier, stored, use_native=flag)
               for tier, flag in zip(tiers, (True, False))]
    assert engines[0]._native is not None and engines[1]._native is None
    for engine in engines:
        engine.submit(CopyBatch(Direction.TO_HOST, [5, 1, 3], [4, 0, 2])).wait()
    assert torch.equal(tiers[0].buffer, tiers[1].buffer) and tiers[0].buffer[[0, 2, 4]].any()
    before = blocks_view(pool.storage.clone(), pool.layout)
    for engine in engines:
        pool.storage.zero_()
        engine.submit(CopyBatch(Direction.TO_POOL, [2, 4, 5], [4, 0, 2])).wait()
        assert torch.equal(blocks_view(pool.storage, pool.layout)[[2, 4, 5]], before[[5, 1, 3]])
    pool.close()


def test_fp8_codes_and_their_per_token_head_scales_worked_by_hand():
    """vLLM's fp8_per_token_head cell, by hand: 1 layer, 2 heads, blocks of 2 tokens, head size 2. A
    (head, token) cell is 12 bytes: K's 2 fp8 codes and fp32 scale, then V's. The canonical block is
    2 x 2 x 12 = 48 bytes, cell (h, n) at 24 h + 12 n; rank h of TP=2 holds head h's 24 bytes."""
    import struct

    fmt = "fp8_per_token_head:k2v2:inline_f32"
    spec = KVSpec(1, 4, 2, 1, 12, torch.uint8, kv_parts=1)
    whole_spec = KVSpec(1, 4, 2, 2, 12, torch.uint8, kv_parts=1)
    stored, manifest = stored_format(PoolLayout(spec, BLHNC), Sharding("m", 0, 2, 2, fmt))
    assert stored.block_bytes == 48 and manifest.scale_format == fmt
    group = CacheGroup("g", stored, 4, manifest=manifest)
    ranks = [Pool.create(f"r{r}", spec, BLHNC, shm_dir=None, sharding=Sharding("m", r, 2, 2, fmt)) for r in (0, 1)]
    whole = Pool.create("w", whole_spec, BLHNC, shm_dir=None, sharding=Sharding("m", 0, 1, 2, fmt))
    managers = [PoolManager(p, group) for p in ranks + [whole]]

    def cell(k, v, k_scale, v_scale):  # each half: codes of fp8 e4m3 values, then its scale
        def codes(x):
            return bytes(torch.tensor(x, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).tolist())
        return codes(k) + struct.pack("<f", k_scale) + codes(v) + struct.pack("<f", v_scale)

    cells = {(h, n): cell([1.0 + h, 2.0], [0.5, -1.0 - n], 0.25 * (h + 1), 4.0 + n) for h in (0, 1) for n in (0, 1)}
    for h, pool in enumerate(ranks):  # block 1 of rank h: its head's two token cells, 12 bytes each
        pool.storage[24:48] = torch.frombuffer(bytearray(cells[(h, 0)] + cells[(h, 1)]), dtype=torch.uint8)
    assert [m.offload("ns", [(1, b"k")]).outcomes for m in managers[:2]] == [[Outcome.DONE]] * 2
    assert managers[2].restore("ns", [(b"k", 3)]).outcomes == [Outcome.DONE]
    block = bytes(whole.storage[3 * 48:4 * 48].tolist())
    assert block == b"".join(cells[(h, n)] for h in (0, 1) for n in (0, 1))  # cell (h, n) at 24 h + 12 n
    k_codes, k_scale = torch.frombuffer(bytearray(block[24:26]), dtype=torch.float8_e4m3fn), block[26:30]
    assert (k_codes.float() * struct.unpack("<f", k_scale)[0]).tolist() == [1.0, 1.0]  # head 1: (2, 2) x 0.5
    for m in managers:
        m.close()
    for p in ranks + [whole]:
        p.close()


def test_the_element_format_is_part_of_the_manifest():
    spec = spec_of(4, 2)
    plain = Manifest.of(spec, Sharding("m", 0, 2, 4))
    scaled = Manifest.of(spec, Sharding("m", 0, 2, 4, "fp8:per_tensor"))
    assert plain.scale_format == "none" and plain.digest != scaled.digest
    with pytest.raises(InvalidArgument, match="kv_format"):
        Sharding("m", 0, 2, 4, "x" * 200)


@pytest.mark.parametrize("model, kv_format", [("m2", ""), ("m", "fp8:per_tensor"), ("m", "")])
def test_blocks_of_another_manifest_on_disk_are_never_served(tmp_path, model, kv_format):
    """The manifest is in the fingerprint every stored block carries: a group of the same name and geometry
    but another model (or element format) finds the disk's blocks foreign; the same manifest finds them."""
    from kvxfer.serving.disk_store import DiskSettings

    def group(model, kv_format=""):
        stored, manifest = stored_format(PoolLayout(spec_of(4, 2), BLHNC), Sharding(model, 0, 2, 4, kv_format))
        return CacheGroup("g", stored, 4, disk=DiskSettings(str(tmp_path), 1 << 20), manifest=manifest)

    first = group("m")
    engine = Engine(first, 4, 2)
    engine.offload([(b, bytes([b])) for b in range(1, 5)])
    first.demote_all(10)
    engine.close()
    first.close(5)
    other = group(model, kv_format)
    same = (model, kv_format) == ("m", "")
    assert other.disk.stats().events.get("dropped_at_start_foreign_format", 0) == (0 if same else 4)
    assert other.disk.contains("ns", [b"\x01", b"\x04"]) == [same, same]
    other.close(5)


def test_kvxfer_layout_prints_a_ranks_pieces_of_the_canonical_block_worked_by_hand(capsys):
    """The example at the top: rank 1 of 2, layer l's piece [16 l, 16 l + 16) of its 16-byte block... in
    miniature: 2 layers, 4 heads, 2 tokens, 1 int8 element: its pieces [0,8) and [8,16) go to 8 and 24."""
    import json

    from kvxfer import cli

    argv = ["layout", "--layers", "2", "--heads", "4", "--block-size", "2", "--head-size", "1", "--dtype", "int8",
            "--blocks", "3", "--tp-size", "2", "--tp-rank", "1"]
    assert cli.main(argv + ["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"]["num_kv_heads"] == 2 and info["block_bytes"] == 16
    assert info["canonical"] == {"tp_rank": 1, "tp_size": 2, "heads": [2, 4], "block_bytes": 32,
                                 "pieces": [[0, 8, 8], [8, 24, 8]]}
    assert cli.main(argv) == 0
    assert "[0,8)->8 [8,16)->24" in capsys.readouterr().out
    assert cli.main(argv[:-4] + ["--tp-size", "3"]) != 0


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
