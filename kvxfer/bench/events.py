"""``kvxfer bench events``: what KV event subscribers cost the offloads that make the events.

A real daemon with one small CPU pool whose host tier is full, so that every offloaded block
makes two events (the evicted block's REMOVED, the new block's STORED). ``--clients`` client
processes offload batches of ``--batch`` fresh keys, paced to ``--rate`` events a second in
all (0: as fast as they can), in rounds of ``--seconds``: alternately with no subscriber and
with ``--subscribers`` WatchEvents streams open (one process reading them all, as a router's
indexer would) beside a vLLM-format ZeroMQ subscriber. Reported: offloads and events a second
in each kind of round, and their ratio (the baseline: the same run's rounds without
subscribers), medians over ``--rounds`` pairs of rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import time

from kvxfer.bench import launch
from kvxfer.bench.common import FASTER, Progress
from kvxfer.client import Client
from kvxfer.core.text_table import format_table

NAMESPACE = "bench"
SPEC = {"num_layers": 2, "num_blocks": 256, "block_size": 16, "num_kv_heads": 1, "head_size": 16, "dtype": "float16"}


def _offloader(target: str, index: int, seconds: float, batch: int, rate: float, out) -> None:
    """Offload fresh keys, ``rate`` blocks a second (0: flat out), for ``seconds``; report blocks and each
    call's seconds."""
    with Client(target, NAMESPACE, timeout=60) as client:
        client.map_pool()
        blocks = list(range(1, batch + 1))
        n, times = 0, []
        began = time.monotonic()
        while time.monotonic() < began + seconds:
            if rate:
                time.sleep(max(0.0, began + n / rate - time.monotonic()))
            pairs = list(zip(blocks, [b"%d-%d-%d" % (index, int(began * 1e3), n + i) for i in range(batch)]))
            start = time.perf_counter()
            client.offload(pairs, partial=True)
            times.append(time.perf_counter() - start)
            n += batch
    out.put((n, times, time.monotonic() - began))


def _subscribers(target: str, count: int, zmq_endpoint: str, ready, stop, out) -> None:
    """``count`` WatchEvents streams on one event loop and one ZeroMQ SUB socket, read until ``stop``.
    The responses are counted, not decoded: the subscribers share this machine's cores with the
    daemon, and what is measured is the daemon's cost of serving them."""
    import grpc
    import zmq

    from kvxfer.v1 import kvxfer_pb2 as pb

    async def main() -> int:
        received = [0] * count
        async with grpc.aio.insecure_channel(target) as channel:
            method = channel.unary_stream("/kvxfer.v1.KVTransfer/WatchEvents",
                                          request_serializer=pb.WatchEventsRequest.SerializeToString)

            async def watch(i: int) -> None:
                async for response in method(pb.WatchEventsRequest(namespaces=[NAMESPACE])):
                    received[i] += len(response)

            tasks = [asyncio.create_task(watch(i)) for i in range(count)]
            await asyncio.sleep(1.0)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return sum(received)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(zmq_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    batches = 0

    def drain() -> None:
        nonlocal batches
        while sub.poll(0):
            sub.recv_multipart()
            batches += 1

    loop = asyncio.new_event_loop()
    loop.add_reader(sub.getsockopt(zmq.FD), drain)
    grpc_events = loop.run_until_complete(main())
    drain()
    ctx.destroy(linger=0)
    out.put((grpc_events, batches))


def _round(ctx, target: str, args: argparse.Namespace, zmq_endpoint: str, subscribed: bool) -> dict:
    out, sub_out = ctx.Queue(), ctx.Queue()
    ready, stop = ctx.Event(), ctx.Event()
    reader = None
    if subscribed:
        reader = ctx.Process(target=_subscribers, args=(target, args.subscribers, zmq_endpoint, ready, stop, sub_out))
        reader.start()
        ready.wait(60)
    workers = [ctx.Process(target=_offloader, args=(target, i, args.seconds, args.batch,
                                                    args.rate / 2 / args.clients, out)) for i in range(args.clients)]
    for w in workers:
        w.start()
    done = [out.get(timeout=args.seconds + 120) for _ in workers]
    for w in workers:
        w.join(30)
    received = (0, 0)
    if reader is not None:
        stop.set()
        received = sub_out.get(timeout=60)
        reader.join(30)
    times = sorted(t for _, ts, _ in done for t in ts)
    calls_per_s = sum(len(ts) / seconds for _, ts, seconds in done)  # each over its own offloading time
    return {"offloads_per_s": calls_per_s, "events_per_s": 2 * calls_per_s,
            "block_events_per_s": 2 * sum(n / seconds for n, _, seconds in done),
            "offload_p50_ms": 1e3 * times[len(times) // 2],
            "offload_p99_ms": 1e3 * times[int(len(times) * 0.99)], "bytes_received": received[0],
            "zmq_batches": received[1]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    zmq_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pool = {"id": "bench", "device": "cpu", "layout": "BLHNC", "spec": SPEC, "host_capacity_mib": 0.25}
    progress = Progress(2 * args.rounds + 1)
    daemon = launch.spawn({"pools": [pool], "log_level": "warning", "max_concurrent_rpcs": 256,
                           "events": {"publish": zmq_endpoint, "linger_ms": args.linger_ms}})
    rows: dict[bool, list[dict]] = {False: [], True: []}
    try:  # nothing between spawn and this try: the daemon must never outlive the benchmark
        ctx = multiprocessing.get_context("spawn")
        _round(ctx, daemon.target, argparse.Namespace(**{**vars(args), "seconds": 1.0}), zmq_endpoint, False)  # fill
        progress.step("the host tier is full: every block offloaded evicts one")
        for r in range(args.rounds):
            for subscribed in (False, True):
                row = _round(ctx, daemon.target, args, zmq_endpoint, subscribed)
                rows[subscribed].append(row)
                progress.step(f"round {r}, {args.subscribers if subscribed else 0} subscribers: "
                              f"{row['offloads_per_s']:.0f} offloads/s, {row['block_events_per_s']:.0f} block "
                              f"events/s, p50 {row['offload_p50_ms']:.2f} ms")
    finally:
        daemon.stop()
        daemon.cleanup()
    med = {s: {k: statistics.median(r[k] for r in rows[s]) for k in rows[s][0]} for s in rows}
    ratio = statistics.median(w["offloads_per_s"] / wo["offloads_per_s"] for wo, w in zip(rows[False], rows[True]))
    slower = statistics.median(w["offload_p50_ms"] / wo["offload_p50_ms"] for wo, w in zip(rows[False], rows[True]))
    tail = statistics.median(w["offload_p99_ms"] / wo["offload_p99_ms"] for wo, w in zip(rows[False], rows[True]))

    def row(subscribed: bool, ratios: list) -> list:
        m = med[subscribed]
        return [args.subscribers if subscribed else 0, f"{m['offloads_per_s']:.0f}", f"{m['events_per_s']:.0f}",
                f"{m['block_events_per_s']:.0f}", f"{m['offload_p50_ms']:.2f} / {m['offload_p99_ms']:.2f}",
                f"{m['bytes_received']:.0f}" if subscribed else "-", *ratios]

    print(format_table(["subscribers", "offloads/s", "events/s", "block events/s", "offload p50 / p99 ms",
                        "bytes received", "offloads / baseline", "p50 / baseline", "p99 / baseline"],
                       [row(False, [1.0, 1.0, 1.0]), row(True, [ratio, slower, tail])],
                       {"events/s": "KV events (one a batch of blocks: a STORED and an eviction's REMOVED an "
                                    "offload); block events: blocks stored plus blocks removed",
                        "offloads / baseline": FASTER + " (the rounds without subscribers); target at least 0.95",
                        "p50 / baseline": "an offload's median time / the baseline's: above 1 is slower; "
                                          "target at most 1.05",
                        "p99 / baseline": "the same of an offload's 99th percentile; target at most 1.5"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("func", "json")},
                       "rounds": {str(k): v for k, v in rows.items()}, "ratio": ratio, "p50_ratio": slower,
                       "p99_ratio": tail},
                      f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--subscribers", type=int, default=100, help="WatchEvents streams open in the subscribed rounds")
    p.add_argument("--clients", type=int, default=2, help="client processes offloading at once")
    p.add_argument("--batch", type=int, default=32, help="blocks per Offload")
    p.add_argument("--rate", type=float, default=10_000,
                   help="block events a second asked of all clients (0: flat out)")
    p.add_argument("--seconds", type=float, default=5.0, help="how long each round offloads")
    p.add_argument("--rounds", type=int, default=3, help="pairs of rounds (without, then with subscribers)")
    p.add_argument("--linger-ms", type=int, default=50, help="the daemon's events.linger_ms")
    p.add_argument("--json", help="also write the results as JSON here")
