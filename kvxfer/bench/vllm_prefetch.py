"""``kvxfer bench vllm-prefetch``: a request whose blocks only the disk tier holds, waiting in vLLM's queue.

vLLM 0.33's real Scheduler and connector (``kvxfer.bench.vllm_engine``) against a real daemon with
a host tier of ``--host-mib`` and a slow tier below it (``--tier``: a disk tier in ``--dir``, or the
object tier on a SeaweedFS S3 server on loopback). Each repetition stores a fresh prompt of
``--blocks`` blocks, pushes it down to the slow tier (other blocks through the host tier), drops the
disk tier's files from the page cache and submits the prompt again. The step that adds it asks the
daemon about its blocks (and, with prefetch on, hands the worker the request's PREFETCH); then the
request waits ``--wait-ms`` (in a serving engine, behind the running batch) before the step that
schedules its load. Timed: that step to the step whose ``get_finished`` reports the blocks loaded,
the same span ``kvxfer bench vllm`` times. Subjects, in turn each repetition:

- **prefetch off**: the connector's ``prefetch`` setting off: the load reads the disk;
- **prefetch on**: the backend's default: the blocks came up while the request waited;
- **host hit**: a prompt the host tier still holds (the baseline: the load prefetch aims at).

Reported: medians, prefetch on over the host hit (target at most 1.2x when the wait is longer than
the disk's fetch), and the share of prefetched loads' blocks the host tier held when the load was
scheduled (target at least 0.9). Needs vLLM (``make test-vllm`` installs it).
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
from kvxfer.bench.common import Progress, save
from kvxfer.bench.hints import drained, drop_page_cache
from kvxfer.core.records import TierKind
from kvxfer.core.text_table import format_table

SUBJECTS = ("prefetch off", "prefetch on", "host hit")


def _object_drained(client, pool_id: str, timeout: float = 300) -> None:
    """Until the object tier has written (or dropped) every block the host tier evicted."""
    settled = ("stored", "already_present", "stores_dropped", "deleted_while_queued")
    deadline = time.monotonic() + timeout
    while True:
        tiers = {t.tier: t for t in client.stats(pool_id)[0].tiers}
        if sum(tiers[TierKind.OBJECT].events.get(e, 0) for e in settled) >= tiers[TierKind.HOST].evictions:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the object tier did not take its demotions within {timeout:.0f} s")
        time.sleep(0.02)


def _push_down(engine, blocks: int, prompt: list[int], tier: TierKind) -> None:
    """Other blocks through the host tier, as the pool's registrant: what it held (``prompt``'s blocks among them)
    goes down to ``tier``."""
    names, client = engine.worker.spec.names, engine.worker.spec.worker._link.client
    tag = time.monotonic_ns()
    for first in range(0, blocks, 60):
        client.offload([(1 + j, b"other-%d-%d" % (tag, first + j)) for j in range(60)], pool_id=names.pool_id(0),
                       namespace=names.namespace(None), timeout=120)
        # Paced by the slow tier: a full write queue would drop demotions.
        (drained if tier is TierKind.DISK else _object_drained)(client, names.pool_id(0))
    keys, deadline = engine.offload_keys(prompt), time.monotonic() + 120
    while client.lookup(keys, pool_ids=[names.pool_id(0)], namespace=names.namespace(None)).tiers != [tier] * len(keys):
        if time.monotonic() > deadline:
            raise SystemExit(f"the prompt's blocks did not all reach the {tier.value} tier (its queue dropped some?)")
        time.sleep(0.02)


def _load(engine, prompt: list[int], req: str, wait_s: float) -> tuple[float, float]:
    """(scheduled -> loaded seconds, the share of the prompt's blocks in host memory when the load was
    scheduled) of a request for ``prompt`` that waits ``wait_s`` after the step that adds it."""
    names, client = engine.worker.spec.names, engine.worker.spec.worker._link.client
    engine.add(req, prompt + [7, 8, 9])
    engine.step()  # vLLM asks about every block (one Lookup); the step's metadata carries the PREFETCH
    time.sleep(wait_s)
    keys = engine.offload_keys(prompt)
    tiers = client.lookup(keys, pool_ids=[names.pool_id(0)], namespace=names.namespace(None)).tiers
    in_host = sum(t is TierKind.HOST for t in tiers) / len(keys)
    loaded = scheduled_to_loaded(engine, req, len(prompt))
    engine.run({req})
    return loaded, in_host


def scheduled_to_loaded(engine, req: str, hit_tokens: int) -> float:
    """Step the engine until ``req``'s load is reported done: seconds from the start of the step that scheduled it
    (a hit of ``hit_tokens``, else SystemExit) to the end of the step that reported it loaded."""
    start = None
    for _ in range(10_000):
        step_start = time.perf_counter()
        report = engine.step()
        if req in report.external_hits:
            start = step_start
            if report.external_hits[req] != hit_tokens:
                raise SystemExit(f"expected a hit of {hit_tokens} tokens, got {report.external_hits[req]}")
        if req in report.loaded and start is not None:
            return time.perf_counter() - start
    raise SystemExit(f"{req}: no load of its blocks was scheduled")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm.config import KVTransferConfig

        from kvxfer.bench.vllm_engine import Engine, Model
    except ImportError as exc:
        raise SystemExit(f"kvxfer bench vllm-prefetch needs vLLM (make test-vllm installs it into .venv-vllm): {exc}")
    progress = Progress(1 + args.reps)
    tier = TierKind(args.tier)
    s3 = None
    with tempfile.TemporaryDirectory(dir=args.dir) as disk:
        lower = {"disk": {"path": disk, "capacity_mib": 4 * args.host_mib}}
        if tier is TierKind.OBJECT:
            from kvxfer.bench.s3_server import S3Server

            s3 = S3Server()
            (Path(disk) / "secret").write_text("a-secret-of-at-least-16-bytes\n")
            lower = {"object": {"url": f"s3://{s3.bucket}/prefetch", "endpoint": s3.endpoint, "allow_http": True,
                                "secret_file": str(Path(disk) / "secret")}}
        daemon = launch.spawn({"log_level": "warning", "registered_host_capacity_mib": args.host_mib, **lower},
                              env=s3.env if s3 else None)
        engine = None
        try:  # nothing between spawn and this try: the daemon must never outlive the benchmark
            config = KVTransferConfig(kv_connector="KvxferConnector",
                                      kv_connector_module_path="kvxfer.integrations.vllm",
                                      kv_role="kv_both", kv_load_failure_policy="recompute",
                                      kv_connector_extra_config={"socket": daemon.config["socket"]})
            engine = Engine(config, num_blocks=args.blocks + 64, model=Model(num_layers=24, num_kv_heads=2,
                                                                               head_size=64), max_batched_tokens=4096)
            manager = engine.scheduler.connector.connector_scheduler.manager
            block = engine.worker.spec.names.spec.block_bytes
            host_blocks = args.host_mib * (1 << 20) // block
            progress.step(f"engine up: blocks of {block >> 10} KiB, a host tier of {host_blocks}")
            gen = torch.Generator().manual_seed(0)
            times: dict[str, list[float]] = {s: [] for s in SUBJECTS}
            served: list[float] = []
            for rep in range(args.reps):
                for subject in SUBJECTS:
                    prompt = [1000 + len(times[subject]) * 10 + SUBJECTS.index(subject)] + \
                        torch.randint(3, 999, (args.blocks * 16 - 1,), generator=gen).tolist()
                    tag = f"r{rep}-{SUBJECTS.index(subject)}"
                    engine.add(f"{tag}-store", prompt)
                    engine.run({f"{tag}-store"})
                    engine.reset_prefix_cache()
                    if subject != "host hit":
                        _push_down(engine, host_blocks + args.blocks, prompt, tier)
                        drop_page_cache(disk)
                    manager.prefetch = subject != "prefetch off"
                    loaded, in_host = _load(engine, prompt, f"{tag}-load", args.wait_ms / 1000)
                    times[subject].append(loaded)
                    if subject == "prefetch on":
                        served.append(in_host)
                progress.step("rep %d: " % (rep + 1) + ", ".join(f"{s} {times[s][-1] * 1e3:.1f} ms" for s in SUBJECTS))
        finally:
            if engine is not None:
                engine.close()
            daemon.cleanup()
            if s3 is not None:
                s3.close()
    med = {s: statistics.median(t) for s, t in times.items()}
    print(f"{args.blocks} blocks of {block >> 10} KiB a request on the {tier.value} tier, "
          f"waiting {args.wait_ms:.0f} ms "
          "in the queue; "
          f"median of {args.reps}")
    print(format_table(["subject", "scheduled -> loaded", "/ host hit"],
                       [[s, f"{med[s] * 1e3:.2f} ms", f"{med[s] / med['host hit']:.2f}x"] for s in SUBJECTS],
                       {"/ host hit": "target for prefetch on: at most 1.2x"}))
    print(f"prefetched loads: {min(served):.0%} to {max(served):.0%} of their blocks in host memory when scheduled "
          "(target: at least 90%)")
    save(args, {"tier": tier.value, "blocks": args.blocks, "block_bytes": block, "wait_ms": args.wait_ms,
                "times_s": times,
                "median_s": med, "served_from_host": served, "on_over_host": med["prefetch on"] / med["host hit"]})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=64, help="blocks of 192 KiB a request loads")
    p.add_argument("--wait-ms", type=float, default=200.0, help="how long the request waits in the queue")
    p.add_argument("--host-mib", type=int, default=64, help="the daemon's host tier for the engine's pool")
    p.add_argument("--tier", choices=["disk", "object"], default="disk", help="the slow tier: the disk tier (its "
                   "page cache dropped) or the object tier on a SeaweedFS S3 server started on loopback")
    p.add_argument("--dir", default="/tmp", help="where the disk tier goes (a directory on the device to measure)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="write the results here")
