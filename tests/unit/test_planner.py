"""The copy planner: its cost table is the fit of the committed device check, and the engine moves
each batch the way the table says is cheapest (on the CUDA simulator, counting driver calls)."""

import json
from pathlib import Path

import pytest
import torch

from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.memory import cuda_driver
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.tiers.host import HostTier
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.cpu import CpuCopyEngine
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.planner import COSTS, CostTable, Method, Planner, fit

ROOT = Path(__file__).resolve().parents[2]
SPEC = KVSpec(4, 40, 4, 2, 8, torch.float16)  # 1 KiB blocks; LBHNC: 8 runs of 128 B


def table(batched: float | None = 1.0, looped: float | None = 3.0, staged: float | None = None,
          round_us: float = 30.0) -> CostTable:
    per = {m: {"d2h": v, "h2d": v} for m, v in ((Method.BATCHED, batched), (Method.LOOPED, looped),
                                                (Method.STAGED, staged)) if v is not None}
    return CostTable({"d2h": 50.0, "h2d": 50.0}, per, round_us, "test")


def test_the_committed_table_is_the_fit_of_the_device_check_it_names():
    committed = CostTable.load(COSTS)
    run = json.loads((ROOT / committed.source.split(":")[0]).read_text())
    rows = next(s for s in run["stages"] if s["stage"] == "bandwidth")["result"]["rows"]
    fitted = fit(rows, committed.source)
    assert fitted.descriptor_us == committed.descriptor_us and fitted.link_gbps == committed.link_gbps
    assert CostTable.from_dict(committed.to_dict()) == committed


def test_fit_takes_the_time_beyond_the_link_per_descriptor():
    row = {"placement": "scattered", "submission": "batched", "blocks": 100, "span_kib": 1024,
           "descriptors_per_job": 100, "baseline_d2h_gbps": 50.0, "baseline_h2d_gbps": 50.0}
    nbytes = 100 << 20
    # 2 us a descriptor beyond the link's 50 GB/s each way
    gbps = nbytes / (nbytes / 50e9 + 100 * 2e-6) / 1e9
    fitted = fit([{**row, "d2h_gbps": gbps, "h2d_gbps": gbps}, {**row, "placement": "consecutive"}], "x")
    assert fitted.descriptor_us[Method.BATCHED]["d2h"] == pytest.approx(2.0, abs=1e-3)
    with pytest.raises(ValueError):
        fit([{**row, "placement": "consecutive"}], "x")


@pytest.mark.parametrize("name", ["BLHNC", "LBHNC"])
def test_choices_follow_the_estimates(name):
    layout = PoolLayout(SPEC, PRESETS[name])
    staged_rows = 8 if layout.runs_per_block > 1 else 0
    assert Planner(layout, table(), batched=True, staging_rows=staged_rows).choose(Direction.TO_HOST, 64) is (
        Method.STAGED if staged_rows else Method.BATCHED)  # staging not measured: by rule where runs are short
    assert Planner(layout, table(), batched=False).choose(Direction.TO_POOL, 64) is Method.LOOPED
    assert Planner(layout, table(batched=5.0, looped=1.0), batched=True).choose(Direction.TO_HOST, 8) is Method.LOOPED
    assert Planner(layout, table(batched=None, looped=None), batched=True).choose(Direction.TO_HOST, 8) is (
        Method.BATCHED)


def test_staging_pays_for_its_kernel_launch_only_when_a_batch_is_long_enough():
    layout = PoolLayout(SPEC, PRESETS["LBHNC"])  # 8 descriptors a block by DMA, 1 staged
    planner = Planner(layout, table(batched=1.0, staged=1.0, round_us=30.0), batched=True, staging_rows=64)
    assert planner.choose(Direction.TO_HOST, 1) is Method.BATCHED  # 8 us of descriptors < a 30 us launch
    assert planner.choose(Direction.TO_HOST, 64) is Method.STAGED  # 512 us of descriptors > 64 + 30
    estimates = planner.estimates(Direction.TO_POOL, 64)
    assert estimates[Method.STAGED] < estimates[Method.BATCHED] < estimates[Method.LOOPED]


@pytest.mark.parametrize("costs, method", [(table(batched=1.0, looped=3.0), Method.BATCHED),
                                           (table(batched=9.0, looped=3.0), Method.LOOPED)])
def test_the_engine_moves_each_batch_the_way_the_planner_chose(cuda_sim, costs, method):
    spec = KVSpec(3, 24, 4, 2, 8, torch.float16)
    pool = Pool.create("p", spec, PRESETS["LBHNC"], device="cuda:0")
    group = CacheGroup("p", pool.layout, 8, pin_device=0)
    data = torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pool.storage.copy_(data)
    engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, group.host, cuda_driver.driver(0), costs=costs)
    blocks, slots = [1, 5, 9], [0, 3, 6]
    cuda_sim.calls.clear()
    handle = engine.submit(CopyBatch(Direction.TO_HOST, blocks, slots))
    handle.wait()
    descriptors = len(blocks) * pool.layout.runs_per_block  # blocks apart: no run merges with another
    assert handle.method is method and handle.calls == (1 if method is Method.BATCHED else descriptors)
    assert cuda_sim.calls.count("cuMemcpyAsync") == (0 if method is Method.BATCHED else descriptors)
    reference = HostTier(8, pool.layout.block_bytes)
    CpuCopyEngine(data, pool.layout, reference).submit(CopyBatch(Direction.TO_HOST, blocks, slots)).wait()
    assert torch.equal(group.host.buffer[slots], reference.buffer[slots]) and not cuda_sim.violations
    engine.close()
    pool.close()
