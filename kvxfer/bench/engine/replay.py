"""``kvxfer bench engine-replay TRACE``: a multi-turn request trace through a real vLLM CPU engine, with kvxfer
and without.

The trace is Mooncake's format (``../shared/traces``): each request's ``hash_ids`` name its prompt's blocks of
512 tokens (equal ids, equal prefix). The first ``--requests`` are scaled to the engine: each id becomes
``--tokens-per-id`` tokens drawn from a generator seeded by the id (so equal ids give equal tokens), a prompt is
the first ``input_length x tokens-per-id / 512`` tokens of its ids' (at most ``--max-prompt``), and each
request generates ``min(output_length, --output)`` tokens. Requests run one after another (arrival times are
not kept: one engine, one request at a time). The engine's own cache holds one longest prompt and a little
more, so what an earlier turn computed is mostly gone from it by the next turn of the conversation.

Subjects, each a fresh engine (the model of ``kvxfer bench engine``) and a fresh daemon whose host tier holds
``--host-share`` of the KV of the requests' distinct blocks: *without kvxfer*; *kvxfer*; *kvxfer, session-end
hints*: a request no later request continues (a conversation's last turn) carries
``kv_transfer_params: {"kvxfer": {"hint": "release"}}``, so its blocks leave the host tier first. Printed: TTFT
p50 and p99, generated tokens per second of wall time, the share of prompt tokens served from a cache, wrong
answers (token ids unlike vLLM alone computing the prompt after the same cached prefix) and answers whose
logprobs differ from it in any bit (``_check`` says why some may).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from kvxfer.bench.common import Progress, save

SUBJECTS = ("without kvxfer", "kvxfer", "kvxfer, session-end hints")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format trace: one JSON object a line with hash_ids")
    p.add_argument("--requests", type=int, default=64, help="the trace's first N requests")
    p.add_argument("--tokens-per-id", type=int, default=64, help="tokens a trace block becomes (512 in the trace)")
    p.add_argument("--max-prompt", type=int, default=4096, help="prompt tokens at most (a multiple of 32)")
    p.add_argument("--output", type=int, default=8, help="generated tokens a request at most")
    p.add_argument("--host-share", type=float, default=0.25,
                   help="the daemon's host tier, a share of the KV of the requests' distinct blocks")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--plot", help="a PNG of each subject's TTFT percentiles and hit ratio")


def requests_of(path: str, args: argparse.Namespace) -> list[dict]:
    """The trace's first requests, scaled: prompt token ids and tokens to generate."""
    out = []
    with open(path) as f:
        for line in f:
            if len(out) == args.requests:
                break
            if line.strip():
                record = json.loads(line)
                ids = record["hash_ids"]
                tokens = [t for h in ids for t in _tokens_of(h, args.tokens_per_id)]
                length = min(record["input_length"] * args.tokens_per_id // 512, len(tokens), args.max_prompt)
                out.append({"ids": ids, "prompt": tokens[:max(length, 1)],
                            "max_tokens": max(1, min(record["output_length"], args.output))})
    return out


def _tokens_of(block_id: int, n: int) -> list[int]:
    rng = random.Random(block_id * 7919 + 1)
    return [rng.randrange(10, 32000) for _ in range(n)]


def run(args: argparse.Namespace) -> int:
    from kvxfer.bench import launch
    from kvxfer.bench.engine.process import BLOCK_SIZE, EngineProcess, EngineSpec
    from kvxfer.bench.engine.rig import MODEL, POOL
    from kvxfer.bench.policy_hints import last_turns

    if args.requests < 2 or args.max_prompt % BLOCK_SIZE or not 0 < args.host_share <= 1 or args.tokens_per_id < 1:
        raise SystemExit("--requests: at least 2; --max-prompt: a multiple of 32; --host-share: (0, 1]")
    requests = requests_of(args.trace, args)
    last = last_turns([r["ids"] for r in requests])
    distinct_tokens = len({h for r in requests for h in r["ids"]}) * args.tokens_per_id
    host_mib = max(1, int(distinct_tokens * MODEL.kv_bytes_per_token() * args.host_share) >> 20)
    blocks = args.max_prompt // BLOCK_SIZE + 16
    progress = Progress(len(SUBJECTS) * len(requests))
    results: dict = {"requests": len(requests), "host_tier_mib": host_mib, "engine_blocks": blocks,
                     "model": MODEL.hidden, "subjects": {}}
    answers: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="kvxfer-bench-replay-") as tmp:
        model = MODEL.write(Path(tmp) / "model")
        plain = EngineSpec(model, num_blocks=blocks, kv_bytes_per_token=MODEL.kv_bytes_per_token(),
                           max_model_len=(blocks - 1) * BLOCK_SIZE, max_batched_tokens=args.max_prompt + 64)
        for subject in SUBJECTS:
            daemon = None if subject == "without kvxfer" else launch.spawn(
                {"log_level": "warning", "pools": [POOL], "registered_host_capacity_mib": host_mib})
            spec = replace(plain, kvxfer=None if daemon is None else {"socket": daemon.socket})
            engine = EngineProcess(spec, Path(tmp) / f"engine-{len(answers)}.log")
            try:
                engine.generate([5, 6, 7], max_tokens=2)  # (a process's first request pays for warming up)
                start, got = time.perf_counter(), []
                for request, is_last in zip(requests, last):
                    hint = {"kvxfer": {"hint": "release"}} if is_last and subject.endswith("hints") else None
                    got.append(engine.generate(request["prompt"], max_tokens=request["max_tokens"],
                                               kv_transfer_params=hint))
                    progress.step(f"{subject}: {len(request['prompt'])} tokens, {got[-1].cached} cached")
                wall = time.perf_counter() - start
            finally:
                engine.close()
                if daemon is not None:
                    daemon.cleanup()
            answers[subject] = got
            ttfts = sorted(a.ttft_s for a in got)
            results["subjects"][subject] = {
                "ttft_p50_ms": statistics.median(ttfts) * 1e3,
                "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] * 1e3,
                "tokens_per_s": sum(len(a.tokens) for a in got) / wall,
                "hit_ratio": sum(a.cached for a in got) / sum(len(r["prompt"]) for r in requests)}
        _check(answers, requests, results, plain, Path(tmp))
    _print(results)
    save(args, results, _plot)
    return 1 if any(s["wrong_answers"] for s in results["subjects"].values()) else 0


def _check(answers: dict[str, list], requests: list[dict], results: dict, spec, tmp: Path) -> None:
    """Each answer against vLLM alone computing the same prompt after the same cached prefix (put in its own
    cache first): ``wrong_answers`` counts token ids unlike it, ``logprobs_unlike`` answers whose logprobs
    differ in any bit. The latter is expected in a replay, with or without kvxfer: a restored prefix's KV was
    computed over earlier turns, each after its own cached prefix, and a prompt computed in other splits differs
    in the last bits (the engine tests and ``kvxfer bench engine`` compare restores bit for bit where the
    prefix was computed the same way)."""
    from kvxfer.bench.engine.process import EngineProcess

    computed = answers["without kvxfer"]
    reference = EngineProcess(spec, tmp / "reference.log")
    try:
        for subject, got in answers.items():
            wrong, unlike = [], []
            for i, answer in enumerate(got):
                expected = computed[i]
                if answer.cached != expected.cached:
                    request = requests[i]
                    reference.reset_prefix_cache()
                    if answer.cached:
                        reference.generate(request["prompt"][:answer.cached], max_tokens=1)
                    expected = reference.generate(request["prompt"], max_tokens=request["max_tokens"])
                if answer.tokens != expected.tokens:
                    wrong.append(i)
                elif not answer.same_as(expected):
                    unlike.append(i)
            results["subjects"][subject] |= {"wrong_answers": len(wrong), "wrong_requests": wrong,
                                             "logprobs_unlike": len(unlike), "logprobs_unlike_requests": unlike}
    finally:
        reference.close()


def _print(results: dict) -> None:
    print(f"{results['requests']} requests; engine cache {results['engine_blocks']} blocks; daemon host tier "
          f"{results['host_tier_mib']} MiB")
    print(f"{'subject':>27} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tokens/s':>9} {'hit ratio':>10} {'wrong':>6} "
          f"{'logprobs unlike':>16}")
    for name, s in results["subjects"].items():
        print(f"{name:>27} {s['ttft_p50_ms']:>12.1f} {s['ttft_p99_ms']:>12.1f} {s['tokens_per_s']:>9.2f} "
              f"{s['hit_ratio']:>10.3f} {s['wrong_answers']:>6} {s['logprobs_unlike']:>16}")


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["subjects"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(names))
    left.bar([i - 0.2 for i in x], [results["subjects"][n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    left.bar([i + 0.2 for i in x], [results["subjects"][n]["ttft_p99_ms"] for n in names], 0.4, label="p99")
    left.set_ylabel("TTFT, ms")
    right.bar(list(x), [results["subjects"][n]["hit_ratio"] for n in names], 0.5)
    right.set_ylabel("prompt tokens from a cache")
    for ax in (left, right):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7)
    left.legend()
    fig.suptitle(f"vLLM CPU engine: a multi-turn trace's first {results['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
