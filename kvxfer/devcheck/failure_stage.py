"""The device check's failure path: an engine whose ready event stalls past a short
deadline, then dies while the daemon polls that event.

What the first GPU run must show: the stalled offload fails at the daemon's deadline (the event is
polled from a job thread, never waited on by a stream, so nothing was enqueued and nothing stays
held); what a dead engine's event answers (``cuEventQuery``: not ready for ever, an error, or
complete); that nothing hangs after it (the dead engine's pool dropped, another engine's pool
served, offloaded, restored and unregistered: its IPC mapping closed, its staging buffers freed
with ``cuMemFree``, which synchronises implicitly); health honest; the daemon alive.

GPU only (torch's ``_sleep`` kernel is the forward pass that never ends).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from kvxfer.bench import launch
from kvxfer.client import Client
from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.transfer.plan import plan_copies

DEADLINE_S = 2.0  # the daemon's gpu_copy_deadline_s here
VICTIM = """
    import json, sys, time, torch
    from kvxfer import Client
    from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
    spec = KVSpec(4, 64, 16, 4, 128, torch.bfloat16)
    kv = torch.zeros(spec.nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    client = Client(sys.argv[1], timeout=60)
    client.register_cuda_tensor("victim", spec, PRESETS["BLHNC"], kv)
    torch.cuda._sleep(240_000_000_000)  # a forward pass that does not end (about two minutes of GPU clock)
    event = torch.cuda.Event(interprocess=True)
    event.record()
    start = time.monotonic()
    stalled = client.offload([(1, b"stalled")], cuda_event=event, partial=True).outcomes
    print(json.dumps({"stalled": stalled[0].value, "answered_after_s": round(time.monotonic() - start, 2),
                      "event": bytes(event.ipc_handle()).hex()}), flush=True)
    print(json.dumps({"orphan_job": client.submit_offload([(2, b"orphan")], cuda_event=event)}), flush=True)
    sys.stdin.read()
"""


def _dead_event(handle: str) -> str:
    """What a dead engine's event answers here (this process opens it anew)."""
    try:
        event = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), bytes.fromhex(handle))
        return "complete" if event.query() else "not ready"
    except RuntimeError as exc:
        return f"error: {str(exc)[:200]}"


def _survivor(client: Client) -> dict:
    """Another engine's pool (this process's tensor, a layout of short runs: staging buffers) served on."""
    spec, layout = KVSpec(4, 64, 16, 4, 128, torch.bfloat16), PRESETS["LBHNC"]
    kv = torch.empty(spec.nbytes, dtype=torch.uint8, device="cuda")
    kv.view(torch.int64).random_()
    torch.cuda.synchronize()
    client.register_cuda_tensor("survivor", spec, layout, kv)

    def block(b: int) -> torch.Tensor:  # a block's bytes, run by run
        plan = plan_copies(PoolLayout(spec, layout), [b], [0])
        return torch.cat([kv[o:o + n] for o, n in zip(plan.pool_offsets.tolist(), plan.nbytes.tolist())]).cpu()

    before = [block(1), block(2)]
    stored = client.offload([(1, b"s1"), (2, b"s2")], pool_id="survivor").outcomes
    back = client.restore([(b"s1", 5), (b"s2", 6)], pool_id="survivor").outcomes
    torch.cuda.synchronize()
    exact = torch.equal(block(5), before[0]) and torch.equal(block(6), before[1])
    start = time.monotonic()
    client.unregister_pool("survivor", timeout=60)
    return {"offload": [o.value for o in stored], "restore": [o.value for o in back], "bit_exact": exact,
            "unregistered_in_s": round(time.monotonic() - start, 2)}


def engine_failure_path(ctx: dict) -> dict:
    daemon = launch.spawn({"log_level": "info", "gpu_copy_deadline_s": DEADLINE_S, "registered_host_capacity_mib": 64})
    path = os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(VICTIM), daemon.target], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": path})
    out: dict = {"deadline_s": DEADLINE_S}
    try:
        line = child.stdout.readline()
        if not line:
            raise AssertionError(f"the engine process failed: {child.stderr.read()[-1500:]}")
        out.update(json.loads(line))
        out.update(json.loads(child.stdout.readline()))  # its orphan job now polls the event: kill the engine
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        killed = time.monotonic()
        out["dead_engine_event"] = _dead_event(out.pop("event"))
        with Client(daemon.target, timeout=60) as client:
            while any(p.pool_id == "victim" for p in client.pools()) and time.monotonic() - killed < 60:
                time.sleep(0.2)
            out["victim_dropped_after_s"] = round(time.monotonic() - killed, 2)
            out["health"] = client.health()
            out["survivor"] = _survivor(client)
            out["health_after"] = client.health()
        out["daemon_alive"] = daemon.proc.poll() is None
        out["daemon_log"] = [ln for ln in daemon.log.read_text().splitlines()
                             if "event" in ln or "deadline" in ln or "CUDA" in ln][-8:]
    finally:
        if child.poll() is None:
            child.kill()
        daemon.cleanup()
    survivor = out["survivor"]
    if not (out["stalled"] == Outcome.DEADLINE_EXCEEDED.value and out["health"] == out["health_after"] == "SERVING"
            and out["daemon_alive"] and out["victim_dropped_after_s"] < 60 and survivor["bit_exact"]):
        raise AssertionError(f"the failure path: {out}")
    return out
