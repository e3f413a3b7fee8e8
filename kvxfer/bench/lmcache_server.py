"""The peer measurement of ``kvxfer bench lmcache``: LMCache 0.5.6's cache server on CPU.

Runs under LMCache's own environment (``make bench-lmcache`` builds ``.venv-lmcache``),
so it imports nothing of kvxfer. It starts ``lmcache server`` (an L1 CPU store),
registers a paged KV cache of the given geometry the way vLLM's workers do on a
CPU (24 per-layer tensors [2, blocks, block_size, heads, head_size], shared with
the server through POSIX shared memory: LMCache's "lmcache_driven" transfer mode,
the server copies), and then, interleaved in every repetition as kvxfer's
benchmarks do: a plain contiguous copy of the same number of bytes from the KV
tensors into a local buffer; STORE of random, non-adjacent blocks; RETRIEVE of
them into other random blocks. Only the STORE and RETRIEVE calls are timed
(their LOOKUPs are not; a STORE is timed to its reply). Every repetition checks
that the retrieved blocks equal the stored ones, then empties the store (untimed)
so that the next one reuses memory already touched, as kvxfer's benchmark reuses
its host slots. The first repetition warms up. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HELLO = 9906  # LMCache's bench token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, http_port: int, log: str) -> subprocess.Popen:
    lmcache = os.path.join(os.path.dirname(sys.executable), "lmcache")
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    # Room for two requests' blocks: the store is emptied between repetitions (untimed).
    l1_gb = 1 + -(-2 * args.blocks * args.block_bytes // (1 << 30))
    with open(log, "w") as out:
        return subprocess.Popen([lmcache, "server", "--host", "127.0.0.1", "--port", str(port), "--http-host",
                                 "127.0.0.1", "--http-port", str(http_port), "--chunk-size", str(args.chunk_tokens),
                                 "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--disable-observability"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(port: int, server: subprocess.Popen, log: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"lmcache server exited with {server.returncode}; see {log}")
        with open(log) as f:
            if "cache server is running" in f.read():
                return
        time.sleep(0.5)
    raise SystemExit(f"lmcache server not ready after {timeout:.0f} s; see {log}")


def run(args: argparse.Namespace) -> dict:
    from lmcache.cli.commands.bench.server_bench.client import RequestContext, ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig
    from lmcache.cli.commands.bench.server_bench.helpers import _TIMEOUT, _make_key, _wait_for_result

    spec = f"(2,{args.pool_blocks},{args.block_size},{args.heads},{args.head_size}):bfloat16:{args.layers}"
    config = BenchConfig(rpc_url=f"tcp://127.0.0.1:{args.port}", http_url=f"http://127.0.0.1:{args.http_port}",
                         mode="cpu", transfer_mode="lmcache_driven", tp_size=1, use_mla=False,
                         num_tokens=args.blocks * args.block_size, kvcache_shape_spec=spec,
                         num_blocks=args.pool_blocks, block_size=args.block_size)
    client = ServerBenchClient(config, lambda msg: print(msg, file=sys.stderr))
    client.start()
    try:
        worker = client._workers[0]  # LMCache's bench client: one simulated worker (TP 1)
        layers = list(worker.kv_caches.values())
        blocks_in_chunk = args.chunk_tokens // args.block_size
        odd = torch.arange(1, args.pool_blocks, 2)
        gen = torch.Generator().manual_seed(1)
        nbytes = args.blocks * args.block_bytes
        per_layer = nbytes // len(layers)
        local = torch.empty(nbytes, dtype=torch.uint8)
        flat = [t.view(torch.uint8).view(-1) for t in layers]

        def copy() -> None:
            for i, t in enumerate(flat):
                local[i * per_layer:(i + 1) * per_layer].copy_(t[:per_layer])

        def transfer(kind: str, rep: int, block_ids: list[int]) -> float:
            tokens = (rep,) + (HELLO,) * (args.blocks * args.block_size - 1)  # one prefix per repetition
            request = RequestContext(rep, f"peer-{rep}-{kind}", kind, tokens, len(tokens),
                                     len(tokens) // args.chunk_tokens, args.chunk_tokens, 0, args.blocks)
            key = _make_key(request.token_ids, request.request_id, start=0, end=request.num_full_tokens,
                            worker_id=0, world_size=1)
            hits = client.lookup(request).hit_chunks  # as a vLLM worker does before either
            deadline = time.monotonic() + 10
            while kind == "retrieve" and hits != request.total_chunks:  # a store is published after its reply
                if time.monotonic() > deadline:
                    raise SystemExit(f"LMCache found {hits} of {request.total_chunks} chunks stored 10 s ago")
                time.sleep(0.01)
                hits = client.lookup(request).hit_chunks
            event = worker.transfer_context.create_recorded_event()
            start = time.perf_counter()
            if kind == "store":
                future = worker.transfer_context.submit_store(request.request_id, key, worker.kv_caches,
                                                              [block_ids], event, blocks_in_chunk)
            else:
                future = worker.transfer_context.submit_retrieve(request.request_id, key, worker.kv_caches,
                                                                 [block_ids], event, blocks_in_chunk)
            reply = _wait_for_result(future, timeout_s=300, retain_refs=(event,))
            seconds = time.perf_counter() - start
            client.end_session(request)
            if reply is _TIMEOUT or not reply:
                raise SystemExit(f"LMCache {kind} failed: {reply!r}")
            return seconds

        times: dict[str, list[float]] = {"copy": [], "store": [], "retrieve": []}
        for rep in range(args.reps + 1):  # the first repetition warms up
            picks = odd[torch.randperm(odd.numel(), generator=gen)[:2 * args.blocks]].tolist()
            sources, targets = picks[:args.blocks], picks[args.blocks:]
            start = time.perf_counter()
            copy()
            copied = time.perf_counter() - start
            stored = transfer("store", rep, sources)
            retrieved = transfer("retrieve", rep, targets)
            for t in layers:  # right bytes, or no figure at all
                if not torch.equal(t[:, targets], t[:, sources]):
                    raise SystemExit("LMCache retrieved blocks that differ from the stored ones")
            if _wait_for_result(client._req_client.clear(), timeout_s=60) is _TIMEOUT:  # reuse the same memory
                raise SystemExit("LMCache did not clear its store")
            if rep:
                for name, value in (("copy", copied), ("store", stored), ("retrieve", retrieved)):
                    times[name].append(value)
            print(f"[peer rep {rep}] copy {nbytes / copied / 1e9:.2f} GB/s, store {nbytes / stored / 1e9:.2f} GB/s,"
                  f" retrieve {nbytes / retrieved / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        client.close()
    result = {"system": "LMCache 0.5.6", "blocks": args.blocks, "bytes": nbytes}
    for name, t in times.items():
        result[f"{name}_gbps"] = nbytes / statistics.median(t) / 1e9
    for name in ("store", "retrieve"):
        result[f"{name}_vs_copy"] = statistics.median(c / x for x, c in zip(times[name], times["copy"]))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, required=True, help="blocks per request (a multiple of the chunk)")
    p.add_argument("--pool-blocks", type=int, required=True)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256, help="LMCache's chunk (its default)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    args.block_bytes = 2 * args.layers * args.block_size * args.heads * args.head_size * 2
    if (args.blocks * args.block_size) % args.chunk_tokens:
        raise SystemExit("--blocks must fill whole LMCache chunks")
    args.port, args.http_port = free_port(), free_port()
    log = os.path.join(tempfile.mkdtemp(prefix="kvxfer-peer-"), "lmcache-server.log")
    server = start_server(args, args.port, args.http_port, log)
    try:
        wait_ready(args.port, server, log)
        result = run(args)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
