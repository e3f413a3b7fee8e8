"""The kvxfer backend under vLLM's own scheduler and connector, against a real daemon subprocess."""

import logging
import signal
import time

import pytest
import torch

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.bench.vllm_engine import Engine, Model
from kvxfer.core.errors import PermissionDenied
from kvxfer.integrations.sidecar_link import LinkDown
from tests.helpers import stop_process
from tests.tiermem import flip_byte
from tests.vllm.conftest import DAEMON, RETRY_S, kv_transfer

PROMPT = list(range(10, 74))  # 64 tokens: 4 blocks of 16
TAIL = [900, 901, 902, 903, 904, 905, 906, 907]


def run_alone(engine, req_id, tokens, **kwargs):
    engine.add(req_id, tokens, **kwargs)
    return engine.run({req_id})


def external_hits(reports, req_id):
    return sum(r.external_hits.get(req_id, 0) for r in reports)


def computed(reports, req_id):
    return sum(r.scheduled.get(req_id, 0) for r in reports)


def pool_stats(daemon, engine):
    pool_id = engine.worker.spec.names.pool_id(0)
    with Client(daemon.target) as client:
        return client.stats(pool_id)[0]


#: vLLM's production settings beside today's: the V2 model runner (ActiveKVConnector), the asynchronous
#: scheduler with its batch queue, both together.
MODES = {"v1": {}, "v2-runner": {"runner": "v2"}, "async-scheduling": {"async_scheduling": True},
         "v2-async": {"runner": "v2", "async_scheduling": True}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC"])  # the connector's, and vLLM's default
def test_a_prefix_stored_by_one_request_is_loaded_bit_exact_by_the_next(daemon, make_engine, layout, mode):
    engine = make_engine(daemon.config["socket"], layout=layout, **MODES[mode])
    run_alone(engine, "A", PROMPT)
    stored = engine.block_bytes(engine.block_tables["A"][:4])
    assert torch.equal(stored, engine.expected_block_bytes(PROMPT, 4))
    assert engine.outputs["A"] == [engine.expected_token(PROMPT)]
    stats = pool_stats(daemon, engine)
    assert stats.tiers[0].ready_blocks == 4 and stats.outcomes.get("done") == 4

    engine.reset_prefix_cache()
    engine.zero_kv()
    reports = run_alone(engine, "B", PROMPT + TAIL)
    assert external_hits(reports, "B") == 64  # the whole prefix came from the daemon
    assert computed(reports, "B") == len(TAIL)  # vLLM computed only the new tokens
    assert not any(r.load_errors for r in reports)
    assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4]), stored)  # bit-exact, in vLLM's memory
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]


def test_tenants_with_the_same_prompt_never_hit_each_other(daemon, make_engine):
    engine = make_engine(daemon.config["socket"])
    run_alone(engine, "alice-1", PROMPT, cache_salt="alice")
    engine.reset_prefix_cache()
    reports = run_alone(engine, "bob-1", PROMPT + TAIL, cache_salt="bob")
    assert external_hits(reports, "bob-1") == 0 and computed(reports, "bob-1") == len(PROMPT + TAIL)
    engine.reset_prefix_cache()
    reports = run_alone(engine, "alice-2", PROMPT + TAIL, cache_salt="alice")
    assert external_hits(reports, "alice-2") == 64
    names = engine.worker.spec.names
    assert names.namespace("alice") != names.namespace("bob") != names.namespace(None)
    bob_keys = engine.offload_keys(PROMPT, "bob")
    with Client(daemon.target) as client:  # bob's blocks sit in bob's namespace only
        pools = names.pool_ids()
        assert client.lookup(bob_keys, pool_ids=pools, namespace=names.namespace("bob")).hits == 4
        assert client.lookup(bob_keys, pool_ids=pools, namespace=names.namespace("alice")).hits == 0


def test_a_corrupted_stored_block_is_recomputed_and_the_others_loaded(daemon, make_engine):
    engine = make_engine(daemon.config["socket"])
    run_alone(engine, "A", PROMPT)
    last_block = engine.block_bytes(engine.block_tables["A"][3:4]).contiguous().numpy().tobytes()
    engine.reset_prefix_cache()
    engine.zero_kv()  # now the daemon's host tier holds the only copy
    assert flip_byte(daemon.proc.pid, last_block) == 1

    reports = run_alone(engine, "B", PROMPT + TAIL)
    assert sum(len(r.load_errors) for r in reports) == 1  # exactly the corrupted block failed
    assert computed(reports, "B") == 16 + len(TAIL)  # it was recomputed; the other three were loaded
    assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4]), engine.expected_block_bytes(PROMPT, 4))
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]  # no wrong token
    stats = pool_stats(daemon, engine)
    assert stats.outcomes.get("data_loss") == 1 and stats.tiers[0].ready_blocks == 3  # the entry was dropped


def test_a_daemon_killed_mid_run_costs_hits_never_requests(daemon, make_engine):
    engine = make_engine(daemon.config["socket"], num_blocks=128)
    run_alone(engine, "warm", PROMPT)
    engine.reset_prefix_cache()
    prompts = {f"r{i}": [i + 1] * 16 + PROMPT + [i] * 20 for i in range(4)}
    prompts["hit"] = PROMPT + TAIL
    for req_id, tokens in prompts.items():
        engine.add(req_id, tokens)
    while not any(r for r in engine.step().external_hits):  # the load of "hit" is scheduled ...
        pass
    daemon.proc.send_signal(signal.SIGKILL)  # ... and the daemon dies under it
    daemon.proc.wait()
    engine.run(set(prompts))
    for req_id, tokens in prompts.items():  # every request finished with the right token
        assert engine.outputs[req_id] == [engine.expected_token(tokens)], req_id

    restarted = launch.spawn({**DAEMON, "socket": daemon.config["socket"]})
    try:
        engine.reset_prefix_cache()
        run_alone(engine, "again", PROMPT)  # stored through the new daemon once the link is back
        engine.reset_prefix_cache()
        time.sleep(0.3)  # the scheduler's lookups may have come before the worker registered: asked again soon
        reports = run_alone(engine, "again-hit", PROMPT + TAIL)
        assert external_hits(reports, "again-hit") == 64
        assert engine.outputs["again-hit"] == [engine.expected_token(PROMPT + TAIL)]
    finally:
        restarted.cleanup()


def test_the_scheduler_logs_the_namespace_kvxfer_events_takes(daemon, make_engine, caplog, capsys):
    """Issue 50: ``kvxfer events --namespace`` needs the engine's namespace, which nothing said."""
    from kvxfer.cli import commands as cli

    caplog.set_level(logging.INFO, logger="kvxfer.vllm")
    engine = make_engine(daemon.config["socket"])
    run_alone(engine, "A", PROMPT)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.vllm" and "--namespace" in r.getMessage()]
    command = line.rsplit("watch them with: kvxfer ", 1)[1].split()
    capsys.readouterr()
    assert cli.main([*command, "--target", daemon.target, "--timeout", "1"]) == 0
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert sum(int(row[6]) for row in rows if row[2] == "stored") == 4  # the prompt's four blocks, in that namespace


def test_no_daemon_at_start_then_one_arrives(tmp_path, make_engine, caplog):
    caplog.set_level(logging.WARNING, logger="kvxfer.vllm")
    socket = str(tmp_path / "late.sock")
    engine = make_engine(socket)
    reports = run_alone(engine, "A", PROMPT)
    assert engine.outputs["A"] == [engine.expected_token(PROMPT)] and external_hits(reports, "A") == 0
    gone = [r.getMessage() for r in caplog.records if r.name == "kvxfer.vllm" and "is gone" in r.getMessage()]
    for role in ("worker rank 0", "scheduler"):  # each side says it once, naming the socket and the cause
        (line,) = [m for m in gone if f"kvxfer {role}:" in m]
        assert socket in line and "()" not in line, line
    daemon = launch.spawn({**DAEMON, "socket": socket})
    try:
        engine.reset_prefix_cache()
        run_alone(engine, "B", PROMPT)
        engine.reset_prefix_cache()
        time.sleep(RETRY_S)
        reports = run_alone(engine, "C", PROMPT + TAIL)
        assert external_hits(reports, "C") == 64
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("extra, message", [
    ({"timeout_s": -1}, "timeout_s"), ({"retry_s": "soon"}, "retry_s"), ({"socket": ""}, "socket"),
    ({"lease_s": True}, "lease_s"), ({"cache_group": 7}, "cache_group"), ({"deadline_s": 0}, "deadline_s"),
    ({"forget_on_reset": "yes"}, "forget_on_reset: true or false"),
    ({"flush_wait_s": 30}, "flush_wait_s: not a setting"),  # replaced by deadline_s
    ({"timout_s": 1}, "timout_s: not a setting.*did you mean 'timeout_s'"),
    ({"cpu_bytes_to_use": 1 << 30}, "cpu_bytes_to_use: not a setting"),  # vLLM's CPU backend's: no effect here
    ({"blocks_per_chunk": 2}, "one GPU block under each key"), ({"block_size": 32}, "groups 2 under one"),
    ({"token_file": "/nonexistent/token"}, "token_file: /nonexistent/token"),
    ({"token_file": "/dev/null"}, "token_file: /dev/null holds 0 bytes")])
def test_bad_settings_stop_vllm_at_start_with_the_setting_named(daemon, make_engine, extra, message):
    with pytest.raises(ValueError, match=message):
        make_engine(daemon.config["socket"], settings=extra)


@pytest.mark.parametrize("extra", [{"blocks_per_chunk": 1}, {"block_size": 16}, {"offload_prompt_only": True}])
def test_vllms_own_settings_that_keep_one_block_a_key_are_accepted(daemon, make_engine, extra):
    engine = make_engine(daemon.config["socket"], settings=extra)
    run_alone(engine, "A", PROMPT)
    assert engine.outputs["A"] == [engine.expected_token(PROMPT)]


def test_recompute_is_required_so_a_lost_block_never_fails_a_request(daemon):
    config = kv_transfer({"socket": daemon.config["socket"]})
    config.kv_load_failure_policy = "fail"
    with pytest.raises(ValueError, match="recompute"):
        Engine(config, num_blocks=64)


@pytest.mark.parametrize("mode", ["v1", "v2-async"])
def test_tensor_parallel_ranks_each_serve_a_pool_and_a_block_counts_only_if_every_rank_has_it(daemon, mode):
    engine = Engine(kv_transfer({"socket": daemon.config["socket"], "retry_s": RETRY_S}), num_blocks=64,
                    tensor_parallel=2, **MODES[mode])
    try:
        names = engine.worker.spec.names
        with Client(daemon.target) as client:
            assert {p.pool_id for p in client.pools()} >= set(names.pool_ids())  # one pool per rank
        run_alone(engine, "A", PROMPT)
        stored = engine.block_bytes(engine.block_tables["A"][:4])
        engine.reset_prefix_cache()
        engine.zero_kv()
        reports = run_alone(engine, "B", PROMPT + TAIL)
        assert external_hits(reports, "B") == 64
        for rank in (0, 1):  # each rank restored its own heads
            assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4], rank), stored[:, :, rank:rank + 1])

        rank1 = engine.ranks[1].connector.spec.worker._link.client  # its registrant: only it may delete there
        keys = engine.offload_keys(PROMPT)  # rank 1 loses the last two blocks
        assert rank1.delete(keys[2:], pool_id=names.pool_id(1), namespace=names.namespace(None)) == 2
        with Client(daemon.target) as client:  # anyone else is refused
            with pytest.raises(PermissionDenied):
                client.delete(keys[:2], pool_id=names.pool_id(1), namespace=names.namespace(None))
        engine.reset_prefix_cache()
        reports = run_alone(engine, "C", PROMPT + TAIL)
        assert external_hits(reports, "C") == 32  # the minimum over the ranks
        assert engine.outputs["C"] == [engine.expected_token(PROMPT + TAIL)]
    finally:
        engine.close()


def test_a_stalled_daemon_delays_no_step_beyond_the_deadline(daemon, make_engine):
    engine = make_engine(daemon.config["socket"], settings={"timeout_s": 0.3, "retry_s": 0.5})
    run_alone(engine, "A", PROMPT)
    engine.reset_prefix_cache()
    stop_process(daemon.proc)  # alive, holding its socket, answering nothing
    try:
        for i, tokens in enumerate([PROMPT + TAIL, [5] * 40 + PROMPT]):
            engine.add(f"s{i}", tokens)
        slowest = 0.0
        while not {"s0", "s1"} <= engine.finished:
            start = time.monotonic()
            engine.step()
            slowest = max(slowest, time.monotonic() - start)
        assert slowest < 0.3 * 2 + 0.2  # at most one deadline per call that was tried, never a hang
        assert engine.outputs["s0"] == [engine.expected_token(PROMPT + TAIL)]
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    engine.run(set())  # the stores submitted before the stall (if any) are collected
    time.sleep(0.5)
    engine.reset_prefix_cache()
    reports = run_alone(engine, "after", PROMPT + TAIL)
    assert external_hits(reports, "after") == 64


def test_a_daemon_refusing_jobs_costs_hits_never_requests(make_engine):
    busy = launch.spawn({**DAEMON, "max_jobs_per_client": 1})
    try:
        engine = make_engine(busy.config["socket"], num_blocks=256)
        prompts = {f"q{i}": [i + 1] * 16 + PROMPT for i in range(8)}
        for req_id, tokens in prompts.items():
            engine.add(req_id, tokens)
        engine.run(set(prompts))
        for req_id, tokens in prompts.items():
            assert engine.outputs[req_id] == [engine.expected_token(tokens)]
        assert engine.worker.spec.worker.dropped_stores > 0  # some stores were refused: dropped, counted
    finally:
        busy.cleanup()


def test_a_submission_whose_answer_was_lost_is_settled_by_a_fence(daemon, make_engine):
    """The daemon queued a job but its answer never came: the worker must not report it finished
    (vLLM would reuse its blocks under a running copy) until a fence job proves it ran."""
    engine = make_engine(daemon.config["socket"])
    worker = engine.worker.spec.worker
    real_call, lost = worker._link.call, []

    def lose_the_first_answer(fn):
        result = real_call(fn)
        if not lost and isinstance(result, int):  # a submission's job id: drop the answer
            lost.append(result)
            raise LinkDown(False, unsure=True)
        return result

    worker._link.call = lose_the_first_answer
    run_alone(engine, "A", PROMPT)
    assert lost and worker.dropped_stores == 0  # settled with the job's own outcome: stored
    engine.reset_prefix_cache()
    engine.zero_kv()
    reports = run_alone(engine, "B", PROMPT + TAIL)
    assert external_hits(reports, "B") == 64
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]


def test_blocks_evicted_between_lookup_and_load_are_recomputed(daemon, make_engine):
    engine = make_engine(daemon.config["socket"])
    run_alone(engine, "A", PROMPT)
    engine.reset_prefix_cache()
    engine.zero_kv()
    engine.add("B", PROMPT + TAIL)
    engine.step()  # the Lookup: all four blocks are there
    names = engine.worker.spec.names
    client = engine.worker.spec.worker._link.client  # the pool's registrant: ... two are gone before the load
    assert client.delete(engine.offload_keys(PROMPT)[2:], pool_id=names.pool_id(0),
                         namespace=names.namespace(None)) == 2
    reports = engine.run({"B"})
    assert external_hits(reports, "B") == 64 and sum(len(r.load_errors) for r in reports) == 2
    assert computed(reports, "B") == 32 + len(TAIL)  # exactly the two NOT_FOUND blocks were recomputed
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]
    assert pool_stats(daemon, engine).outcomes.get("not_found") == 2


def test_after_a_daemon_restart_the_engine_is_back_long_before_retry_s(tmp_path, make_engine):
    """The restarted daemon answers but knows no pool until the worker registers again: both sides ask
    again after 0.1 s, not after retry_s (5 s here)."""
    socket = str(tmp_path / "restart.sock")
    first = launch.spawn({**DAEMON, "socket": socket})
    engine = make_engine(socket, settings={"retry_s": 5.0})
    run_alone(engine, "A", PROMPT)
    first.stop(signal.SIGKILL)
    first.cleanup()
    second = launch.spawn({**DAEMON, "socket": socket})
    try:
        for i in range(3):  # the first calls meet a daemon that does not know the pools yet
            engine.reset_prefix_cache()
            run_alone(engine, f"B{i}", PROMPT)
            time.sleep(0.15)
        engine.reset_prefix_cache()
        reports = run_alone(engine, "C", PROMPT + TAIL)
        assert external_hits(reports, "C") == 64  # (retried after 5 s, the first tries would have missed it)
        assert engine.outputs["C"] == [engine.expected_token(PROMPT + TAIL)]
    finally:
        second.cleanup()


def test_replicas_share_blocks_by_their_weights_whatever_path_they_load_them_from(daemon, make_engine):
    """Each engine loads its weights from a directory of its own: the same bytes share blocks, other
    bytes never do, and ``model_id`` names the weights explicitly."""
    cases = [(Model(), {}, Model(), {}, 64),  # same weights, two paths
             (Model(), {}, Model(weights_seed=1), {}, 0),  # a fine-tune: nothing in common
             (Model(), {"model_id": "tiny@v2"}, Model(weights_seed=1), {"model_id": "tiny@v2"}, 64)]
    for i, (model_a, settings_a, model_b, settings_b, hits) in enumerate(cases):
        prompt = [i + 1] + PROMPT[1:]
        first = make_engine(daemon.config["socket"], settings=settings_a, model=model_a)
        run_alone(first, "A", prompt)
        second = make_engine(daemon.config["socket"], settings=settings_b, model=model_b)
        time.sleep(RETRY_S)
        reports = run_alone(second, "B", prompt + TAIL)
        assert external_hits(reports, "B") == hits, i
        assert second.outputs["B"] == [second.expected_token(prompt + TAIL)]
        first.close()
        second.close()


def test_forget_on_reset_stops_serving_what_was_stored_before_a_weight_update(daemon, make_engine):
    engine = make_engine(daemon.config["socket"], settings={"forget_on_reset": True})
    run_alone(engine, "A", PROMPT)
    engine.reset_prefix_cache()  # new weights loaded in place: the old blocks must not come back
    engine.zero_kv()
    reports = run_alone(engine, "B", PROMPT + TAIL)
    assert external_hits(reports, "B") == 0 and computed(reports, "B") == len(PROMPT + TAIL)
    replica = make_engine(daemon.config["socket"], settings={"forget_on_reset": True})
    replica.reset_prefix_cache()  # a replica that took the same weight update: the same generation
    time.sleep(RETRY_S)
    reports = run_alone(replica, "C", PROMPT + TAIL)
    assert external_hits(reports, "C") == 64  # what B stored after the update
    assert replica.outputs["C"] == [replica.expected_token(PROMPT + TAIL)]


def test_an_mla_geometry_is_stored_and_loaded_bit_exact(daemon, make_engine):
    """Issue 34: vLLM's MLA cache spec (one latent a token and layer, no V) through the backend: the
    pool is registered with kv_parts 1, a whole block over all layers is one span in BLHNC, and a
    stored prefix comes back bit-exact into vLLM's own memory."""
    model = Model(num_kv_heads=1, head_size=72, latent=True)  # 72 bf16 elements: DeepSeek's 576 in miniature
    engine = make_engine(daemon.config["socket"], model=model)
    run_alone(engine, "A", PROMPT)
    stored = engine.block_bytes(engine.block_tables["A"][:4])
    assert torch.equal(stored, engine.expected_block_bytes(PROMPT, 4))
    with Client(daemon.target) as client:
        info = client.pool_info(engine.worker.spec.names.pool_id(0))
    assert info.spec.kv_parts == 1 and info.spec.block_bytes == 2 * 16 * 72 * 2  # 2 layers, no V
    engine.reset_prefix_cache()
    engine.zero_kv()
    reports = run_alone(engine, "B", PROMPT + TAIL)
    assert external_hits(reports, "B") == 64 and computed(reports, "B") == len(TAIL)
    assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4]), engine.expected_block_bytes(PROMPT, 4))
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]


def test_a_quantised_mla_cache_is_refused_with_the_reason(make_engine, daemon):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvxfer.integrations.vllm.connector import engine_names
    engine = make_engine(daemon.config["socket"], model=Model(num_kv_heads=1, head_size=72, latent=True))
    config = engine.kv_cache_config
    group = config.kv_cache_groups[0]
    quantised = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=72, dtype=torch.uint8,
                                 cache_dtype_str="fp8_ds_mla")
    group.kv_cache_spec = quantised
    with pytest.raises(ValueError, match="quantised, padded or sparse"):
        engine_names(engine.config, config)
