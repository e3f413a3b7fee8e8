"""``kvxfer bench vllm``: vLLM's scheduler loading a long prefix through the kvxfer backend.

vLLM 0.33's real Scheduler and connector (kvxfer.bench.vllm_engine, a stand-in
forward pass) run in this process against a real daemon. Each repetition stores a
fresh prompt of ``--blocks`` blocks, empties vLLM's prefix cache (not its KV memory: zeroing
200 MiB right before the timed steps, as the tests do to catch a load that writes nothing,
made the next RPC 2-8 ms slower here, which no engine would see), and submits
the prompt again with a few more tokens: timed is the span from the scheduler step
that schedules the load (a hit of every block) to the step whose get_finished reports
the blocks loaded. Beside it, in the same process and run, on the same bytes: a plain
gather copy of those blocks from one tensor into another, and that copy plus the
checksum pass a restore verifies. Needs vLLM (``make test-vllm`` installs it).

vLLM's own CPU offloading backend is not run beside it on a CPU machine: its worker
asserts CUDA or XPU KV tensors and copies with vllm._C's swap_blocks_batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from kvxfer.bench import launch
from kvxfer.bench.common import GB, Progress, human_bytes
from kvxfer.bench.cpu_time import CPU_NOTE, CpuMeter
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.text_table import format_table
from kvxfer.geometry.block_checksum import rows_checksums


class _Timed:
    """Seconds spent inside some methods of an object (the backend's share of a scheduler step)."""

    def __init__(self, obj, names: list[str]) -> None:
        self.seconds = 0.0
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def _restore_seconds(engine) -> float:
    """What the daemon reports its restores into the engine's pool took (copy and verification)."""
    worker = engine.worker.spec.worker
    names = engine.worker.spec.names
    return worker._link.client.stats(names.pool_id(0))[0].restored.seconds


def _load_once(engine, prompt: list[int], tag: str, backend: _Timed, schedule: _Timed,
               meter: CpuMeter) -> tuple[float, float, float, float, float, float]:
    """Store ``prompt``, forget it locally, then time the load of all its blocks: (lookup step s, the
    backend's share of it s, scheduled -> loaded s, the daemon's restore s, vLLM's schedule() in the step
    that schedules the load s, the CPU seconds of the engine and the daemon from scheduled to loaded)."""
    engine.add(f"{tag}-store", prompt)
    engine.run({f"{tag}-store"})
    engine.reset_prefix_cache()
    req = f"{tag}-load"
    engine.add(req, prompt + [7, 8, 9])
    lookup_start, backend.seconds = time.perf_counter(), 0.0
    engine.step()  # vLLM asks about every block; the backend sends one Lookup at the step's end
    lookup, share = time.perf_counter() - lookup_start, backend.seconds
    restored = _restore_seconds(engine)
    start = None
    while True:
        step_start, schedule.seconds, step_cpu = time.perf_counter(), 0.0, meter.now()
        report = engine.step()
        if req in report.external_hits:
            start, scheduling, cpu_start = step_start, schedule.seconds, step_cpu
            if report.external_hits[req] != len(prompt):
                raise SystemExit(f"expected a hit of {len(prompt)} tokens, got {report.external_hits[req]}")
        if req in report.loaded:
            loaded = time.perf_counter() - start
            cpu = meter.now() - cpu_start
            break
    engine.run({req})
    return lookup, share, loaded, _restore_seconds(engine) - restored, scheduling, cpu


def _busy_step_cost(engine, blocks: int, polls: int = 200) -> float:
    """The median time of the worker's ``get_finished`` in steps that run a forward pass while a store of
    ``blocks`` blocks is in flight (what every decoding step pays for the backend while transfers run)."""
    from kvxfer.integrations.vllm.manager import KvxferBlocks  # vLLM's own types: imported where vLLM is

    worker = engine.worker.spec.worker
    keys = [b"busy-%d" % i for i in range(blocks)]
    worker.idle_step = False
    worker.submit_store(1 << 30, SimpleNamespace(block_ids=np.arange(1, blocks + 1)), KvxferBlocks(keys, "busy"))
    costs = []
    while len(costs) < polls:
        t0 = time.perf_counter()
        done = worker.get_finished()
        costs.append(time.perf_counter() - t0)
        if done:
            worker.submit_store(1 << 30, SimpleNamespace(block_ids=np.arange(1, blocks + 1)),
                                KvxferBlocks(keys, "busy"))
    worker.wait({1 << 30})
    worker.get_finished()
    return statistics.median(costs)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm.config import KVTransferConfig

        from kvxfer.bench.vllm_engine import Engine, Model
    except ImportError as exc:
        raise SystemExit(f"kvxfer bench vllm needs vLLM (make test-vllm installs it into .venv-vllm): {exc}")
    model = Model(num_layers=args.layers, num_kv_heads=args.heads, head_size=args.head_size)
    progress = Progress(args.reps + 1)
    small = {**DEFAULT_POOL, "spec": {**DEFAULT_POOL["spec"], "num_blocks": 16}, "host_capacity_mib": 4}
    daemon = launch.spawn({"pools": [small], "log_level": "warning",
                           "registered_host_capacity_mib": args.host_mib})
    config = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"socket": daemon.config["socket"],
                                                         "lane": not args.grpc_only})
    engine = Engine(config, num_blocks=args.blocks + 64, model=model, max_batched_tokens=4096)
    try:
        progress.step("engine up")
        block = engine.worker.spec.names.spec.block_bytes
        memory = engine.ranks[0].layers[0]
        flat = torch.empty(0, dtype=torch.uint8).set_(memory.untyped_storage(), 0,
                                                      (args.blocks + 64, block), (block, 1))
        gen = torch.Generator().manual_seed(0)
        src = torch.randperm(args.blocks + 63, generator=gen)[:args.blocks].add(1)  # scattered, like vLLM's
        buffer = torch.empty(args.blocks, block, dtype=torch.uint8)
        backend = _Timed(engine.scheduler.connector.connector_scheduler.manager, ["lookup", "on_schedule_end"])
        schedule = _Timed(engine.scheduler, ["schedule"])
        rows, cpus = [], []
        meter, alone = CpuMeter([daemon.proc.pid]), CpuMeter()  # the engine (this process) and its daemon
        for rep in range(args.reps):
            prompt = [1000 + rep] + torch.randint(3, 999, (args.blocks * 16 - 1,), generator=gen).tolist()
            lookup, share, loaded, restore, scheduling, cpu = _load_once(engine, prompt, f"r{rep}", backend,
                                                                         schedule, meter)
            t0, c0 = time.perf_counter(), alone.now()
            torch.index_select(flat, 0, src, out=buffer)  # the same bytes, gathered by a plain copy
            copy, copy_cpu = time.perf_counter() - t0, alone.now() - c0
            t0, c0 = time.perf_counter(), alone.now()
            torch.index_select(flat, 0, src, out=buffer)
            rows_checksums(buffer.numpy())
            copy_hash, copy_hash_cpu = time.perf_counter() - t0, alone.now() - c0
            rows.append((lookup, share, loaded, restore, copy, copy_hash, scheduling))
            cpus.append((cpu, copy_cpu, copy_hash_cpu))
            progress.step(f"rep {rep}: loaded in {loaded * 1e3:.1f} ms (the daemon's restore {restore * 1e3:.1f} ms), "
                          f"plain copy {copy * 1e3:.1f} ms")
        nbytes = args.blocks * block
        lookup, share, loaded, restore, copy, copy_hash, scheduling = (statistics.median(col) for col in zip(*rows))
        cpu, copy_cpu, copy_hash_cpu = (statistics.median(col) for col in zip(*cpus))
        cpu_vs = {name: statistics.median(c[0] / max(c[i], 1e-9) for c in cpus)
                  for i, name in ((1, "copy"), (2, "copy_hash"))}
        busy = _busy_step_cost(engine, min(args.blocks, 256))
        gb = nbytes / GB
        table = [["kvxfer backend: scheduled -> loaded", loaded * 1e3, gb / loaded, 1.0, cpu * 1e3, cpu / gb, ""],
                 ["  of which vLLM's schedule() of the load", scheduling * 1e3, gb / scheduling,
                  loaded / scheduling, "", "", ""],
                 ["  of which the daemon's restore", restore * 1e3, gb / restore, loaded / restore, "", "", ""],
                 ["plain gather copy, same bytes", copy * 1e3, gb / copy, loaded / copy, copy_cpu * 1e3,
                  copy_cpu / gb, cpu_vs["copy"]],
                 ["copy + checksum, same bytes", copy_hash * 1e3, gb / copy_hash, loaded / copy_hash,
                  copy_hash_cpu * 1e3, copy_hash_cpu / gb, cpu_vs["copy_hash"]]]
        slowest = max(row[2] for row in rows)
        print(f"{args.blocks} blocks of {human_bytes(block)} ({nbytes / (1 << 20):.0f} MiB), "
              f"median of {args.reps}; the Lookup step before: {lookup * 1e3:.1f} ms, of which the backend "
              f"(its lookup calls and the Lookup RPC) {share * 1e3:.2f} ms; the slowest repetition "
              f"{slowest * 1e3:.1f} ms, {slowest / loaded:.2f}x the median")
        print(format_table(["path", "ms", "GB/s", "kvxfer time / this", "CPU ms", "CPU s/GB", "kvxfer CPU / this"],
                           table,
                           {"kvxfer time / this": "scheduled-to-loaded time / this row's: above 1, the row is faster",
                            "CPU": CPU_NOTE + "; kvxfer's: the engine (this process) and its daemon; the copies': "
                                              "this process alone"}))
        print(f"a step with a forward pass, a store of {min(args.blocks, 256)} blocks in flight: the backend's "
              f"get_finished took {busy * 1e6:.0f} us (median)")
        print("vLLM's CPU offloading backend: not run here (its worker needs CUDA or XPU KV tensors)")
        if args.json:
            print(json.dumps({"blocks": args.blocks, "block_bytes": block, "lookup_s": lookup,
                              "lookup_backend_s": share,
                              "loaded_s": loaded, "restore_s": restore, "schedule_s": scheduling,
                              "busy_get_finished_s": busy,
                              "copy_s": copy, "copy_hash_s": copy_hash, "slowest_loaded_s": slowest,
                              "loaded_cpu_s": cpu, "copy_cpu_s": copy_cpu, "copy_hash_cpu_s": copy_hash_cpu,
                              "cpu_vs_copy": cpu_vs["copy"], "cpu_vs_copy_hash": cpu_vs["copy_hash"]}))
    finally:
        engine.close()
        daemon.cleanup()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1024, help="blocks loaded per request")
    # The embedded default pool's geometry (Qwen2.5-0.5B, 192 KiB blocks), as in ``bench daemon``.
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=2, help="KV heads")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--host-mib", type=int, default=1024, help="the daemon's host tier for the engine's pool")
    p.add_argument("--json", action="store_true")
    p.add_argument("--grpc-only", action="store_true", help="the backend's lane off: every call over gRPC (the "
                   "baseline of the local lane)")
