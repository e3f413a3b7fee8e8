"""Hints from vLLM's real scheduler, against a real daemon: a request joining the queue has its blocks
prefetched from the disk tier (and loaded bit-exact), an aborted request's prefetch is cancelled, and a request
whose kv_transfer_params say {"kvxfer": {"hint": "release"}} has its blocks stored released."""

import time
import urllib.request

import torch
from vllm.v1.request import RequestStatus

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.records import TierKind
from tests.e2e.redis_server import free_port
from tests.vllm.conftest import DAEMON

PROMPT = list(range(10, 74))  # 64 tokens: 4 blocks of 16
OTHER = [list(range(1000 + 100 * i, 1064 + 100 * i)) for i in range(8)]  # 8 more prompts of 4 blocks


def metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = f"{name}{{{labels}}} " if labels else f"{name} "
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted))


def prefetched(port: int) -> float:
    return sum(metric(port, "kvxfer_prefetch_keys_total", f'result="{r}"')
               for r in ("done", "present", "absent", "over_share", "cancelled"))


def where(engine, daemon, tokens) -> list:
    names = engine.worker.spec.names
    with Client(daemon.target) as client:
        return client.lookup(engine.offload_keys(tokens), pool_ids=[names.pool_id(0)],
                             namespace=names.namespace(None)).tiers


def until(condition, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def on_disk(engine, daemon) -> torch.Tensor:
    """PROMPT computed (request "A"), then pushed down to the disk tier by other traffic; vLLM's own cache and KV
    emptied. Returns what its 4 blocks held."""
    engine.add("A", PROMPT)
    engine.run({"A"})
    stored = engine.block_bytes(engine.block_tables["A"][:4])
    names = engine.worker.spec.names
    client = engine.worker.spec.worker._link.client  # the pool's registrant: other traffic fills the host tier
    for batch in range(5):  # 5 x 60 blocks through a host tier of 256: A's 4 go down to disk
        client.offload([(1 + j, b"other-%d-%d" % (batch, j)) for j in range(60)], pool_id=names.pool_id(0),
                       namespace=names.namespace(None))
    until(lambda: where(engine, daemon, PROMPT) == [TierKind.DISK] * 4, "A's blocks went down to disk")
    engine.reset_prefix_cache()
    engine.zero_kv()
    return stored


def test_a_new_requests_blocks_are_prefetched_from_disk_and_load_bit_exact(disk_daemon, make_engine):
    engine = make_engine(disk_daemon.config["socket"])
    stored = on_disk(engine, disk_daemon)
    engine.add("B", PROMPT + [900])
    reports = engine.run({"B"})
    port = disk_daemon.metrics_port
    until(lambda: prefetched(port) >= 4, "B's prefetch was carried out")
    assert engine.worker.spec.worker.hints_sent >= 1
    assert sum(r.external_hits.get("B", 0) for r in reports) == 64 and not any(r.load_errors for r in reports)
    assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4]), stored)  # bit-exact, in vLLM's memory
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + [900])]


def test_an_aborted_requests_prefetch_is_cancelled(disk_daemon, make_engine):
    engine = make_engine(disk_daemon.config["socket"])
    engine.add("A", PROMPT)
    engine.run({"A"})
    engine.add("D", PROMPT + [901])
    engine.scheduler.finish_requests(["D"], RequestStatus.FINISHED_ABORTED)  # gone before it was scheduled
    engine.add("E", OTHER[0])
    engine.run({"E"})  # the step's metadata carries D's prefetch and its cancel; rank 0 sends them, in order
    port = disk_daemon.metrics_port
    group = f'cache_group="{engine.worker.spec.names.cache_group(0)}"'
    until(lambda: metric(port, "kvxfer_hints_total", f'action="cancel",{group}') == 1, "D's prefetch cancelled")
    assert metric(port, "kvxfer_hints_total", f'action="prefetch",{group}') >= 2  # D's and E's
    until(lambda: prefetched(port) >= 8, "both prefetches ended (present, done or cancelled)")


def test_kv_transfer_params_release_stores_a_requests_blocks_released(daemon, make_engine, caplog):
    port = free_port()
    d = launch.spawn({**DAEMON, "metrics_listen": f"127.0.0.1:{port}"})
    try:
        engine = make_engine(d.config["socket"])
        engine.add("last-turn", PROMPT, kv_transfer_params={"kvxfer": {"hint": "release"}})
        engine.run({"last-turn"})
        engine.add("kept", OTHER[0], kv_transfer_params={"kvxfer": {"hint": "retain", "ttl_s": 600}})
        engine.run({"kept"})
        engine.add("bad", OTHER[1], kv_transfer_params={"kvxfer": {"hint": "forever"}})
        engine.run({"bad"})  # a malformed field costs the hint, never the request
        assert engine.outputs["bad"] == [engine.expected_token(OTHER[1])]
        assert "must be" in caplog.text
        labels = 'cache_group="{}",state="{}",tier="host"'
        group = engine.worker.spec.names.cache_group(0)
        until(lambda: metric(port, "kvxfer_tier_hinted_blocks", labels.format(group, "released")) == 4, "released")
        assert metric(port, "kvxfer_tier_hinted_blocks", labels.format(group, "retained")) == 4
    finally:
        d.cleanup()


def test_the_field_of_vllms_openai_api_reaches_the_request_as_the_backend_reads_it():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.v1.request import Request

    from kvxfer.core.records import HintAction
    from kvxfer.integrations.vllm.scheduler_hints import store_hint

    body = {"model": "m", "messages": [{"role": "user", "content": "bye"}], "max_tokens": 8,
            "kv_transfer_params": {"kvxfer": {"hint": "retain", "ttl_s": 600}}}
    params = ChatCompletionRequest.model_validate(body).to_sampling_params(8, {})
    request = Request("r", [1, 2, 3], params, None)
    assert store_hint(request.kv_transfer_params) == (HintAction.RETAIN, 600)
    assert store_hint({"kvxfer": {"hint": "release"}}) == (HintAction.RELEASE, 0)
    for bad in ({"kvxfer": {"hint": "retain"}}, {"kvxfer": {"hint": "release", "ttl_s": 5}}, {"kvxfer": "release"},
                {"kvxfer": {"hint": "retain", "ttl_s": True}}):
        assert store_hint(bad) is None
    assert store_hint(None) is None and store_hint({"other": 1}) is None
