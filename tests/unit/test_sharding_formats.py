"""Canonical blocks (issue 34), their copies, element formats and tools: the C loop against torch, an FP8
cell with per-token-head scales worked by hand, the element format in the manifest (on disk too), and
``kvxfer layout``'s view of a rank's pieces. (The splits and the assembly: test_sharding.py.)"""

import pytest
import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import Outcome, TierKind
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.geometry.sharding import Manifest, Sharding, stored_format
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.tiers.host import HostTier
from kvxfer.tiers.registry import lower_tiers
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.shard import ShardCopyEngine, blocks_view
from tests.unit.test_sharding import BLHNC, Engine, spec_of


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
    from kvxfer.tiers.disk.settings import DiskSettings

    def group(model, kv_format=""):
        stored, manifest = stored_format(PoolLayout(spec_of(4, 2), BLHNC), Sharding(model, 0, 2, 4, kv_format))
        return CacheGroup("g", stored, 4, manifest=manifest,
                          lower=lower_tiers(disk=DiskSettings(str(tmp_path), 1 << 20)))

    first = group("m")
    engine = Engine(first, 4, 2)
    engine.offload([(b, bytes([b])) for b in range(1, 5)])
    first.demote_all(10)
    engine.close()
    first.close(5)
    other = group(model, kv_format)
    same = (model, kv_format) == ("m", "")
    assert other.tier(TierKind.DISK).stats().events.get("dropped_at_start_foreign_format", 0) == (0 if same else 4)
    assert other.tier(TierKind.DISK).contains("ns", [b"\x01", b"\x04"]) == [same, same]
    other.close(5)


def test_kvxfer_layout_prints_a_ranks_pieces_of_the_canonical_block_worked_by_hand(capsys):
    """The example at the top: rank 1 of 2, layer l's piece [16 l, 16 l + 16) of its 16-byte block... in
    miniature: 2 layers, 4 heads, 2 tokens, 1 int8 element: its pieces [0,8) and [8,16) go to 8 and 24."""
    import json

    from kvxfer.cli import commands as cli

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
