"""``EngineProcess``: a real vLLM engine in a process of its own (``runner``), asked for one request at a
time. A process per engine is how tests restart an engine, kill a daemon under it, or run two side by side;
its OpenMP threads are pinned (``VLLM_CPU_OMP_THREADS_BIND``) so that runs with and without the connector
compute with the same threads and give bit-identical logprobs."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32


@dataclass
class Answer:
    """One request's outcome: generated token ids, their logprobs, prompt tokens served from a cache."""

    tokens: list[int]
    logprobs: list[float]
    cached: int
    ttft_s: float
    wall_s: float

    def same_as(self, other: "Answer") -> bool:
        """Token for token and bit for bit (JSON floats round-trip exactly)."""
        return self.tokens == other.tokens and self.logprobs == other.logprobs


@dataclass
class EngineSpec:
    """What the runner builds: a model directory, the engine cache and kvxfer's extra config (None: no
    connector)."""

    model: Path
    num_blocks: int = 80
    kvxfer: dict | None = None
    max_model_len: int = 0  # 0: what the engine cache holds (less its null block), at most 16 K
    max_batched_tokens: int = 2048
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype ("fp8": one byte an element)
    kv_bytes_per_token: int = 0
    threads: str = "0"  # VLLM_CPU_OMP_THREADS_BIND

    def to_json(self) -> str:
        # Twice the KV bytes: headroom for vLLM's check of this budget against its own page sizes, while
        # num_gpu_blocks_override fixes what is allocated.
        cache = 2 * self.num_blocks * BLOCK_SIZE * max(self.kv_bytes_per_token, 1)
        return json.dumps({"model": str(self.model), "num_blocks": self.num_blocks, "block_size": BLOCK_SIZE,
                           "kv_cache_bytes": cache,
                           "max_model_len": self.max_model_len or min(16384, (self.num_blocks - 1) * BLOCK_SIZE),
                           "kvxfer": self.kvxfer,
                           "max_batched_tokens": self.max_batched_tokens, "dtype": self.dtype,
                           "kv_cache_dtype": self.kv_cache_dtype})


class EngineError(RuntimeError):
    """The engine process died or did not answer in time; its log says why."""


class EngineProcess:
    """A running engine; ``generate`` sends one request and waits for its answer."""

    def __init__(self, spec: EngineSpec, log: Path, start_timeout_s: float = 300) -> None:
        self.log_path = log
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": spec.threads,
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with log.open("ab") as log_file:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvxfer.bench.engine.runner", spec.to_json(),
                                          str(write_fd)], stdin=subprocess.PIPE, stdout=log_file,
                                         stderr=subprocess.STDOUT, pass_fds=(write_fd,), env=env)
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r")
        self._read(start_timeout_s)  # {"ready": true}

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self._answers], [], [], timeout_s)
        line = self._answers.readline() if ready else ""
        if line:
            answer = json.loads(line)
            if "error" in answer:  # (the runner refused a request it does not know)
                raise EngineError(f"engine refused the request: {answer['error']}")
            return answer
        if ready:  # end of file: the engine exited (wait for its last words in the log)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        what = f"exited with {self.proc.returncode}" if ready else f"gave no answer within {timeout_s} s"
        raise EngineError(f"engine {what}; its log:\n{self.log_tail()}")

    def _send(self, request: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise EngineError(f"engine exited; its log:\n{self.log_tail()}") from exc

    def _ask(self, request: dict, timeout_s: float) -> dict:
        self._send(request)
        return self._read(timeout_s)

    def submit(self, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None,
               kv_transfer_params: dict | None = None) -> None:
        """Send a request without waiting for it (``result`` reads its answer)."""
        self._send({"prompt": prompt, "max_tokens": max_tokens, "cache_salt": cache_salt,
                    "kv_transfer_params": kv_transfer_params})

    def result(self, timeout_s: float = 300) -> Answer:
        return Answer(**self._read(timeout_s))

    def generate(self, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None,
                 kv_transfer_params: dict | None = None, timeout_s: float = 300) -> Answer:
        self.submit(prompt, max_tokens, cache_salt, kv_transfer_params)
        return self.result(timeout_s)

    def reset_prefix_cache(self) -> None:
        """Drop the engine's own cached blocks, as eviction would: the next hit must come from kvxfer."""
        assert self._ask({"op": "reset"}, 120)["reset"], "vLLM refused to reset its prefix cache"

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        self._answers.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

