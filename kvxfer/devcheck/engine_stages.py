"""The device check's stages for an engine's own KV memory, through the daemon over gRPC: a child
process allocates KV as vLLM does, registers it, and offloads with and without its readiness
event; and an engine killed while registered gives its GPU memory back.

GPU only (torch's CUDA allocator and ``_share_cuda_`` are what they exercise).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from kvxfer.bench import launch

#: A small model's KV as one torch allocation: 8 layers, 256 blocks of 16 tokens, 4 KV heads of 128, bf16.
SPEC = "KVSpec(8, 256, 16, 4, 128, torch.bfloat16)"
ENGINE = """
    import json, sys, time, torch
    from kvxfer import Client
    from kvxfer.engine.kernels import write_kv
    from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
    from kvxfer.core.records import Outcome
    spec, layout = {spec}, PRESETS["BLHNC"]
    kv = torch.empty(spec.nbytes, dtype=torch.uint8, device="cuda")  # one allocation, per-layer views
    views = PoolLayout(spec, layout).views(kv)
    kv.view(torch.int64).random_()
    torch.cuda.synchronize()
    client = Client(sys.argv[1], timeout=60)
    out = {{}}
    try:
        client.register_cuda_tensor("engine", spec, layout, kv)
    except Exception as exc:  # the expandable-segments case: a clear refusal is the result
        print(json.dumps({{"registered": False, "error": f"{{type(exc).__name__}}: {{exc}}"[:400]}}), flush=True)
        sys.exit(0)
    span, stream = spec.block_bytes, torch.cuda.current_stream()
    # the engine's forward pass writes block 3 of layer 0 with the cache-write kernel
    tokens = torch.arange(3 * 16, 4 * 16, device="cuda")
    key = torch.randn((16, 4, 128), device="cuda").to(torch.bfloat16)
    value = torch.randn((16, 4, 128), device="cuda").to(torch.bfloat16)
    write_kv(key, value, *views[0], tokens)
    for name, block, target, byte, use_event in (("with_event", 1, 5, 0x5A, True), ("without_event", 2, 6, 0x6B, False)):
        torch.cuda._sleep(400_000_000)  # a pass still running (about 0.2 s) when the offload is submitted
        kv[block * span:(block + 1) * span].fill_(byte)
        event = torch.cuda.Event(interprocess=True)
        event.record(stream)
        start = time.perf_counter()
        job = client.submit_offload([(block, name.encode())], cuda_event=event if use_event else None)
        submit_ms = (time.perf_counter() - start) * 1e3
        done = client.wait_jobs([job], wait_s=30, wait_all=True)[job].outcomes
        torch.cuda.synchronize()
        back = client.restore([(name.encode(), target)]).outcomes
        torch.cuda.synchronize()
        got = kv[target * span:(target + 1) * span]
        out[name] = {{"submit_ms": round(submit_ms, 2), "offload": done[0].value, "restore": back[0].value,
                     "tier_holds_the_new_bytes": bool((got == byte).all())}}
    torch.cuda.synchronize()
    before = kv[3 * span:4 * span].clone()
    client.offload([(3, b"written")])
    client.restore([(b"written", 7)])
    torch.cuda.synchronize()
    out["write_kv_block_bit_exact"] = bool(torch.equal(kv[7 * span:8 * span], before))
    out["unregistered_cancelled_jobs"] = client.unregister_pool("engine")
    out["registered"] = True
    print(json.dumps(out), flush=True)
"""


def _engine(target: str, env: dict | None = None, code: str = ENGINE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code.format(spec=SPEC)), target],
                            env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                 **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def engine_tensor_over_grpc(ctx: dict) -> dict:
    """An engine's own tensor registered over gRPC; its event orders the daemon's copy after its
    writes (and without one the copy reads what was there); a tensor of expandable segments refused."""
    daemon = launch.spawn({"log_level": "warning", "registered_host_capacity_mib": 256})
    try:
        result = {}
        for case, env in (("default_allocator", {}),
                          ("expandable_segments", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})):
            child = _engine(daemon.target, env)
            out, err = child.communicate(timeout=120)
            if child.returncode != 0:
                raise AssertionError(f"{case}: the engine process failed: {err[-1500:]}")
            result[case] = json.loads(out.strip().splitlines()[-1])
    finally:
        daemon.cleanup()
    ok = result["default_allocator"]
    if not (ok["registered"] and ok["with_event"]["tier_holds_the_new_bytes"] and ok["write_kv_block_bit_exact"]):
        raise AssertionError(f"an engine's own tensor over gRPC: {result}")
    return result


FREE = "import torch; print(torch.cuda.mem_get_info()[0])"
HOLDER = """
    import sys, torch
    from kvxfer import Client
    from kvxfer.geometry.layout import PRESETS, KVSpec
    spec = KVSpec(16, 8192, 16, 4, 128, torch.bfloat16)  # 4 GiB
    kv = torch.empty(spec.nbytes, dtype=torch.uint8, device="cuda")
    client = Client(sys.argv[1], timeout=60)
    client.register_cuda_tensor("doomed", spec, PRESETS["BLHNC"], kv)
    print("registered", flush=True)
    sys.stdin.read()
"""


def _free_bytes() -> int:
    return int(subprocess.run([sys.executable, "-c", FREE], capture_output=True, text=True, check=True).stdout)


def dead_engine_returns_memory(ctx: dict) -> dict:
    """SIGKILL an engine whose tensor the daemon maps: the daemon notices (pidfd), unmaps, and the
    GPU memory is free again (read by a fresh process)."""
    daemon = launch.spawn({"log_level": "warning", "registered_host_capacity_mib": 64})
    try:
        free_before = _free_bytes()
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), daemon.target], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep
                                       + os.environ.get("PYTHONPATH", "")})
        if holder.stdout.readline().strip() != "registered":
            raise AssertionError(f"the engine did not register: {holder.stderr.read()[-1500:]}")
        held = free_before - _free_bytes()
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        while True:
            free = _free_bytes()
            if free >= free_before - (256 << 20) or time.monotonic() - killed > 30:
                break
            time.sleep(0.5)
        seconds = time.monotonic() - killed
    finally:
        daemon.cleanup()
    returned = free >= free_before - (256 << 20)
    if not returned:
        raise AssertionError(f"{(free_before - free) >> 20} MiB still held 30 s after the engine died")
    return {"held_while_registered_mib": held >> 20, "returned_within_s": round(seconds, 2)}
