"""SGLang's own HiCacheController (its prefetch, I/O, sync and backup threads) with the kvxfer backend."""

import signal
import time

import pytest
import torch

from kvxfer.bench import sglang_engine
from kvxfer.bench import launch
from tests.helpers import made_and_closed
from tests.sglang.conftest import DAEMON, RETRY_S, fill

TOKENS = list(range(5000, 5000 + 48))  # six pages of 8


def _pages(host, indices: torch.Tensor) -> list[bytes]:
    return [host.get_data_page(int(i), flat=True).view(torch.uint8).numpy().tobytes()
            for i in indices[::host.page_size]]


@pytest.fixture
def controllers():
    yield from made_and_closed(sglang_engine.Controller)


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_a_write_through_is_prefetched_by_another_engine_byte_exact(daemon, controllers, allocator):
    extra = sglang_engine.extra_config(daemon.config["socket"], allocator, retry_s=RETRY_S)
    writer = controllers(extra)
    source = writer.host.alloc(len(TOKENS))
    fill(writer.host, 11)
    assert writer.backup(TOKENS, source) == len(TOKENS)
    reader = controllers(extra)  # a replica: its own host pool and backend
    found, loaded, into = reader.prefetch("r1", TOKENS + [1, 2, 3])
    assert (found, loaded) == (len(TOKENS), len(TOKENS))
    assert _pages(reader.host, into) == _pages(writer.host, source)
    assert reader.prefetch("r2", [9] * 48)[:2] == (0, 0)  # another prefix: no hit


def test_a_daemon_killed_under_the_controller_is_misses_and_its_threads_live_on(controllers):
    daemon = launch.spawn(DAEMON)
    socket = daemon.config["socket"]
    extra = sglang_engine.extra_config(socket, "shm", retry_s=RETRY_S, deadline_s=1.0, timeout_s=0.5)
    try:
        engine = controllers(extra)
        source = engine.host.alloc(len(TOKENS))
        fill(engine.host, 12)
        assert engine.backup(TOKENS, source) == len(TOKENS)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        assert engine.prefetch("r1", TOKENS)[:2] == (0, 0)
        assert engine.backup(TOKENS[:16], source[:16]) == 0  # the write-through fails; SGLang goes on
        assert engine.threads_alive()
        restarted = launch.spawn({**DAEMON, "socket": socket})
        try:
            time.sleep(2 * RETRY_S)
            assert engine.backup(TOKENS, source) == len(TOKENS)  # registered again with the new daemon
            found, loaded, into = engine.prefetch("r2", TOKENS)
            assert (found, loaded) == (len(TOKENS), len(TOKENS))
            assert _pages(engine.host, into) == _pages(engine.host, source)
        finally:
            restarted.cleanup()
    finally:
        daemon.cleanup()
