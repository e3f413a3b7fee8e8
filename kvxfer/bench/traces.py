"""``kvxfer bench trace KIND``: synthetic request traces, in the Mooncake format ``bench policy`` replays.

Each line is one request, ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``, in time order. Equal ids are equal prefix blocks: a block's id names its
content and its whole prefix (as vLLM's chained block hashes do), so two requests share a block
only if they share every block before it. A prompt's last, partial block is its own.

The kinds are the traffic shapes the Mooncake trace does not have (its requests share documents,
not conversations); each is a seeded random process, so a kind, a seed and a count name a trace:

- ``chat``: conversations that grow turn by turn (each prompt is the last one, its answer and a new
  message), with a user's think time between turns, many conversations interleaved;
- ``agent``: tool-using sessions: a long system prompt shared by every session of one agent, then
  steps in quick succession, each adding a tool's output to the context;
- ``system-prompt``: one-turn requests that share one of a few long system prompts (a few of them
  far more popular than the rest), each with a short question of its own;
- ``scan``: the shared system prompts' traffic, with one-off long documents (read once, never
  again) passing through it: what an eviction policy must not let flush the cache.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvxfer.bench.common import Progress

BLOCK_TOKENS = 512  # the Mooncake trace's block size


@dataclass
class Blocks:
    """Content-addressed prefix chains: a block's id names its content and every block before it."""

    ids: dict[tuple[int, object], int] = field(default_factory=dict)

    def chain(self, contents: list[object]) -> list[int]:
        parent, out = -1, []
        for content in contents:
            parent = self.ids.setdefault((parent, content), len(self.ids))
            out.append(parent)
        return out


@dataclass(order=True)
class Request:
    timestamp: float
    input_length: int = field(compare=False)
    output_length: int = field(compare=False)
    contents: list = field(compare=False)  # the prompt's full blocks' contents, in order
    start: float = field(compare=False, default=-1.0)  # when its session began (generators yield in this order)

    def line(self, blocks: Blocks, serial: int) -> str:
        tail = [("partial", serial)]  # its last, partial block: its own
        return json.dumps({"timestamp": int(self.timestamp), "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": blocks.chain(self.contents + tail)})


def _tokens_to_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def chat(rng: random.Random) -> Iterator[Request]:
    """Conversations arriving every 2 s on average; 1-20 turns (mean 5); 20 s of think time on average."""
    start, conversation = 0.0, 0
    while True:
        start += rng.expovariate(1 / 2000)
        at, history, turns = start, [], min(20, 1 + int(rng.expovariate(1 / 4)))
        for turn in range(turns):
            history += [("c", conversation, turn, "user", b) for b in range(rng.randint(0, 3))]
            answer = rng.randint(100, 1000)
            yield Request(at, (len(history) + 1) * BLOCK_TOKENS, answer, list(history), start)
            history += [("c", conversation, turn, "answer", b) for b in range(_tokens_to_blocks(answer))]
            at += rng.expovariate(1 / 20000)
        conversation += 1


def agent(rng: random.Random) -> Iterator[Request]:
    """Sessions of 4 agents (system prompts of 8-24 blocks), every 5 s; 5-40 steps 1-3 s apart."""
    prompts = [[("agent", a, b) for b in range(rng.randint(8, 24))] for a in range(4)]
    start, session = 0.0, 0
    while True:
        start += rng.expovariate(1 / 5000)
        at, context = start, list(prompts[rng.randrange(4)]) + [("task", session, 0)]
        for step in range(rng.randint(5, 40)):
            yield Request(at, (len(context) + 1) * BLOCK_TOKENS, rng.randint(20, 300), list(context), start)
            context += [("tool", session, step, b) for b in range(rng.randint(1, 3))]
            at += rng.uniform(1000, 3000)
        session += 1


def system_prompt(rng: random.Random, scan_share: float = 0.0) -> Iterator[Request]:
    """A request every 100 ms on one of 200 system prompts of 4-16 blocks, Zipf-popular (s = 1.1), with
    a question of 0-2 full blocks (and its partial last); ``scan_share`` of the requests are one-off documents of 50-200 blocks."""
    prompts = [[("system", p, b) for b in range(rng.randint(4, 16))] for p in range(200)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(prompts))]
    at, i = 0.0, 0
    while True:
        at += rng.expovariate(1 / 100)
        if rng.random() < scan_share:
            contents = [("document", i, b) for b in range(rng.randint(50, 200))]
        else:
            contents = rng.choices(prompts, weights)[0] + [("question", i, b) for b in range(rng.randint(0, 2))]
        yield Request(at, (len(contents) + 1) * BLOCK_TOKENS, rng.randint(50, 500), contents, at)
        i += 1


KINDS: dict[str, Callable[[random.Random], Iterator[Request]]] = {
    "chat": chat,
    "agent": agent,
    "system-prompt": system_prompt,
    "scan": lambda rng: system_prompt(rng, scan_share=0.2),
}


def make(kind: str, requests: int, seed: int = 0) -> list[str]:
    """The first ``requests`` requests of the trace, in time order, as lines."""
    earliest: list[tuple[float, int, Request]] = []  # a max-heap (negated) of the earliest found so far
    for serial, request in enumerate(KINDS[kind](random.Random(seed))):
        if len(earliest) == requests and request.start > -earliest[0][0]:
            break  # sessions come in start order: none after this one has an earlier request
        heapq.heappush(earliest, (-request.timestamp, serial, request))
        if len(earliest) > requests:
            heapq.heappop(earliest)
    blocks = Blocks()
    ordered = sorted((r for _, _, r in earliest), key=lambda r: r.timestamp)
    return [request.line(blocks, i) for i, request in enumerate(ordered)]


def run(args: argparse.Namespace) -> int:
    progress = Progress(1)
    lines = make(args.kind, args.requests, args.seed)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    distinct = len({b for line in lines for b in json.loads(line)["hash_ids"]})
    progress.step(f"{args.kind}: {len(lines)} requests, {distinct} distinct blocks -> {args.out} "
                  f"(then: kvxfer bench policy {args.out})")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("out", help="the trace file to write (JSON lines)")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
