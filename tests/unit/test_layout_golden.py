"""The hand-checkable layout example of docs/design.md (layouts), row by row."""

import json

import pytest
import torch

from kvxfer.cli import commands as cli
from kvxfer.core.errors import InvalidArgument
from kvxfer.geometry.layout import PRESETS, Axis, KVSpec, Layout, PoolLayout, Run

GOLDEN = KVSpec(num_layers=4, num_blocks=4, block_size=4, num_kv_heads=2, head_size=2, dtype=torch.bfloat16)
LBHNC = PoolLayout(GOLDEN, PRESETS["LBHNC"])
BLHNC = PoolLayout(GOLDEN, PRESETS["BLHNC"])


def test_sizes():
    assert GOLDEN.element_size == 2
    assert BLHNC.strides[Axis.N] == 8  # one head, one token: K and V, 2 elements each
    assert 2 * 2 * 2 * 2 == BLHNC.strides[Axis.N] * GOLDEN.num_kv_heads  # 16 B per token and layer
    assert LBHNC.run_length == 64  # one layer page
    assert GOLDEN.block_bytes == 256
    assert LBHNC.nbytes == BLHNC.nbytes == 1024


def test_strides():
    assert (LBHNC.strides[Axis.L], LBHNC.strides[Axis.B]) == (256, 64)
    assert (BLHNC.strides[Axis.L], BLHNC.strides[Axis.B]) == (64, 256)


@pytest.mark.parametrize("layer", range(4))
@pytest.mark.parametrize("block", range(4))
def test_offsets(layer, block):
    assert LBHNC.page_offset(layer, block) == 256 * layer + 64 * block
    assert BLHNC.page_offset(layer, block) == 64 * layer + 256 * block


def test_comparison_table():
    # layer 2, block 0 starts at
    assert LBHNC.page_offset(2, 0) == 512
    assert BLHNC.page_offset(2, 0) == 128
    # block 0, all layers
    assert LBHNC.block_runs(0) == [Run(0, 64), Run(256, 64), Run(512, 64), Run(768, 64)]
    assert BLHNC.block_runs(0) == [Run(0, 256)]
    # layer 2, all blocks
    assert [LBHNC.page_offset(2, p) for p in range(4)] == [512, 576, 640, 704]  # contiguous [512, 768)
    assert [BLHNC.page_offset(2, p) for p in range(4)] == [128, 384, 640, 896]
    # total
    assert sum(r.length for p in range(4) for r in LBHNC.block_runs(p)) == 1024
    assert sum(r.length for p in range(4) for r in BLHNC.block_runs(p)) == 1024


def test_runs_coalesce_adjacent_blocks():
    assert BLHNC.runs([2, 1]) == [Run(256, 512)]
    assert BLHNC.runs([1, 3]) == [Run(256, 256), Run(768, 256)]
    # LBHNC: blocks 2 and 3 merge within each layer, and layer l's block 3 touches layer l+1's block 0.
    assert LBHNC.runs([2, 3]) == [Run(128, 128), Run(384, 128), Run(640, 128), Run(896, 128)]
    assert LBHNC.runs([0, 3]) == [Run(0, 64), Run(192, 128), Run(448, 128), Run(704, 128), Run(960, 64)]


def test_runs_per_block_by_layout():
    counts = {name: PoolLayout(GOLDEN, layout).runs_per_block for name, layout in PRESETS.items()}
    assert counts["BLHNC"] == counts["BLNHC"] == counts["BHLNC"] == counts["flash_attn_cross_layer"] == 1
    assert counts["LBHNC"] == counts["LBNHC"] == counts["flashinfer_nhd"] == 4
    assert counts["LHBNC"] == 8  # L x H
    assert counts["flash_attn"] == 8  # L x KV


def test_layout_parse():
    assert Layout.parse("blhnc") is PRESETS["BLHNC"]
    assert Layout.parse("FLASH_ATTN") is PRESETS["flash_attn"]
    assert Layout.parse("B,L,H,N,C") == PRESETS["BLHNC"]
    assert Layout.parse("L,KV,B,N,H,D").name == "flash_attn"
    assert Layout.parse("B,KV,L,N,H,D").name == "B,KV,L,N,H,D"
    for bad in ("XYZ", "L,B,H,N,D,KV", "L,B,H,N,KV", "L,L,B,H,N,KV,D"):
        with pytest.raises(InvalidArgument):
            Layout.parse(bad)


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_spec_rejects_bad_dimensions(field, value):
    args = GOLDEN.to_dict() | {field: value, "dtype": torch.bfloat16}
    with pytest.raises(InvalidArgument):
        KVSpec(**args)


def test_bad_block_and_layer():
    for call in (lambda: BLHNC.page_offset(0, 4), lambda: BLHNC.page_offset(4, 0), lambda: BLHNC.runs([1, 1]),
                 lambda: BLHNC.block_runs(-1)):
        with pytest.raises(InvalidArgument):
            call()


def test_cli_json(capsys):
    assert cli.main(["layout", "--layout", "LBHNC", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["strides"]["L"] == 256 and info["strides"]["B"] == 64
    assert info["page_offsets"][2] == [512, 576, 640, 704]
    assert info["block_runs"][0] == [[0, 64], [256, 64], [512, 64], [768, 64]]


def test_cli_table(capsys):
    assert cli.main(["layout", "--layout", "BLHNC"]) == 0
    out = capsys.readouterr().out
    assert "s_B=256, s_L=64" in out
    assert "P0: [0,256)" in out


def test_cli_bad_input(capsys):
    assert cli.main(["layout", "--layout", "nope"]) == 2
    assert "unknown layout" in capsys.readouterr().err
    assert cli.main(["layout", "--blocks", "1"]) == 2


def test_the_layout_table_of_a_large_pool_is_capped_unless_all_is_asked(capsys):
    """Issue 50: ``kvxfer layout --blocks 4096`` printed 7.4 MB."""
    assert cli.main(["layout", "--blocks", "4096", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 4096 and "the first 16 of 4096 blocks" in out and "P16:" not in out
    assert cli.main(["layout", "--blocks", "20", "--all"]) == 0
    out = capsys.readouterr().out
    assert "P19:" in out and "the first" not in out
