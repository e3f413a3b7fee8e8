"""The device check's stages: environment, pool, round trip, corruption, bandwidth, staging and
interference, GPU tests."""

from __future__ import annotations

import ctypes
import importlib.metadata
import platform
import subprocess
import sys

import torch

from kvxfer.core.records import Outcome
from kvxfer.devcheck import daemon_stage, engine_stages, failure_stage, gpu_stages, interference, shard_stage
from kvxfer.devcheck.bandwidth import bandwidth
from kvxfer.devcheck.checksum_formats import checksum_formats
from kvxfer.geometry.block_checksum import block_checksum
from kvxfer.geometry.layout import PRESETS, KVSpec
from kvxfer.memory import cuda_driver
from kvxfer.memory.pool import Pool
from kvxfer.serving.pool_manager import PoolManager

#: 2,048 blocks of 512 KiB moved in the round trip (a 2 GiB pool of 4,096 blocks).
ROUND_TRIP = KVSpec(16, 4096, 16, 4, 128, torch.bfloat16)
NS = "devcheck"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment(ctx: dict) -> dict:
    props = torch.cuda.get_device_properties(0)
    lib = cuda_driver.load_library()
    version = ctypes.c_int()
    lib.cuDriverGetVersion(ctypes.pointer(version))
    driver = cuda_driver.driver(0)
    host_register = ctypes.c_int()
    lib.cuDeviceGetAttribute(ctypes.pointer(host_register), cuda_driver.CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, 0)
    torch_uuid = str(getattr(props, "uuid", ""))
    result = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": _version("triton"), "xxhash": _version("xxhash"),
        "numpy": _version("numpy"), "driver_version": version.value, "device": props.name,
        "uuid": torch_uuid, "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}", "host_register_supported": bool(host_register.value),
        "batched_copy_available": driver.batched,
        # kvxfer names GPUs by the driver's UUID; an engine's torch must name the same GPU alike.
        "uuid_driver": driver.uuid(),
        "uuid_driver_matches_torch": driver.uuid() in (torch_uuid, f"GPU-{torch_uuid}"),
    }
    try:
        query = "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,driver_version"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        result["nvidia_smi"] = out[0] if out else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        result["nvidia_smi"] = f"unavailable: {exc}"
    ctx["env"] = result
    return result


def pool_allocation(ctx: dict) -> dict:
    pool = Pool.create("devcheck", ROUND_TRIP, PRESETS["BLHNC"], device="cuda:0")
    ctx["pool"] = pool
    zero = bool((pool.storage == 0).all().item())
    return {"bytes": pool.layout.nbytes, "zeroed": zero, "ipc_handle_bytes": len(pool.descriptor.handle.ipc_handle)}


def round_trip(ctx: dict) -> dict:
    pool: Pool = ctx["pool"]
    g = torch.Generator(device="cuda").manual_seed(7)
    pool.storage.view(torch.int64).random_(generator=g)
    manager = PoolManager(pool, 2048 + 64)
    ctx["manager"] = manager
    n = ROUND_TRIP.num_blocks
    cpu = torch.Generator().manual_seed(1)
    sources = (torch.randperm(n - 1, generator=cpu)[:2048] + 1).tolist()
    targets = [sources[p] for p in torch.randperm(2048, generator=cpu).tolist()]  # permuted slots
    keys = [f"k{i}".encode() for i in range(2048)]
    original = {b: pool.storage[b * ROUND_TRIP.block_bytes:(b + 1) * ROUND_TRIP.block_bytes].cpu() for b in sources}
    stored = manager.offload(NS, list(zip(sources, keys)))
    assert stored.outcomes == [Outcome.DONE] * 2048, "offload"
    slots = [manager.group.index.locate(NS, k) for k in keys]
    recorded = manager.group.index.stored_checksums(slots)  # by the device XXH3, behind the copies
    read_back = [block_checksum(manager.host.read(slot)) for slot in slots]
    host_sums = [block_checksum(original[b].numpy()) for b in sources]
    restored = manager.restore(NS, list(zip(keys, targets)))
    exact = all(torch.equal(pool.storage[t * ROUND_TRIP.block_bytes:(t + 1) * ROUND_TRIP.block_bytes].cpu(),
                            original[s]) for s, t in zip(sources, targets))
    ctx["keys"], ctx["slots"] = keys, slots
    return {"blocks": 2048, "offload_done": stored.outcomes.count(Outcome.DONE),
            "restore_done": restored.outcomes.count(Outcome.DONE), "bit_exact": exact,
            "engine": manager.engine.describe(),
            "stored_checksums_equal_xxhash_of_readback": recorded == read_back == host_sums,
            "offload_gbps": round(stored.bytes / stored.seconds / 1e9, 2),
            "restore_gbps": round(restored.bytes / restored.seconds / 1e9, 2)}


def corruption(ctx: dict) -> dict:
    manager: PoolManager = ctx["manager"]
    keys, slots = ctx["keys"], ctx["slots"]
    manager.host.buffer[slots[5]][123] ^= 0x10
    result = manager.restore(NS, [(keys[4], 10), (keys[5], 11), (keys[6], 12)], )
    assert result.outcomes == [Outcome.DONE, Outcome.DATA_LOSS, Outcome.DONE], result.outcomes
    return {"outcomes": [o.value for o in result.outcomes], "dropped": manager.lookup(NS, [keys[5]]).hits == 0}


def gpu_tests(ctx: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           "tests/gpu"], capture_output=True, text=True, timeout=240)
    tail = proc.stdout.strip().splitlines()[-15:]
    if proc.returncode != 0:
        raise AssertionError("GPU tests failed:\n" + "\n".join(tail) + proc.stderr[-2000:])
    return {"summary": tail[-1] if tail else "", "output": tail}


#: (name, stage, time cap in seconds), most valuable first: a run cut short still says the most
#: (report.BUDGET_S is the whole run's). Correctness, then speed, then the GPU tests.
STAGES = [("environment", environment, 30), ("pool_allocation", pool_allocation, 30), ("round_trip", round_trip, 60),
          ("corruption", corruption, 30), ("daemon_over_grpc", daemon_stage.daemon_over_grpc, 90),
          ("engine_tensor_over_grpc", engine_stages.engine_tensor_over_grpc, 90),
          ("engine_failure_path", failure_stage.engine_failure_path, 90),
          ("dead_engine_returns_memory", engine_stages.dead_engine_returns_memory, 60), *gpu_stages.STAGES, ("staging_on_the_gpu", interference.staging_on_the_gpu, 60),
          ("canonical_blocks", shard_stage.canonical_blocks, 90),
          ("checksum_formats", checksum_formats, 45),
          ("bandwidth", bandwidth, 180), ("interference", interference.interference, 60), ("gpu_tests", gpu_tests, 120)]
