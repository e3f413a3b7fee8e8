"""No step waits on a slow or stopped daemon beyond a job's deadline, and the daemon never
writes a block after it (vLLM's real scheduler and connector, a real daemon stopped by SIGSTOP)."""

import signal
import time

import pytest
import torch

from tests.helpers import stop_process
from tests.vllm.test_backend import MODES, PROMPT, TAIL, external_hits, pool_stats, run_alone

TIMEOUT_S, DEADLINE_S = 0.3, 0.5


@pytest.mark.parametrize("mode", ["v1", "v2-async"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync-load", "async-load"])
def test_a_stopped_daemon_costs_a_step_at_most_the_deadline_and_the_blocks_are_recomputed(daemon, make_engine,
                                                                                          sync, mode):
    settings = {"timeout_s": TIMEOUT_S, "retry_s": 0.5, "deadline_s": DEADLINE_S}
    if sync:  # vLLM loads these blocks inside the step that runs the request (worker.wait)
        settings["sync_load_budget_bytes"] = 1 << 30
    engine = make_engine(daemon.config["socket"], settings=settings, **MODES[mode])
    run_alone(engine, "A", PROMPT)
    restored_before = pool_stats(daemon, engine).restored.blocks
    engine.reset_prefix_cache()
    engine.zero_kv()
    engine.add("B", PROMPT + TAIL)
    engine.step()  # the Lookup: all four blocks are at the daemon
    stop_process(daemon.proc)  # alive, holding its socket, answering nothing
    try:
        steps, start = [], time.monotonic()
        while "B" not in engine.finished:  # B finishes while the daemon is stopped: bounded by the deadline
            steps.append(engine.step())
            assert time.monotonic() - start < 120, "B never finished while the daemon was stopped"  # (a hang)
        assert external_hits(steps, "B") == 64 and sum(len(r.load_errors) for r in steps) == 4
        assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]  # recomputed, while stopped
        worker = engine.worker.spec.worker
        assert worker.given_up >= 1 and worker.failed_load_blocks == 4
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    kv = engine.block_bytes(engine.block_tables["B"][:4])
    engine.run(set())
    time.sleep(0.6)  # the daemon runs (or drops) the restore it received while stopped; the link is due again
    engine.step()
    assert pool_stats(daemon, engine).restored.blocks == restored_before  # nothing written after the deadline
    assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4]), kv)
    assert torch.equal(kv, engine.expected_block_bytes(PROMPT, 4))
    engine.reset_prefix_cache()
    reports = run_alone(engine, "after", PROMPT + TAIL)  # the link recovers: hits again
    assert external_hits(reports, "after") == 64
