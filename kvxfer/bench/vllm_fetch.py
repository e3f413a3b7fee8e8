"""``kvxfer bench vllm-fetch``: a request whose prefix only a peer holds, with the router's kv.fetch and without.

Three daemons on loopback, peered (TLS, a token, NIXL): ``source`` holds the prompt (a vLLM engine on it
computed it), ``engine`` serves the vLLM engine under test (vLLM 0.33's real scheduler and connector,
``kvxfer.bench.vllm_engine``), ``decoy`` is a peer of it that holds nothing and is listed first, as a peer
that does not hold a prefix often is. Each repetition computes a fresh prompt of ``--blocks`` blocks on
``source``, then submits it to ``engine``; the step that adds it sends what the engine side knows, then the
request waits ``--wait-ms`` (in a serving engine, behind the running batch) before the step that schedules
its load. Timed: that step to the step whose ``get_finished`` reports the blocks loaded (as
``kvxfer bench vllm`` and ``vllm-prefetch``). Subjects, in turn each repetition:

- **no word, no prefetch**: the connector's ``prefetch`` off and no envelope: the load reads the peers;
- **no word, prefetch**: the backend's default: its own prefetch asks the peers in order while it waits;
- **kv.fetch**: prefetch off, the router's envelope names ``source`` and the blocks: pulled from it alone;
- **host hit**: the engine's daemon holds the prompt already (the baseline a pull aims at).

Reported: medians, each over the host hit, the share of the blocks the engine's host tier held when the
load was scheduled, and the CPU time of every process from the request's arrival to its load (a pull
made while the request waited is counted there). Needs vLLM and NIXL (``make test-vllm`` installs both into .venv-vllm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvxfer.bench import launch
from kvxfer.bench.common import Progress, save, wait_for
from kvxfer.bench.cpu_time import CpuMeter
from kvxfer.bench.peering_local import peering_configs, self_signed
from kvxfer.bench.vllm_prefetch import scheduled_to_loaded
from kvxfer.core.envelope import event_hash
from kvxfer.core.records import TierKind
from kvxfer.core.text_table import format_table

SUBJECTS = ("no word, no prefetch", "no word, prefetch", "kv.fetch", "host hit")
NAMES = ("decoy", "source", "engine")  # in this order: the engine's daemon asks the decoy first
TOKEN = "vllm-fetch-bench-token"


def _envelope(engine, prompt: list[int]):
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    hashes = [event_hash(k, vllm_keys=True) for k in engine.offload_keys(prompt)]
    return KvHintsEnvelope("0.1", f"bench-{time.monotonic_ns()}", [
        KvHintAction("fetch", "kv.fetch", "1.0", {"source_control_endpoint": "source", "block_hashes": hashes})])


def _in_host(engine, prompt: list[int]) -> float:
    names, client = engine.worker.spec.names, engine.worker.spec.worker._link.client
    tiers = client.lookup(engine.offload_keys(prompt), pool_ids=[names.pool_id(0)],
                          namespace=names.namespace(None)).tiers
    return sum(t is TierKind.HOST for t in tiers) / len(tiers)


def _load(engine, prompt: list[int], req: str, wait_s: float, meter: CpuMeter,
          kv_hints=None) -> tuple[float, float, float]:
    """(scheduled -> loaded seconds, the share of the prompt's blocks in host memory when the load was scheduled,
    CPU seconds of every process from the request's arrival to its load: the pull while it waited included)."""
    cpu = meter.now()
    engine.add(req, prompt + [7, 8, 9], kv_hints=kv_hints)
    engine.step()  # vLLM asks about every block (one Lookup); the step's metadata carries the hints
    time.sleep(wait_s)
    in_host = _in_host(engine, prompt)
    loaded = scheduled_to_loaded(engine, req, len(prompt))
    used = meter.now() - cpu
    engine.run({req})
    return loaded, in_host, used


def _stored(engine, prompt: list[int]) -> None:
    wait_for(lambda: _in_host(engine, prompt) == 1.0, "the source engine's blocks were stored", 120)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm.config import KVTransferConfig

        from kvxfer.bench.vllm_engine import Engine, Model
    except ImportError as exc:
        raise SystemExit(f"kvxfer bench vllm-fetch needs vLLM (make test-vllm installs it into .venv-vllm): {exc}")
    progress = Progress(1 + args.reps)
    with tempfile.TemporaryDirectory() as where:
        tls = self_signed(Path(where), TOKEN)
        (Path(where) / "daemon-token").write_text(TOKEN)
        configs = peering_configs(list(NAMES), tls, args.transport, dict.fromkeys(NAMES, {}))
        daemons, engines = {}, []
        try:  # nothing between here and the daemons' start: none may outlive the benchmark
            for name in NAMES:
                config = {k: v for k, v in configs[name].items() if k != "pools"}
                daemons[name] = launch.spawn({**config, "log_level": "warning",
                                              "registered_host_capacity_mib": args.host_mib})

            def engine_on(name: str):
                extra = {"socket": daemons[name].config["socket"], "share_with_peers": True,
                         "daemon_token_file": str(Path(where) / "daemon-token")}
                config = KVTransferConfig(kv_connector="KvxferConnector", kv_role="kv_both",
                                          kv_connector_module_path="kvxfer.integrations.vllm",
                                          kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
                engines.append(Engine(config, num_blocks=args.blocks + 64, max_batched_tokens=4096,
                                      model=Model(num_layers=24, num_kv_heads=2, head_size=64)))
                return engines[-1]
            source, engine = engine_on("source"), engine_on("engine")
            manager = engine.scheduler.connector.connector_scheduler.manager
            block = engine.worker.spec.names.spec.block_bytes
            progress.step(f"engines up: blocks of {block >> 10} KiB, {args.blocks} a request, {args.transport}")
            gen = torch.Generator().manual_seed(0)
            meter = CpuMeter([d.proc.pid for d in daemons.values()])
            times: dict[str, list[float]] = {s: [] for s in SUBJECTS}
            served: dict[str, list[float]] = {s: [] for s in SUBJECTS}
            cpu: dict[str, list[float]] = {s: [] for s in SUBJECTS}
            for rep in range(args.reps):
                for i, subject in enumerate(SUBJECTS):
                    prompt = [1000 + rep * 10 + i] + torch.randint(3, 999, (args.blocks * 16 - 1,),
                                                                  generator=gen).tolist()
                    tag = f"r{rep}-{i}"
                    holder = engine if subject == "host hit" else source
                    holder.add(f"{tag}-store", prompt)
                    holder.run({f"{tag}-store"})
                    _stored(holder, prompt)
                    holder.reset_prefix_cache()
                    manager.prefetch = subject == "no word, prefetch"
                    hints = _envelope(engine, prompt) if subject == "kv.fetch" else None
                    loaded, in_host, used = _load(engine, prompt, f"{tag}-load", args.wait_ms / 1000, meter, hints)
                    times[subject].append(loaded)
                    served[subject].append(in_host)
                    cpu[subject].append(used)
                progress.step(f"rep {rep + 1}: " + ", ".join(f"{s} {times[s][-1] * 1e3:.1f} ms" for s in SUBJECTS))
        finally:
            for e in engines:
                e.close()
            for d in daemons.values():
                d.cleanup()
    med = {s: statistics.median(t) for s, t in times.items()}
    share = {s: statistics.median(v) for s, v in served.items()}
    cpu_med = {s: statistics.median(v) for s, v in cpu.items()}
    print(f"{args.blocks} blocks of {block >> 10} KiB a request, held by a peer (NIXL over {args.transport}), "
          f"waiting {args.wait_ms:.0f} ms in the queue; median of {args.reps}")
    print(format_table(["subject", "scheduled -> loaded", "/ host hit", "in host memory when scheduled", "CPU"],
                       [[s, f"{med[s] * 1e3:.2f} ms", f"{med[s] / med['host hit']:.2f}x", f"{share[s]:.0%}",
                         f"{cpu_med[s] * 1e3:.1f} ms"] for s in SUBJECTS],
                       {"CPU": "every process (engine, the three daemons), from the request's arrival to its load"}))
    save(args, {"blocks": args.blocks, "block_bytes": block, "wait_ms": args.wait_ms, "transport": args.transport,
                "times_s": times, "median_s": med, "in_host": served, "cpu_s": cpu, "median_cpu_s": cpu_med}, _plot)
    return 0


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (wall, cpu) = plt.subplots(1, 2, figsize=(9, 3.8))
    labels = [s.replace(", ", ",\n") for s in SUBJECTS]
    for ax, key, title in ((wall, "times_s", "scheduled -> loaded"), (cpu, "cpu_s", "CPU, arrival -> loaded")):
        ax.boxplot([[v * 1e3 for v in results[key][s]] for s in SUBJECTS], tick_labels=labels)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"a prefix only a peer holds: {results['blocks']} blocks of {results['block_bytes'] >> 10} KiB, "
                 f"NIXL over {results['transport']}, vLLM's scheduler", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=64, help="blocks of 192 KiB a request loads")
    p.add_argument("--wait-ms", type=float, default=200.0, help="how long the request waits in the queue")
    p.add_argument("--host-mib", type=int, default=256, help="each daemon's host tier for its engine's pool")
    p.add_argument("--transport", choices=["shm", "tcp"], default="tcp", help="NIXL's UCX transport between peers")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="a PNG of each subject's times, wall and CPU")
