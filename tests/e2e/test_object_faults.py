"""The object tier when its server stalls, slows, refuses or dies, through real daemons against a real S3 server
(SeaweedFS): misses within the deadline, one outage counted once, back soon after the server answers, and a start
the bucket would refuse refused in one line that names its cause."""

import os
import subprocess
import sys
import threading
import time

import pytest
import yaml

from kvxfer.bench import launch
from kvxfer.bench.s3_server import S3Server
from kvxfer.core.records import Outcome, TierKind
from tests.conftest import ROOT
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.object_node import KEYS, events, node, s3, tiers, until  # noqa: F401 (s3: a fixture)
from tests.e2e.test_remote import offload, restore

pytestmark = pytest.mark.e2e


def test_a_stalled_server_is_a_miss_within_the_deadline_and_the_host_path_goes_on(s3, tmp_path):
    daemon = node(s3, tmp_path, "stalled")
    try:
        offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        s3.pause()
        try:
            start = time.monotonic()
            assert tiers(daemon, KEYS[:8]) == [None] * 8  # asked, not answered: misses
            assert time.monotonic() - start < 15  # (a hang guard: the deadline is 1 s)
            assert daemon.health() == 1  # SERVING
            offload(daemon, [b"during%d" % i for i in range(8)])  # the host tier takes them meanwhile
            assert events(daemon)["degraded"]
        finally:
            s3.resume()
        until(lambda: tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8, "served again after the backoff")
    finally:
        daemon.cleanup()


def test_one_short_stall_with_calls_in_flight_is_one_outage_and_the_tier_is_back_soon_after(s3, tmp_path):
    """SIGSTOP the server for 3 s while a daemon has stores and restores in flight: each concurrent failed call
    doubled the backoff, and the tier stayed degraded for 27-28 s after the server answered again. Now one outage
    counts once and a probe asks the server every 0.5 s while it is down: back within about a second."""
    daemon = node(s3, tmp_path, "stall")
    try:
        offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        stop = threading.Event()

        def traffic(who: int) -> None:  # stores going down and restores asking while the server is stopped
            i = 0
            while not stop.is_set():
                offload(daemon, [b"stall-%d-%d-%d" % (who, i, j) for j in range(8)])
                tiers(daemon, KEYS[:8])
                i += 1

        threads = [threading.Thread(target=traffic, args=(who,)) for who in range(3)]
        s3.pause()
        for t in threads:
            t.start()
        try:
            time.sleep(3.0)
            assert events(daemon)["degraded"]
        finally:
            s3.resume()
        answered = time.monotonic()
        until(lambda: not events(daemon)["degraded"], "back after the stall", seconds=20)
        back_s = time.monotonic() - answered
        stop.set()
        for t in threads:
            t.join(60)
        assert back_s < 10.0, back_s  # (before: 27-28 s; a probe every 0.5 s, and a busy machine's room)
        assert tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "no server", "stalled server"])
def test_a_start_the_bucket_would_refuse_is_refused_in_one_line(s3, tmp_path, case):
    """Each refusal names its own cause: a refused connection (in milliseconds) is not a server that did not
    answer, nor are refused credentials."""
    extra = {"missing bucket": {"url": "s3://no-such-bucket/p"}, "no server": {"endpoint": "http://127.0.0.1:1"},
             "wrong credentials": {}, "stalled server": {}}[case]
    env = {**s3.env, "AWS_SECRET_ACCESS_KEY": "wrong"} if case == "wrong credentials" else s3.env
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-at-least-16-bytes\n")
    section = {"url": f"s3://{s3.bucket}/p", "endpoint": s3.endpoint, "allow_http": True, "timeout_ms": 1000,
               **extra}
    if case == "stalled server":
        s3.pause()
    try:
        daemon = launch.spawn({"pools": [SMALL_POOL], "object": section}, wait=False, env=env)
        config = tmp_path / "check.yaml"
        config.write_text(yaml.safe_dump({"pools": [SMALL_POOL], "object": section}))
        check = subprocess.run([sys.executable, "-m", "service.program", "serve", "--check", "--config", str(config)],
                               env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert daemon.proc.wait(60) != 0
    finally:
        s3.resume()
    why = {"missing bucket": "does not exist", "wrong credentials": "credentials were refused",
           "no server": "refused the connection", "stalled server": "did not answer within 1 s"}[case]
    try:
        log = daemon.log_text()
        assert "object" in log and "Traceback" not in log and why in log
        assert check.returncode != 0 and why in check.stderr + check.stdout  # serve --check says it too
        assert "Traceback" not in check.stderr
    finally:
        daemon.cleanup()


def test_a_slow_server_behind_a_proxy_is_a_miss_within_the_deadline_and_then_serves_again(s3, tmp_path):
    from tests.e2e.slow_proxy import SlowProxy

    proxy = SlowProxy(("127.0.0.1", s3.ports["s3"]))
    daemon = node(s3, tmp_path, "slow", endpoint=proxy.url)
    try:
        offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        proxy.delay_s = 3.0  # every byte held longer than timeout_ms
        start = time.monotonic()
        assert tiers(daemon, KEYS[:8]) == [None] * 8
        assert time.monotonic() - start < 15  # (a hang guard: the deadline is 1 s)
        assert daemon.health() == 1
        offload(daemon, [b"slow%d" % i for i in range(8)])  # the host path goes on
        assert events(daemon)["degraded"]
        proxy.delay_s = 0.0
        until(lambda: tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8, "served again after the backoff")
    finally:
        daemon.cleanup()
        proxy.close()


def test_a_killed_server_restarted_serves_what_it_held_and_nothing_waited_meanwhile(tmp_path):
    server = S3Server()
    daemon = node(server, tmp_path, "killed")
    try:
        shadow = offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        server.stop()
        start = time.monotonic()
        assert tiers(daemon, KEYS[:8]) == [None] * 8  # refused: a miss at once
        offload(daemon, KEYS[40:48])  # evictions meanwhile: dropped and counted, never waited for
        assert time.monotonic() - start < 30  # (a hang guard)
        until(lambda: events(daemon).get("stores_dropped", 0) > 0, "drops counted")
        server.start()
        until(lambda: tiers(daemon, KEYS[:8]) == [TierKind.OBJECT] * 8, "the restarted server's objects")
        outcomes, blocks = restore(daemon, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
    finally:
        daemon.cleanup()
        server.close()


def test_stores_a_stall_left_unanswered_are_not_counted_dropped_when_they_may_land(s3, tmp_path):
    """Write-through puts sent into a stopped server time out, and the server stores them when it runs again:
    they count ``stores_unconfirmed``; ``stores_dropped`` counts only blocks that surely never landed."""
    daemon = node(s3, tmp_path, "unconfirmed", write_through=True)
    other = node(s3, tmp_path, "unconfirmed")
    try:
        offload(daemon, KEYS[:8])
        until(lambda: events(daemon).get("stored", 0) >= 8, "stored")
        s3.pause()
        try:
            offload(daemon, KEYS[8:24])  # sent into the stall, or dropped behind the open breaker
            until(lambda: events(daemon)["degraded"], "degraded")
            time.sleep(2.0)
        finally:
            s3.resume()
        until(lambda: not events(daemon)["degraded"], "back after the stall")
        time.sleep(1.0)  # (what the server took in before it stopped, it stores now)
        landed = sum(t is TierKind.OBJECT for t in tiers(other, KEYS[8:24]))
        counted = events(daemon)
        assert counted.get("stores_dropped", 0) + landed <= 16, (counted, landed)
        assert counted.get("stores_dropped", 0) + counted.get("stores_unconfirmed", 0) + counted.get("stored", 0) \
            >= 24 - counted.get("already_present", 0)
    finally:
        daemon.cleanup()
        other.cleanup()
