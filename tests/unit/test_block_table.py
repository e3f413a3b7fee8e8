"""Block-table rules (vLLM's BlockTable), batch metadata, and kernel argument checks."""

import pytest
import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.engine.block_table import BlockTable, batch_metadata, gather_kv
from kvxfer.engine.kernels import Kernel, compute_slot_mapping, default_kernel, write_kv
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout


def test_rows_grow_by_append_and_moves_clear_the_source():
    t = BlockTable(4, 6)
    t.append_row(0, [5, 9])
    t.append_row(0, [2])
    t.append_row(1, [7])
    assert t.row(0) == [5, 9, 2] and t.row(1) == [7]
    t.move_row(0, 2)
    assert t.row(2) == [5, 9, 2] and t.row(0) == []
    assert t.host[0].tolist() == [0] * 6  # the vacated row holds only the null block
    t.set_blocks(2, 1, [11])  # a restored block landed in slot 11
    assert t.row(2) == [5, 11, 2]
    t.clear_row(2)
    assert t.row(2) == [] and t.host[2].tolist() == [0] * 6


def test_commit_mirrors_rows_and_pads_with_the_null_block():
    t = BlockTable(4, 3)
    t.append_row(0, [4])
    t.append_row(1, [6, 8])
    t.device_table.fill_(99)  # stale device contents
    committed = t.commit(2, 4)
    assert committed.tolist() == [[4, 0, 0], [6, 8, 0], [0, 0, 0], [0, 0, 0]]


def test_bad_block_table_use():
    t = BlockTable(2, 2)
    with pytest.raises(InvalidArgument):
        t.append_row(0, [1, 2, 3])  # wider than the table
    with pytest.raises(InvalidArgument):
        t.append_row(0, [0])  # the null block is never allocated
    with pytest.raises(InvalidArgument):
        t.set_blocks(0, 0, [3])  # nothing to rewrite yet
    with pytest.raises(InvalidArgument):
        t.commit(3)


def test_batch_metadata_mixes_prefills_and_decodes():
    qsl, positions, n = batch_metadata([(0, 3), (17, 1), (5, 0), (6, 4)])
    assert qsl.tolist() == [0, 3, 4, 4, 8] and qsl.dtype == torch.int32
    assert positions.tolist() == [0, 1, 2, 17, 6, 7, 8, 9] and n == 8
    assert batch_metadata([])[2] == 0


def test_chosen_path_and_argument_checks():
    assert default_kernel(torch.zeros(1)) is Kernel.TORCH  # chosen by where the data is, per call
    pl = PoolLayout(KVSpec(1, 8, 4, 2, 8, torch.float16), PRESETS["BLHNC"])
    k_cache, v_cache = pl.views(torch.zeros(pl.nbytes, dtype=torch.uint8))[0]
    t = BlockTable(2, 4)
    t.append_row(0, [3, 5])
    qsl, pos, n = batch_metadata([(0, 6)])
    slots = compute_slot_mapping(qsl, pos, t.commit(1), 4, n, max_num_tokens=8)
    assert slots.tolist() == [12, 13, 14, 15, 20, 21, -1, -1]
    key = torch.randn(6, 2, 8).half()
    write_kv(key, key + 1, k_cache, v_cache, slots)
    k, v = gather_kv(k_cache, v_cache, t.row(0), 6)
    assert torch.equal(k, key) and torch.equal(v, key + 1)
    for bad in (key.float(), key[:, :1], key.transpose(1, 2)):
        with pytest.raises(InvalidArgument):
            write_kv(bad, bad, k_cache, v_cache, slots)
    with pytest.raises(InvalidArgument):
        compute_slot_mapping(qsl, pos, t.commit(1), 4, n, max_num_tokens=3)
    with pytest.raises(InvalidArgument):  # a request without a block-table row
        compute_slot_mapping(torch.tensor([0, 3, 6], dtype=torch.int32), pos, t.commit(1), 4, n)
    for short in (slots[:5], slots.int()):  # too few slots for the tokens, or not int64
        with pytest.raises(InvalidArgument):
            write_kv(key, key, k_cache, v_cache, short)
    with pytest.raises(InvalidArgument):
        gather_kv(k_cache, v_cache, [3], 6)
