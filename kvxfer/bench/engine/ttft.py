"""``kvxfer bench engine``: time to first token (TTFT) of a real vLLM engine (vLLM's CPU build) with kvxfer,
by prompt length, beside the same engine without kvxfer.

Run it in the environment ``make test-engine`` builds (``.venv-engine/bin/kvxfer bench engine``). A Llama with
seeded random weights (hidden 512, 8 layers, 2 KV heads of 64: 4 KiB of KV a token, 128 KiB a 32-token block)
is written to a temporary directory; four engines load it, each a process of its own with its OpenMP threads
pinned to one core (``VLLM_CPU_OMP_THREADS_BIND=0``: the same compute with and without the connector, which
otherwise takes a core of two for itself): ``plain`` without kvxfer; ``host`` and ``peer`` sharing a daemon
whose host tier holds everything; ``disk`` on a daemon whose host tier holds one prompt of the longest, over a
disk tier. Each engine first computes a throwaway prompt of each length (the first of a shape pays for setting up
its kernels), then per length and repetition, on a prompt no engine has seen, each request generates 2 tokens:

- *without kvxfer*: ``plain``, computed; *no hit*: ``host``, computed with the connector looking up and storing;
- *engine cache*: ``host`` again, the prefix still in vLLM's own cache;
- *restored, host*: ``host`` after ``reset_prefix_cache`` (vLLM forgot it), restored from the daemon's host tier;
- *restored, other engine*: ``peer``, which never saw the prompt, restored from what ``host`` stored;
- *restored, disk*: ``disk`` after a second prompt pushed the first one's blocks down to disk and vLLM forgot
  them.

TTFT is vLLM's own (the request's arrival to its first token, from its stats). CPU seconds are the engine's
and its daemon's over the request. Every answer's token ids and logprobs are compared bit for bit with vLLM's
own: a restored one with the engine-cache hit's (the same tokens computed after the same cached prefix), one
with no hit with ``plain``'s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvxfer.bench.common import Progress, save
from kvxfer.bench.engine.rig import CASES, Rig

LENGTHS = (512, 1024, 2048, 4096, 8192)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=3, help="prompts per length (each new to every engine)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--plot", help="a PNG of TTFT by prompt length, one line a case")


def run(args: argparse.Namespace) -> int:
    if min(args.lengths) < 256 or max(args.lengths) > 16384 or any(n % 256 for n in args.lengths) or args.reps < 1:
        raise SystemExit("--lengths: multiples of 256 tokens, 256 to 16384; --reps: at least 1")
    with tempfile.TemporaryDirectory(prefix="kvxfer-bench-engine-") as tmp, Rig(Path(tmp), max(args.lengths)) as bench:
        progress = Progress(len(args.lengths) * args.reps)
        rows = []
        for length in args.lengths:
            bench.warm(length)
            samples = []
            for rep in range(args.reps):
                samples.append(bench.round(length, rep))
                progress.step(f"{length} tokens: restored {samples[-1]['restored, host']['ttft_s'] * 1e3:.1f} ms, "
                              f"computed {samples[-1]['without kvxfer']['ttft_s'] * 1e3:.1f} ms")
            rows.append(_summary(length, samples))
    results = {"model": bench.model_desc, "cases": list(CASES), "rows": rows,
               "wrong_answers": sum(r["wrong_answers"] for r in rows)}
    _print(results)
    save(args, results, _plot)
    return 1 if results["wrong_answers"] else 0


def _summary(length: int, samples: list[dict]) -> dict:
    row = {"tokens": length, "reps": len(samples), "wrong_answers": sum(s["wrong"] for s in samples)}
    for case in CASES:
        row[case] = {"ttft_ms": statistics.median(s[case]["ttft_s"] for s in samples) * 1e3,
                     "cpu_ms": statistics.median(s[case]["cpu_s"] for s in samples) * 1e3,
                     "cached": min(s[case]["cached"] for s in samples)}
    base = row["without kvxfer"]["ttft_ms"]
    row["no_hit_ratio"] = row["no hit"]["ttft_ms"] / base
    row["restored_vs_engine_cache"] = row["restored, host"]["ttft_ms"] / row["engine cache"]["ttft_ms"]
    row["speedup_restored"] = base / row["restored, host"]["ttft_ms"]
    return row


def _print(results: dict) -> None:
    print(f"model: {results['model']}")
    head = f"{'tokens':>7} " + " ".join(f"{c:>22}" for c in CASES)
    print("TTFT, median ms (CPU ms of engine and daemon)")
    print(head)
    for row in results["rows"]:
        cells = " ".join(f"{row[c]['ttft_ms']:>10.1f} ({row[c]['cpu_ms']:>7.1f})" for c in CASES)
        print(f"{row['tokens']:>7} {cells}")
    print("prompt tokens served from a cache (the fewest of the repetitions)")
    for row in results["rows"]:
        print(f"{row['tokens']:>7} " + " ".join(f"{row[c]['cached']:>22}" for c in CASES))
    print(f"{'tokens':>7} {'no hit / without':>17} {'restored / engine cache':>24} {'without / restored':>19}")
    for row in results["rows"]:
        print(f"{row['tokens']:>7} {row['no_hit_ratio']:>16.3f}x {row['restored_vs_engine_cache']:>23.2f}x "
              f"{row['speedup_restored']:>18.1f}x")
    print(f"wrong answers (token ids or logprobs unlike vLLM's own with as many tokens cached): "
          f"{results['wrong_answers']}")


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    lengths = [r["tokens"] for r in results["rows"]]
    for case in CASES:
        ax.plot(lengths, [r[case]["ttft_ms"] for r in results["rows"]], marker="o", label=case)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, median ms")
    ax.set_title("vLLM CPU engine: time to first token, with kvxfer and without")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
