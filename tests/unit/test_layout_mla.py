"""Multi-head latent attention (issue 34): one latent vector a token and layer, no separate V.

The example, worked by hand: 3 layers, 4 blocks of 2 tokens, one latent "head" of 6 bf16
elements (DeepSeek's 512 + 64 in miniature). A token's latent in one layer is 6 x 2 = 12
bytes; a layer's page (2 tokens) 24 bytes; a block over all layers 72 bytes.

    BLHNC (cross-layer, the block one span):  offset = 72 * block + 24 * layer + 12 * token
    LBHNC (vLLM's per-layer cache):           offset = 96 * layer + 24 * block + 12 * token
"""

import hashlib
import json

import numpy as np
import pytest
import torch

from kvxfer.cli import commands as cli
from kvxfer.core.errors import InvalidArgument
from kvxfer.geometry.block_checksum import FORMAT
from kvxfer.geometry.layout import PRESETS, Axis, KVSpec, PoolLayout, Run
from kvxfer.serving.group import BlockFormat
from kvxfer.wire.messages import spec_from_pb, spec_to_pb

MLA = KVSpec(num_layers=3, num_blocks=4, block_size=2, num_kv_heads=1, head_size=6, dtype=torch.bfloat16,
             kv_parts=1)
BLHNC = PoolLayout(MLA, PRESETS["BLHNC"])
LBHNC = PoolLayout(MLA, PRESETS["LBHNC"])


def test_sizes_and_strides_by_hand():
    assert MLA.block_bytes == 72 and BLHNC.nbytes == LBHNC.nbytes == 288
    assert (BLHNC.strides[Axis.B], BLHNC.strides[Axis.L], BLHNC.strides[Axis.N]) == (72, 24, 12)
    assert (LBHNC.strides[Axis.L], LBHNC.strides[Axis.B], LBHNC.strides[Axis.N]) == (96, 24, 12)
    assert BLHNC.strides[Axis.KV] == 12  # one part: its stride is never used to reach a second one


@pytest.mark.parametrize("layer", range(3))
@pytest.mark.parametrize("block", range(4))
def test_page_offsets_by_hand(layer, block):
    assert BLHNC.page_offset(layer, block) == 72 * block + 24 * layer
    assert LBHNC.page_offset(layer, block) == 96 * layer + 24 * block


def test_a_latent_block_is_one_span_in_blhnc_and_one_run_a_layer_in_lbhnc():
    assert BLHNC.block_runs(2) == [Run(144, 72)] and BLHNC.runs_per_block == 1
    assert LBHNC.block_runs(2) == [Run(48, 24), Run(144, 24), Run(240, 24)]


def test_views_are_one_latent_per_layer_on_the_bytes_computed_by_hand():
    storage = torch.zeros(BLHNC.nbytes, dtype=torch.uint8)
    views = BLHNC.views(storage)
    assert len(views) == 3 and all(len(v) == 1 for v in views)
    (latent,) = views[1]
    assert latent.shape == (4, 2, 1, 6)
    latent[3, 1, 0] = torch.arange(1, 7, dtype=torch.bfloat16)
    start = 72 * 3 + 24 * 1 + 12 * 1  # block 3, layer 1, token 1
    raw = storage[start:start + 12].view(torch.bfloat16)
    assert raw.tolist() == [1, 2, 3, 4, 5, 6]
    assert not storage[:start].any() and not storage[start + 12:].any()  # nothing else written


def test_kv_parts_travel_the_wire_and_separate_block_formats():
    assert spec_from_pb(spec_to_pb(MLA)) == MLA
    two = KVSpec(3, 4, 2, 1, 6, torch.bfloat16)
    assert spec_from_pb(spec_to_pb(two)).kv_parts == 2
    latent, pair = BlockFormat.of(BLHNC), BlockFormat.of(PoolLayout(two, PRESETS["BLHNC"]))
    assert latent.fingerprint != pair.fingerprint
    # A K/V pool's fingerprint text is what it was before kv_parts (with the checksum's format since issue 47).
    old = ("BlockFormat(num_layers=3, block_size=2, num_kv_heads=1, head_size=6, dtype='bfloat16', "
           "layout='B,L,H,N,KV,D')")
    assert pair.fingerprint == hashlib.sha256(f"{old}\0{FORMAT}".encode()).digest()


@pytest.mark.parametrize("parts", [0, 3, True, 1.0])
def test_kv_parts_other_than_one_or_two_are_refused(parts):
    with pytest.raises(InvalidArgument, match="kv_parts"):
        KVSpec(3, 4, 2, 1, 6, torch.bfloat16, kv_parts=parts)


def test_the_layout_command_prints_an_mla_geometry(capsys):
    assert cli.main(["layout", "--layers", "3", "--blocks", "4", "--block-size", "2", "--heads", "1",
                     "--head-size", "6", "--kv-parts", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"]["kv_parts"] == 1 and info["block_bytes"] == 72 and info["block_runs"][1] == [[72, 72]]


def test_every_byte_of_an_mla_pool_is_addressed_once_in_every_preset():
    for name, layout in PRESETS.items():
        pool = PoolLayout(MLA, layout)
        covered = np.zeros(pool.nbytes, dtype=np.int64)
        for block in range(MLA.num_blocks):
            for run in pool.block_runs(block):
                covered[run.offset:run.offset + run.length] += 1
        assert (covered == 1).all(), name
