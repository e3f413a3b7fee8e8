"""Device-check stages for GPU pools shared with other processes, kernels and the device checksum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch
import xxhash

from kvxfer.core.errors import KvxferError
from kvxfer.core.records import Medium, Outcome, PoolRef
from kvxfer.engine.block_table import BlockTable, batch_metadata
from kvxfer.engine.kernels import Kernel, compute_slot_mapping, write_kv
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.memory import cuda_mem
from kvxfer.memory.pool import Pool, PoolHandle
from kvxfer.serving.pool_registry import Limits, PoolRegistry
from kvxfer.transfer import device_checksum

ENV = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_maps_owned_pool(ctx: dict) -> dict:
    """A spawned process maps the daemon-owned pool by IPC handle and GPU UUID; each side sees
    the other's writes."""
    pool: Pool = ctx["pool"]
    span = pool.layout.block_bytes
    pool.storage[span:2 * span].fill_(0x11)
    torch.cuda.synchronize()
    d = pool.descriptor
    described = json.dumps({"spec": d.spec.to_dict(), "layout": d.layout.spelled, "handle": d.handle.ipc_handle.hex(),
                            "uuid": d.handle.device_uuid})
    child = _child("""
        import json, sys, torch
        from kvxfer.geometry.layout import KVSpec, Layout
        from kvxfer.memory.pool import Pool, PoolDescriptor, PoolHandle
        from kvxfer.core.records import Medium
        d = json.loads(sys.argv[1])
        handle = PoolHandle(Medium.CUDA, ipc_handle=bytes.fromhex(d["handle"]), device_uuid=d["uuid"])
        pool = Pool.attach(PoolDescriptor("owned", KVSpec.from_dict(d["spec"]), Layout.parse(d["layout"]), handle))
        span = pool.layout.block_bytes
        assert bool((pool.storage[span:2 * span] == 0x11).all()), "child does not see the parent's write"
        pool.storage[2 * span:3 * span].fill_(0x22)
        torch.cuda.synchronize()
        print("ok", flush=True)
    """, described)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "ok" in out, err[-2000:]
    seen = bool((pool.storage[2 * span:3 * span] == 0x22).all())
    assert seen, "the parent does not see the child's write"
    return {"child": "mapped, read and wrote", "parent_sees_child_write": seen,
            "device_uuid": pool.descriptor.handle.device_uuid}


def registered_pool_at_an_offset(ctx: dict) -> dict:
    """A child's torch tensor, inside a larger allocation, registered by IPC handle + offset and
    offloaded and restored bit-exact."""
    spec = KVSpec(4, 64, 16, 2, 64, torch.bfloat16)
    child = _child(f"""
        import sys, torch
        from kvxfer.memory.cuda_mem import share_tensor
        big = torch.empty({spec.nbytes} + (1 << 20), dtype=torch.uint8, device="cuda")
        kv = big[12288:12288 + {spec.nbytes}]  # not at the start of its allocation
        kv.view(torch.int64).random_()
        torch.cuda.synchronize()
        handle, offset = share_tensor(kv)  # as the client's register_cuda_tensor does
        print(handle.hex(), offset, flush=True)
        sys.stdin.read()  # keep the tensor alive until the daemon side has unregistered
    """)
    try:
        raw, offset = child.stdout.readline().split()
        registry = PoolRegistry(Limits(registered_host_capacity_mib=64))
        token = registry.handoffs.accept_identity(os.getuid(), child.pid)
        handle = PoolHandle(Medium.CUDA, ipc_handle=bytes.fromhex(raw), offset=int(offset),
                            device_uuid=cuda_mem.device_uuid(0))
        served, unregister = registry.register("engine", spec, PRESETS["BLHNC"], handle, token)
        storage = served.manager.pool.storage
        span = spec.block_bytes
        before = storage.clone()
        keys = [b"r%d" % i for i in range(10)]
        stored = served.manager.offload("reg", list(zip(range(1, 11), keys)))
        restored = served.manager.restore("reg", list(zip(keys, range(30, 40))))
        exact = torch.equal(storage[30 * span:40 * span], before[span:11 * span])
        registry.unregister(PoolRef("engine", served.descriptor.epoch), unregister)
        registry.close()
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert exact and stored.outcomes == restored.outcomes == [Outcome.DONE] * 10
    return {"offset": int(offset), "bit_exact": exact, "unregistered": True}


def open_own_handle_fails_cleanly(ctx: dict) -> dict:
    pool: Pool = ctx["pool"]
    try:
        cuda_mem.open_handle(pool.descriptor.handle.ipc_handle, pool.layout.nbytes, 0)
    except KvxferError as exc:  # the expected outcome: a clean error
        return {"refused": True, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"refused": False, "note": "the driver opened a handle in its exporting process"}


def _ms(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernels_on_the_gpu(ctx: dict) -> dict:
    spec = KVSpec(24, 1024, 16, 2, 64, torch.bfloat16)
    storage = torch.zeros(spec.nbytes, dtype=torch.uint8, device="cuda")
    views = PoolLayout(spec, PRESETS["BLHNC"]).views(storage)
    requests = [(0, 2048)] * 8
    table = BlockTable(8, 160, device=torch.device("cuda"))
    perm = torch.randperm(1023).add(1).tolist()
    for r in range(8):
        table.append_row(r, perm[r * 128:(r + 1) * 128])
    qsl, positions, n = batch_metadata(requests)
    qsl, positions, device_table = qsl.cuda(), positions.cuda(), table.commit(8, 8)
    result = {}
    slots = {}
    for kernel in Kernel:
        slots[kernel] = compute_slot_mapping(qsl, positions, device_table, 16, n, kernel=kernel)
        result[f"slot_mapping_{kernel.value}_ms"] = round(_ms(lambda: compute_slot_mapping(
            qsl, positions, device_table, 16, n, kernel=kernel)), 4)
    assert torch.equal(slots[Kernel.TRITON], slots[Kernel.TORCH])
    key = torch.randn((n, 2, 64), device="cuda").to(torch.bfloat16)
    value = torch.randn((n, 2, 64), device="cuda").to(torch.bfloat16)
    written = {}
    for kernel in Kernel:
        storage.zero_()
        k_cache, v_cache = views[3]
        write_kv(key, value, k_cache, v_cache, slots[Kernel.TORCH], kernel=kernel)
        written[kernel] = storage.clone()
        result[f"cache_write_{kernel.value}_ms"] = round(_ms(lambda: write_kv(
            key, value, k_cache, v_cache, slots[Kernel.TORCH], kernel=kernel)), 4)
    assert torch.equal(written[Kernel.TRITON], written[Kernel.TORCH])
    result["bit_identical"] = True
    return result


def device_checksum_vs_xxhash(ctx: dict) -> dict:
    span, n = 256 << 10, 2048
    data = torch.empty(span * n, dtype=torch.uint8, device="cuda")
    data.view(torch.int64).random_()
    starts = [i * span for i in range(n)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    device_checksum.checksums(data, starts[:2], [span] * 2)  # the first call compiles the kernel
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    device = device_checksum.checksums(data, starts, [span] * n)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    host = data.cpu().numpy()
    reference = [xxhash.xxh3_64_intdigest(host[s:s + span]) for s in starts]
    pinned = torch.empty(span * n, dtype=torch.uint8).pin_memory()
    copy_ms = _ms(lambda: pinned.copy_(data, non_blocking=True), reps=5)
    odd = device_checksum.checksums(data, [7, 1001], [241, 70001])
    odd_ok = odd == [xxhash.xxh3_64_intdigest(host[7:248]), xxhash.xxh3_64_intdigest(host[1001:71002])]
    assert device == reference and odd_ok, "device XXH3 differs from xxhash"
    spans = np.array([(s, span) for s in starts], dtype=np.int64)
    kernel = {f"kernel_gbps_{w}_warps": round(span * n / (_ms(lambda: device_checksum.lanes(data, spans, w), 5)
                                                          / 1e3) / 1e9, 1) for w in (1, 2, 4, 8)}
    chunk = spans[:64]  # a 16 MiB chunk of a restore: 64 programs
    kernel["kernel_gbps_64_spans"] = round(span * 64 / (_ms(lambda: device_checksum.lanes(data, chunk), 5)
                                                        / 1e3) / 1e9, 1)
    return {"blocks": n, "span": span, "equal_to_xxhash": True, "first_call_s": round(first_s, 3), **kernel,
            "device_gbps": round(span * n / seconds / 1e9, 2),
            "d2h_copy_gbps": round(span * n / (copy_ms / 1e3) / 1e9, 2)}


STAGES = [("child_maps_owned_pool", child_maps_owned_pool),
          ("registered_pool_at_an_offset", registered_pool_at_an_offset),
          ("open_own_handle_fails_cleanly", open_own_handle_fails_cleanly),
          ("kernels_on_the_gpu", kernels_on_the_gpu), ("device_checksum", device_checksum_vs_xxhash)]
