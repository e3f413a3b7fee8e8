"""A real engine under a failing daemon: killed mid-request, a corrupt block on disk, a daemon too slow for
its deadlines. The engine never hangs and never emits a wrong token: what kvxfer cannot return it recomputes."""

from __future__ import annotations

import signal

from tests.engine.conftest import PROMPT, RESTORED, evict, expected, tier_events
from tests.helpers import stop_process, until


def test_daemon_killed_mid_request(make_daemon, make_engine, baseline):
    daemon = make_daemon()
    engine = make_engine(daemon.socket)
    engine.generate(PROMPT)
    evict(engine)
    engine.submit(PROMPT, max_tokens=96)  # a restore, then 96 steps of decoding and storing
    daemon.proc.send_signal(signal.SIGKILL)
    answer = engine.result()
    assert answer.same_as(expected(baseline, answer, "long"))
    engine.reset_prefix_cache()
    alone = engine.generate(PROMPT)
    assert alone.cached == 0 and alone.same_as(baseline["prompt"])


def test_a_corrupt_block_on_disk_is_recomputed(make_daemon, make_engine, baseline, tmp_path):
    disk = tmp_path / "disk"
    daemon = make_daemon(registered_host_capacity_mib=1, disk={"path": str(disk), "capacity_mib": 64})
    engine = make_engine(daemon.socket)
    engine.generate(PROMPT)
    evict(engine)
    until(lambda: tier_events(daemon).get("demoted", 0) >= 18, "the prompt went down to disk", 120)
    for path in sorted(disk.glob("vllm-*/*/*.kvb")):  # one byte flipped in the middle of every block's file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    again = engine.generate(PROMPT)
    assert again.cached < RESTORED and again.same_as(expected(baseline, again))
    assert tier_events(daemon).get("corrupt", 0) >= 1


def test_a_daemon_too_slow_for_its_deadline(make_daemon, make_engine, baseline):
    daemon = make_daemon()
    engine = make_engine(daemon.socket, timeout_s=0.5, deadline_s=1.0)
    engine.generate(PROMPT)
    evict(engine)
    stop_process(daemon.proc)
    try:
        slow = engine.generate(PROMPT, timeout_s=120)  # never waits on the stopped daemon past its deadlines
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert slow.same_as(expected(baseline, slow))
    engine.reset_prefix_cache()
    after = engine.generate(PROMPT)
    assert after.same_as(expected(baseline, after))
