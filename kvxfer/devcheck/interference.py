"""The device check's stages for layer-major pools: staged copies of layer-major pools on the GPU, and
what the copies cost the model (a matmul's TFLOPS alone and while copies run).

``staging_on_the_gpu`` runs on the CUDA simulator too (its test keeps it honest on every CI
run); ``interference`` needs a GPU (torch's CUDA matmul).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from kvxfer.geometry.layout import PRESETS, KVSpec
from kvxfer.memory import cuda_driver
from kvxfer.memory.pool import Pool
from kvxfer.tiers.host import HostTier
from kvxfer.transfer import device_checksum
from kvxfer.transfer.copy_engine import CopyBatch, Direction
from kvxfer.transfer.cuda import CudaCopyEngine
from kvxfer.transfer.planner import CostTable, Method

#: LBHNC at 32 layers with 16 KiB runs (512 KiB blocks), as the bandwidth stage's middle row.
STAGED_SPEC = dict(num_layers=32, block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
REPS = 3


def _scattered(num_blocks: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(num_blocks // 2 - 1, generator=g)[:n] * 2 + 1).tolist()


def _seconds(fn: Callable[[], None]) -> float:
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def staging_on_the_gpu(ctx: dict) -> dict:
    """Staged (gather kernel + one descriptor a block) and plain DMA (a descriptor a run) move the
    same bytes each way, to the byte; both timed on the same scattered blocks."""
    n = ctx.get("staging_blocks", 64 if ctx.get("quick") else 512)
    spec = KVSpec(num_blocks=2 * n + 2, **{**STAGED_SPEC, **ctx.get("staging_spec", {})})
    driver = cuda_driver.driver(0)
    with Pool.create("staging", spec, PRESETS["LBHNC"], device="cuda:0") as pool:
        pool.storage.view(torch.int64).random_()
        block = pool.layout.block_bytes
        staged_tier, plain_tier = HostTier(n, block, pin_device=0), HostTier(n, block, pin_device=0)
        ptr = pool.storage.data_ptr()
        staged = CudaCopyEngine(ptr, pool.layout, staged_tier, driver, pool=pool.storage, device_checksums=False,
                                costs=CostTable.only(Method.STAGED))
        plain = CudaCopyEngine(ptr, pool.layout, plain_tier, driver, costs=CostTable.only(Method.BATCHED))
        if staged._stager is None:
            raise AssertionError(f"LBHNC with runs of {pool.layout.run_length} B was not staged")
        blocks = _scattered(spec.num_blocks, n, 1)  # odd blocks out, even blocks in: never the same
        targets = [b + 1 for b in _scattered(spec.num_blocks, n, 2)]
        slots = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        out = {"blocks": n, "block_bytes": block, "run_bytes": pool.layout.run_length,
               "runs_per_block": pool.layout.runs_per_block}
        for name, engine in (("staged", staged), ("dma", plain)):
            for direction in (Direction.TO_HOST, Direction.TO_POOL):
                batch = CopyBatch(direction, blocks if direction is Direction.TO_HOST else targets, slots)
                seconds = _seconds(lambda: engine.submit(batch).wait())
                key = "d2h" if direction is Direction.TO_HOST else "h2d"
                out[f"{name}_{key}_gbps"] = round(n * block / seconds / 1e9, 2)
        if not torch.equal(staged_tier.buffer, plain_tier.buffer):
            raise AssertionError("staged offload differs from the plain DMA's tier bytes")
        before = pool.storage.clone()
        staged.submit(CopyBatch(Direction.TO_POOL, targets, slots)).wait()
        after_staged = pool.storage.clone()
        pool.storage.copy_(before)
        plain.submit(CopyBatch(Direction.TO_POOL, targets, slots)).wait()
        if not torch.equal(pool.storage, after_staged):
            raise AssertionError("staged restore differs from the plain DMA's pool bytes")
        staged.close()
        plain.close()
    out["bit_identical"] = True
    return out


def _matmul_tflops(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    """bf16 matmuls on a stream of their own for about ``seconds``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.matmul(a, b)
        stream.synchronize()
        start, iters = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for _ in range(8):
                torch.matmul(a, b)
            stream.synchronize()
            iters += 8
        elapsed = time.perf_counter() - start
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * iters / elapsed / 1e12


def _copy_loop(engine: CudaCopyEngine, blocks: list[int], stop: threading.Event) -> Callable[[], None]:
    slots = list(range(len(blocks)))

    def loop() -> None:
        while not stop.is_set():
            for direction in (Direction.TO_HOST, Direction.TO_POOL):
                engine.submit(CopyBatch(direction, blocks, slots)).wait()
    return loop


def interference(ctx: dict) -> dict:
    """A matmul's TFLOPS alone, and while plain DMA, staged copies or the device XXH3 run beside it."""
    size, seconds = (4096, 0.5) if ctx.get("quick") else (8192, 2.0)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    alone = _matmul_tflops(a, b, seconds)
    n, driver = 256, cuda_driver.driver(0)
    result: dict = {"matmul": f"{size}x{size} bf16", "alone_tflops": round(alone, 1)}
    for layout in ("BLHNC", "LBHNC"):
        spec = KVSpec(num_blocks=2 * n + 2, **STAGED_SPEC)
        with Pool.create("interference", spec, PRESETS[layout], device="cuda:0") as pool:
            pool.storage.view(torch.int64).random_()
            tier = HostTier(n, pool.layout.block_bytes, pin_device=0)
            engine = CudaCopyEngine(pool.storage.data_ptr(), pool.layout, tier, driver, pool=pool.storage,
                                    device_checksums=False)
            name = "staged" if layout == "LBHNC" else "dma"
            result[name] = _beside(a, b, seconds, alone, _copy_loop, engine, _scattered(spec.num_blocks, n, 5))
            engine.close()
    data = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    spans = np.array([(i << 20, 1 << 20) for i in range(256)], dtype=np.int64)

    def hash_loop(_engine, _blocks, stop: threading.Event) -> Callable[[], None]:
        def loop() -> None:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    device_checksum.lanes(data, spans)
                    stream.synchronize()
        return loop

    result["device_xxh3"] = _beside(a, b, seconds, alone, hash_loop, None, [])
    return result


def _beside(a, b, seconds: float, alone: float, make_loop, engine, blocks) -> dict:
    stop = threading.Event()
    worker = threading.Thread(target=make_loop(engine, blocks, stop), daemon=True)
    worker.start()
    try:
        during = _matmul_tflops(a, b, seconds)
    finally:
        stop.set()
        worker.join()
    return {"tflops": round(during, 1), "slowdown": round(1 - during / alone, 4)}

