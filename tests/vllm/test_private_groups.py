"""An engine whose cache group is private (``share_events: false``): the daemon answers Lookups of its pools to
their registrant only, and vLLM's scheduler, which registered nothing, presents the tokens its workers chose
(handed over as vLLM's KV connector handshake metadata) and still hits, also after the daemon restarts."""

import signal
import time

import pytest

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.core.errors import PermissionDenied
from tests.vllm.conftest import DAEMON
from tests.vllm.test_backend import PROMPT, TAIL, external_hits, run_alone


def test_the_scheduler_of_a_private_group_hits_and_nobody_else_may_ask(tmp_path, make_engine):
    socket = str(tmp_path / "private.sock")
    first = launch.spawn({**DAEMON, "socket": socket})
    engine = make_engine(socket, settings={"share_events": False})
    try:
        run_alone(engine, "A", PROMPT)
        engine.reset_prefix_cache()
        reports = run_alone(engine, "B", PROMPT + TAIL)
        assert external_hits(reports, "B") == 64  # the scheduler's Lookup, with its workers' token
        assert engine.outputs["B"] == [engine.expected_token(PROMPT + TAIL)]
        names = engine.worker.spec.names
        with Client(first.target) as stranger:
            with pytest.raises(PermissionDenied):
                stranger.lookup(engine.offload_keys(PROMPT), pool_ids=[names.pool_id(0)],
                                namespace=names.namespace(None))
        first.stop(signal.SIGKILL)
    finally:
        first.cleanup()
    second = launch.spawn({**DAEMON, "socket": socket})
    try:
        for i in range(3):  # the first calls meet a daemon that does not know the pools yet (test_backend.py)
            engine.reset_prefix_cache()
            run_alone(engine, f"C{i}", PROMPT)  # the worker registers again, with the same token
            time.sleep(0.15)
        engine.reset_prefix_cache()
        reports = run_alone(engine, "D", PROMPT + TAIL)
        assert external_hits(reports, "D") == 64
    finally:
        second.cleanup()
