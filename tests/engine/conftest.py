"""A real vLLM engine (vLLM's CPU build, ``make test-engine``) generating tokens through a real daemon.

Every engine is a process of its own (``kvxfer.bench.engine.process``) on a model whose seeded random weights
the session writes. ``baseline`` holds what an engine without the connector generates, computing a prompt
whole and again with its prefix in vLLM's own cache (the two may differ in the last bits: the tokens after a
cached prefix are computed in another split); ``expected`` picks the one an answer must equal bit for bit, by
how many of its prompt tokens came from a cache. A control prompt (its first block changed) must differ."""

from __future__ import annotations

import itertools
import random
import urllib.request
from pathlib import Path

import pytest

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.bench.engine.model import TinyLlama
from kvxfer.bench.engine.process import BLOCK_SIZE, Answer, EngineProcess, EngineSpec

MODEL = TinyLlama()
RETRY_S = 0.2  # the backend's retry_s here: a restarted daemon is found again soon
SMALL_POOL = {"id": "rank0", "device": "cpu", "layout": "BLHNC", "host_capacity_mib": 1,
              "spec": {"num_layers": 1, "num_blocks": 8, "block_size": 16, "num_kv_heads": 1, "head_size": 16,
                       "dtype": "float16"}}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, MODEL.vocab) for _ in range(n)]


PROMPT = tokens(1, 600)  # 18 full blocks and a partial one
CONTROL = tokens(2, BLOCK_SIZE) + PROMPT[BLOCK_SIZE:]  # the same but its first block: the output must differ
FILLERS = [tokens(10 + i, 1000) for i in range(3)]  # 93 blocks: through an 80-block engine cache, PROMPT is evicted
RESTORED = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE  # the prompt tokens that can come back (whole blocks)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return MODEL.write(tmp_path_factory.mktemp("model"), with_tokenizer=True)


@pytest.fixture(scope="session")
def baseline(model_dir, tmp_path_factory) -> dict[str, Answer]:
    """What the engine generates without kvxfer, for each prompt the tests send."""
    engine = EngineProcess(EngineSpec(model_dir, kv_bytes_per_token=MODEL.kv_bytes_per_token()),
                           tmp_path_factory.mktemp("baseline") / "engine.log")
    try:
        out = {"prompt": engine.generate(PROMPT), "prompt cached": engine.generate(PROMPT),
               "control": engine.generate(CONTROL)}
        engine.reset_prefix_cache()
        out |= {"long": engine.generate(PROMPT, max_tokens=96), "long cached": engine.generate(PROMPT, max_tokens=96)}
    finally:
        engine.close()
    assert not out["control"].same_as(out["prompt"]), "the model's output does not depend on its prefix"
    assert out["prompt cached"].cached == out["long cached"].cached == RESTORED
    return out


def expected(baseline: dict[str, Answer], answer: Answer, name: str = "prompt") -> Answer:
    """The engine's own answer without kvxfer that ``answer`` must equal: computed whole, or with the same
    prefix in vLLM's own cache."""
    if answer.cached == 0:
        return baseline[name]
    assert answer.cached == RESTORED, f"a partial hit of {answer.cached} tokens"
    return baseline[name + " cached"]


@pytest.fixture
def make_daemon():
    daemons = []

    def make(**config) -> launch.DaemonProcess:
        daemon = launch.spawn({"log_level": "info", "pools": [SMALL_POOL], "registered_host_capacity_mib": 64,
                               "grace_period_s": 5, **config})
        daemons.append(daemon)
        return daemon

    yield make
    for daemon in daemons:
        daemon.cleanup()


@pytest.fixture
def make_engine(model_dir, tmp_path):
    engines = []
    numbers = itertools.count()

    def make(socket: str | None, num_blocks: int = 80, **settings) -> EngineProcess:
        kvxfer = None if socket is None else {"socket": socket, "retry_s": RETRY_S, **settings}
        spec = EngineSpec(model_dir, num_blocks=num_blocks, kvxfer=kvxfer,
                          kv_bytes_per_token=MODEL.kv_bytes_per_token())
        engine = EngineProcess(spec, tmp_path / f"engine-{next(numbers)}.log")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def restored_blocks(daemon: launch.DaemonProcess) -> int:
    """Blocks the daemon has restored into registered engine pools (those alive now)."""
    with Client(daemon.target) as client:
        return sum(s.restored.blocks for s in client.stats() if s.pool_id.startswith("vllm-"))


def tier_events(daemon: launch.DaemonProcess) -> dict[str, int]:
    """The lower tiers' event counts ("demoted", "promoted", "corrupt", ...) summed over the engine groups."""
    counts: dict[str, int] = {}
    with Client(daemon.target) as client:
        for stats in client.stats():
            if stats.pool_id.startswith("vllm-"):
                for tier in stats.tiers:
                    for name, n in tier.events.items():
                        counts[name] = counts.get(name, 0) + n
    return counts


def evict(engine: EngineProcess) -> None:
    """Push PROMPT out of the engine's 80-block cache with other prompts, as traffic would."""
    for filler in FILLERS:
        engine.generate(filler, max_tokens=1)


def metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and labels in line or line.startswith(name + " "))
