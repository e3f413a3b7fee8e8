"""The device check's bandwidth stage: the CUDA engine beside one contiguous pinned copy.

For BLHNC and LBHNC (32 layers) at 64 KiB, 512 KiB (16 KiB pages) and 1 MiB spans,
consecutive and scattered blocks, batched (cuMemcpyBatchAsync) and looped
(cudaMemcpyAsync per descriptor) submission, and for LBHNC staged (a kernel gathers
each block's runs into device memory, then one descriptor a block): GB/s each way, descriptors per job and
submit time per descriptor; then, for scattered batched jobs, the same through the
checked pipeline (checksums on: the device XXH3, host hashing on several threads,
several chunk sizes). The baseline is one contiguous copy of the same bytes between
the same device memory and the same pinned buffer, in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.memory import cuda_driver
from kvxfer.memory.pool import Pool
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.pool_manager import PoolManager
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.pipeline import CheckedCopier
from kvxfer.transfer.plan import plan_copies
from kvxfer.transfer.planner import CostTable, Method, fit
from kvxfer.transfer.staging import wants_staging

KIB, MIB = 1 << 10, 1 << 20
LAYERS, HEAD = 32, 128
#: span -> (block_size, kv heads): span = 32 layers x 2 x N x H x 128 x 2 bytes
GEOMETRY = {64 * KIB: (4, 1), 512 * KIB: (16, 2), 1024 * KIB: (16, 4)}
REPS = 3


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def timed(fn, reps: int = REPS) -> float:
    """The median seconds of ``reps`` runs of ``fn``, the device idle before and after each."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(pl: PoolLayout, pool: torch.Tensor, host, n: int, scattered: bool, driver, label: str) -> dict:
    """One submission method (``label``: a planner Method's value; staged: runs gathered into
    staging by a kernel, one descriptor a block)."""
    staged = label == Method.STAGED.value
    engine = CudaCopyEngine(pool.data_ptr(), pl, host, driver, pool=pool if staged else None, device_checksums=False,
                            costs=CostTable.only(Method(label)))
    if scattered:
        g = torch.Generator().manual_seed(n)
        blocks = (torch.randperm(pl.spec.num_blocks // 2 - 1, generator=g)[:n] * 2 + 1).tolist()
        slots = torch.randperm(n, generator=g).tolist()
    else:
        blocks, slots = list(range(1, n + 1)), list(range(n))
    out = {"descriptors_per_job": n if staged else len(plan_copies(pl, blocks, slots))}
    for direction in (Direction.TO_HOST, Direction.TO_POOL):
        submits = []

        def move() -> None:
            start = time.perf_counter()
            handle = engine.submit(CopyBatch(direction, blocks, slots))
            submits.append(time.perf_counter() - start)
            handle.wait()

        seconds = timed(move)
        key = "d2h" if direction is Direction.TO_HOST else "h2d"
        out[f"{key}_gbps"] = _gbps(n * pl.block_bytes, seconds)
        out[f"{key}_submit_us_per_descriptor"] = round(statistics.median(submits) / out["descriptors_per_job"] * 1e6,
                                                       3)
    return out


def bandwidth(ctx: dict) -> dict:
    measure = (128 if ctx.get("quick") else 512) * MIB
    batched, looped = cuda_driver.driver(0), cuda_driver.Driver(cuda_driver.load_library(), 0, use_batch=False)
    rows = []
    for span, (block_size, heads) in GEOMETRY.items():
        n = measure // span
        for name in ("BLHNC", "LBHNC"):
            spec = KVSpec(LAYERS, 2 * n + 2, block_size, heads, HEAD, torch.bfloat16)
            with Pool.create("bw", spec, PRESETS[name], device="cuda:0") as pool:
                pool.storage.view(torch.int64).random_()
                group = CacheGroup("bw", pool.layout, n, pin_device=0)
                host = group.host
                flat = host.buffer.view(-1)[:n * span]
                src = pool.storage[:n * span]
                base = {"d2h": _gbps(n * span, timed(lambda: flat.copy_(src, non_blocking=True))),
                        "h2d": _gbps(n * span, timed(lambda: src.copy_(flat, non_blocking=True)))}
                methods = [("batched", batched), ("looped", looped)]
                if wants_staging(pool.layout):
                    methods.append(("staged", batched))
                for scattered in (False, True):
                    for label, driver in methods:
                        r = _case(pool.layout, pool.storage, host, n, scattered, driver, label)
                        rows.append({"layout": name, "span_kib": span // KIB, "blocks": n,
                                     "placement": "scattered" if scattered else "consecutive", "submission": label,
                                     **r, "baseline_d2h_gbps": base["d2h"], "baseline_h2d_gbps": base["h2d"],
                                     "d2h_vs_baseline": round(r["d2h_gbps"] / base["d2h"], 3),
                                     "h2d_vs_baseline": round(r["h2d_gbps"] / base["h2d"], 3)})
                variants = CHECKED if (name, span) == ("BLHNC", 1024 * KIB) else CHECKED[:1]
                for r in _checked(pool, group, n, base, variants):
                    rows.append({"layout": name, "span_kib": span // KIB, "checksums": True, **r})
    # The copy planner's table from these rows (`python -m kvxfer.transfer.planner` writes it to costs.json).
    return {"rows": rows, "measured_bytes": measure, "cost_table": fit(rows, "this run").to_dict()}


#: Checked variants: (host hash threads, chunk MiB or None for the pipeline's, checksums by the
#: device XXH3); the first (the daemon's defaults) is measured for every pool, the rest for
#: BLHNC at 1 MiB (they chose the defaults: docs/benchmarks.md).
CHECKED = [(2, None, True), (8, None, False), (16, None, False), (2, 16, True), (2, 64, True)]


def _checked(pool: Pool, group: CacheGroup, n: int, base: dict,
             variants: list[tuple[int, int | None, bool]]) -> list[dict]:
    """Offload and restore of n scattered blocks through PoolManager: copies, checksums, index."""
    g = torch.Generator().manual_seed(3)
    blocks = (torch.randperm(pool.layout.spec.num_blocks // 2 - 1, generator=g)[:n] * 2 + 1).tolist()
    rows = []
    for threads, chunk_mib, on_device in variants:
        engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, group.host, cuda_driver.driver(0),
                                pool=pool.storage if on_device else None, hash_threads=threads)
        manager = PoolManager(pool, group, engine=engine)
        if chunk_mib is not None:
            manager.copier = CheckedCopier(engine, group.host, chunk_bytes=chunk_mib * MIB)
        keys = [b"c%d-%s-%d-%d" % (threads, b"%d" % (chunk_mib or 0), on_device, i) for i in range(n)]
        stored = manager.offload("bw", list(zip(blocks, keys)))
        restored = manager.restore("bw", list(zip(keys, blocks)))
        assert all(o.value == "done" for o in stored.outcomes + restored.outcomes)
        off, res = _gbps(stored.bytes, stored.seconds), _gbps(restored.bytes, restored.seconds)
        rows.append({"engine": engine.describe(), "chunk_mib": manager.copier.chunk * group.host.slot_bytes // MIB,
                     "offload_gbps": off, "restore_gbps": res,
                     "offload_vs_baseline": round(off / base["d2h"], 3),
                     "restore_vs_baseline": round(res / base["h2d"], 3)})
    return rows
