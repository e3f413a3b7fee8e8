"""The engines and daemons ``kvxfer bench engine`` times, and one round of its cases for one prompt."""

from __future__ import annotations

import random
import time
from pathlib import Path

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.bench.common import wait_for
from kvxfer.bench.engine.model import TinyLlama
from kvxfer.bench.engine.process import BLOCK_SIZE, EngineProcess, EngineSpec
from kvxfer.bench.cpu_time import cpu_seconds

CASES = ("without kvxfer", "no hit", "engine cache", "restored, host", "restored, other engine", "restored, disk")
MODEL = TinyLlama(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, seed=7)
#: The daemons' own pool (a daemon needs one; the engines register theirs): tiny.
POOL = {"id": "rank0", "device": "cpu", "layout": "BLHNC", "host_capacity_mib": 1,
        "spec": {"num_layers": 1, "num_blocks": 8, "block_size": 16, "num_kv_heads": 1, "head_size": 16,
                 "dtype": "float16"}}


class Rig:
    """Three daemons' worth of setup in a context: the model, a daemon with a large host tier (engines
    ``host`` and ``peer``), one with a small host tier over a disk tier (``disk``), and ``plain``."""

    def __init__(self, workdir: Path, max_tokens: int) -> None:
        self.workdir = workdir
        self.blocks = max_tokens // BLOCK_SIZE + 8  # every prompt fits in the engine's cache
        self.max_tokens = max_tokens
        self.model_desc = (f"Llama, hidden {MODEL.hidden}, {MODEL.layers} layers, {MODEL.kv_heads} KV heads of "
                           f"{MODEL.head_dim}, {MODEL.dtype}: {MODEL.kv_bytes_per_token() // 1024} KiB of KV a token")
        self._daemons: list[launch.DaemonProcess] = []
        self._engines: list[EngineProcess] = []

    def __enter__(self) -> "Rig":
        try:
            model = MODEL.write(self.workdir / "model")
            kv_mib = self.blocks * BLOCK_SIZE * MODEL.kv_bytes_per_token() >> 20
            self.shared = self._daemon(registered_host_capacity_mib=4 * kv_mib + 64)
            # A host tier that holds one prompt: the next pushes it down to disk (a store larger than the host
            # tier is refused in part: its blocks are all pinned while it runs).
            host_mib = max(1, self.max_tokens * MODEL.kv_bytes_per_token() >> 20)
            self.small = self._daemon(registered_host_capacity_mib=host_mib,
                                      disk={"path": str(self.workdir / "disk"), "capacity_mib": 4 * kv_mib + 64})
            self.plain = self._engine(model, None, "plain")
            self.host = self._engine(model, self.shared, "host")
            self.peer = self._engine(model, self.shared, "peer")
            self.disk = self._engine(model, self.small, "disk")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for engine in self._engines:
            engine.close()
        for daemon in self._daemons:
            daemon.cleanup()

    def _daemon(self, **config) -> launch.DaemonProcess:
        daemon = launch.spawn({"log_level": "warning", "pools": [POOL], **config})
        self._daemons.append(daemon)
        return daemon

    def _engine(self, model: Path, daemon: launch.DaemonProcess | None, name: str) -> EngineProcess:
        kvxfer = None if daemon is None else {"socket": daemon.socket}
        spec = EngineSpec(model, num_blocks=self.blocks, kvxfer=kvxfer, kv_bytes_per_token=MODEL.kv_bytes_per_token(),
                          max_model_len=self.blocks * BLOCK_SIZE - BLOCK_SIZE, max_batched_tokens=self.max_tokens + 64)
        engine = EngineProcess(spec, self.workdir / f"{name}.log")
        self._engines.append(engine)
        engine.generate([5, 6, 7], max_tokens=2)  # the first request of a process pays for warming up
        return engine

    def warm(self, length: int) -> None:
        """Each engine computes a prompt of ``length`` tokens, untimed: the first of a shape sets up kernels."""
        for n, engine in enumerate(self._engines):
            engine.generate([random.Random(-n - 10 * length).randrange(10, MODEL.vocab) for _ in range(length)],
                            max_tokens=2)

    def round(self, length: int, rep: int) -> dict:
        """Every case once for a prompt of ``length`` tokens no engine has seen."""
        prompt = [random.Random(length * 1000 + rep).randrange(10, MODEL.vocab) for _ in range(length)]
        whole = length // BLOCK_SIZE
        out = {"without kvxfer": timed(self.plain, None, prompt)}
        shared, small = self.shared.proc.pid, self.small.proc.pid
        stored = _offloaded(self.shared)
        out["no hit"] = timed(self.host, shared, prompt)
        out["engine cache"] = timed(self.host, shared, prompt)
        wait_for(lambda: _offloaded(self.shared) >= stored + whole, "the host engine's blocks were stored")
        self.host.reset_prefix_cache()
        out["restored, host"] = timed(self.host, shared, prompt)
        out["restored, other engine"] = timed(self.peer, shared, prompt)
        stored = _offloaded(self.small)
        timed(self.disk, small, prompt)
        self.disk.generate([random.Random(-length - rep).randrange(10, MODEL.vocab) for _ in range(self.max_tokens)],
                           max_tokens=2)  # a prompt as long as the longest pushes this one down to disk
        # Every block stored, then the disk writer idle for half a second: a block evicted from the host tier
        # and still in the writer's queue is found by no lookup.
        wait_for(lambda: _offloaded(self.small) >= stored + whole + self.max_tokens // BLOCK_SIZE, "stored")
        wait_for(lambda: _still(lambda: _events(self.small).get("demoted", 0), 0.5), "the disk writer went idle")
        self.disk.reset_prefix_cache()
        out["restored, disk"] = timed(self.disk, small, prompt)
        # A restored request computes only the tokens after its prefix, as a hit in vLLM's own cache does: that
        # is its reference (a prompt computed whole may differ in the last bits); a request with no hit, the
        # engine without kvxfer.
        computed, cached = out["without kvxfer"]["answer"], out["engine cache"]["answer"]
        out["wrong"] = sum(not out[case]["answer"].same_as(cached if out[case]["cached"] else computed)
                           for case in CASES)
        for case in CASES:
            del out[case]["answer"]
        return out


def _stats(daemon: launch.DaemonProcess) -> list:
    with Client(daemon.target) as client:
        return [s for s in client.stats() if s.pool_id.startswith("vllm-")]


def _offloaded(daemon: launch.DaemonProcess) -> int:
    return sum(s.offloaded.blocks for s in _stats(daemon))


def _still(read, seconds: float) -> bool:
    """Whether ``read()`` gives the same value over ``seconds``."""
    before = read()
    time.sleep(seconds)
    return read() == before


def _events(daemon: launch.DaemonProcess) -> dict[str, int]:
    counts: dict[str, int] = {}
    for stats in _stats(daemon):
        for tier in stats.tiers:
            for name, n in tier.events.items():
                counts[name] = counts.get(name, 0) + n
    return counts


def timed(engine, daemon_pid: int | None, prompt: list[int]) -> dict:
    """One request: its TTFT, the CPU seconds of the engine and its daemon over it, cached tokens, answer."""
    pids = [engine.proc.pid] + ([daemon_pid] if daemon_pid else [])
    before = sum(cpu_seconds(p) for p in pids)
    answer = engine.generate(prompt, max_tokens=2)  # (vLLM stores a request's blocks at its next step)
    cpu = sum(cpu_seconds(p) for p in pids) - before
    return {"ttft_s": answer.ttft_s, "cpu_s": cpu, "cached": answer.cached, "answer": answer}

