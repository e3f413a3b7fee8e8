"""``kvxfer demo`` (``make demo``): a conversation with a small vLLM CPU engine, with kvxfer and without.

A daemon starts, and two engines of one model (seeded random weights, hidden 512, 8 layers; vLLM's CPU build):
one with the kvxfer connector, one without. Each turn of the conversation sends the whole history so far plus
a new user message; before each turn both engines forget their own cache (``reset_prefix_cache``), as other
traffic evicts it on a busy server. The engine without kvxfer computes the history again; the one with kvxfer
restores it from the daemon. Printed: each turn's time to first token (TTFT) in both, the prompt tokens served
from kvxfer, whether the answer with kvxfer is bit-exact (token ids and logprobs) against vLLM alone computing
the same tokens after the same prefix in its own cache, and ``kvxfer status`` of the daemon."""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

SYSTEM_TOKENS, TURN_TOKENS, ANSWER_TOKENS = 1024, 512, 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=6, help="turns of the conversation (each adds 512 tokens)")


def run(args: argparse.Namespace) -> int:
    from kvxfer.bench import launch
    from kvxfer.bench.engine.process import BLOCK_SIZE, EngineProcess, EngineSpec
    from kvxfer.bench.engine.rig import MODEL, POOL
    from kvxfer.cli import status_cmd

    if not 1 <= args.turns <= 20:
        raise SystemExit("--turns: 1 to 20")
    rng = random.Random(2026)
    words = lambda n: [rng.randrange(10, MODEL.vocab) for _ in range(n)]  # noqa: E731
    most = SYSTEM_TOKENS + args.turns * (TURN_TOKENS + ANSWER_TOKENS)
    blocks = most // BLOCK_SIZE + 8
    with tempfile.TemporaryDirectory(prefix="kvxfer-demo-") as tmp:
        print("writing the model and starting the daemon and two engines (about a minute) ...", flush=True)
        model = MODEL.write(Path(tmp) / "model")
        daemon = launch.spawn({"log_level": "warning", "pools": [POOL], "registered_host_capacity_mib": 256})
        engines: list[EngineProcess] = []
        try:
            for name, kvxfer in (("without", None), ("with", {"socket": daemon.socket})):
                spec = EngineSpec(model, num_blocks=blocks, kvxfer=kvxfer,
                                  kv_bytes_per_token=MODEL.kv_bytes_per_token(),
                                  max_model_len=(blocks - 1) * BLOCK_SIZE, max_batched_tokens=most + 64)
                engines.append(EngineProcess(spec, Path(tmp) / f"engine-{name}.log"))
                engines[-1].generate(words(8), max_tokens=2)  # (a process's first request pays for warming up)
            plain, offloaded = engines
            print(f"\n{'turn':>4} {'prompt':>7} {'TTFT without':>13} {'TTFT with':>10} {'from kvxfer':>12} "
                  f"{'speed-up':>9} {'bit-exact':>10}")
            history = words(SYSTEM_TOKENS)
            for turn in range(1, args.turns + 1):
                history += words(TURN_TOKENS)
                for engine in engines:
                    engine.reset_prefix_cache()  # other traffic took the engine's cache
                without = plain.generate(history, max_tokens=ANSWER_TOKENS)
                with_ = offloaded.generate(history, max_tokens=ANSWER_TOKENS)
                same = with_.same_as(_alone(plain, history, with_.cached))
                print(f"{turn:>4} {len(history):>7} {without.ttft_s * 1e3:>10.1f} ms {with_.ttft_s * 1e3:>7.1f} ms "
                      f"{with_.cached:>12} {without.ttft_s / with_.ttft_s:>8.1f}x {'yes' if same else 'NO':>10}",
                      flush=True)
                history += with_.tokens
            print("\nkvxfer status (the engine's pool is vllm-...):", flush=True)
            status_cmd.run(argparse.Namespace(target=daemon.target, interval=0.5, watch=0.0, json=False, timeout=5.0,
                                              token_file=None, ca=None))
        finally:
            for engine in engines:
                engine.close()
            daemon.cleanup()
    return 0


def _alone(plain, history: list[int], cached: int):
    """vLLM without kvxfer computing the same tokens after the same cached prefix: the answer a restored request
    must equal bit for bit (a prompt computed whole may differ from one computed after a cached prefix in the
    last bits, and a near-tie in its token)."""
    plain.reset_prefix_cache()
    if cached:
        plain.generate(history[:cached], max_tokens=1)
    return plain.generate(history, max_tokens=ANSWER_TOKENS)
