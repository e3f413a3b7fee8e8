"""Prefixes evicted from a real engine come back from kvxfer, and the engine generates exactly the tokens
(and logprobs, bit for bit) it generates without kvxfer."""

from __future__ import annotations

import itertools
import signal

from tests.engine.conftest import (BLOCK_SIZE, CONTROL, PROMPT, RESTORED, evict, expected, restored_blocks,
                                   tier_events, tokens)
from tests.helpers import until


def test_evicted_prefix_restored_from_host_tier(make_daemon, make_engine, baseline):
    daemon = make_daemon()
    engine = make_engine(daemon.socket)
    first = engine.generate(PROMPT)
    assert first.cached == 0 and first.same_as(baseline["prompt"])
    evict(engine)
    before = restored_blocks(daemon)
    again = engine.generate(PROMPT)
    assert again.cached == RESTORED  # every whole block, and none of it from the engine's own cache:
    assert restored_blocks(daemon) - before == RESTORED // 32
    assert again.same_as(expected(baseline, again))
    control = engine.generate(CONTROL)
    assert control.cached == 0 and control.same_as(baseline["control"])
    assert not control.same_as(again)


def test_restored_from_disk_when_host_tier_is_too_small(make_daemon, make_engine, baseline, tmp_path):
    # A host tier of 1 MiB holds 32 blocks of 32 KiB: the fillers' push the prompt's 18 down to disk.
    # No prefetch: the load itself reads every block from disk (a prefetch racing it would bring some up first).
    daemon = make_daemon(registered_host_capacity_mib=1, disk={"path": str(tmp_path / "disk"), "capacity_mib": 64})
    engine = make_engine(daemon.socket, prefetch=False)
    engine.generate(PROMPT)
    evict(engine)
    # (the host tier evicts its oldest first: the prompt's 18 blocks go down before any filler's)
    until(lambda: tier_events(daemon).get("demoted", 0) >= 18, "the prompt went down to disk", 120)
    before = tier_events(daemon)
    again = engine.generate(PROMPT)
    after = tier_events(daemon)
    assert again.cached == RESTORED and again.same_as(expected(baseline, again))
    assert after.get("promoted", 0) - before.get("promoted", 0) == RESTORED // 32


def test_a_restarted_engine_gets_its_predecessors_blocks(make_daemon, make_engine, baseline):
    daemon = make_daemon()
    first = make_engine(daemon.socket)
    first.generate(PROMPT)
    first.close()
    second = make_engine(daemon.socket)
    again = second.generate(PROMPT)
    assert again.cached == RESTORED and again.same_as(expected(baseline, again))


def test_a_restarted_daemon_serves_from_its_disk_tier(make_daemon, make_engine, baseline, tmp_path):
    config = {"socket": str(tmp_path / "d.sock"), "disk": {"path": str(tmp_path / "disk"), "capacity_mib": 64},
              "registered_host_capacity_mib": 1}
    daemon = make_daemon(**config)
    engine = make_engine(daemon.socket)
    engine.generate(PROMPT)
    evict(engine)
    # (the host tier evicts its oldest first: the prompt's 18 blocks go down before any filler's)
    until(lambda: tier_events(daemon).get("demoted", 0) >= 18, "the prompt went down to disk", 120)
    assert daemon.stop(signal.SIGTERM) == 0
    restarted = make_daemon(**config)
    # The worker registers its pool again when it next stores, the scheduler looks up again soon after:
    # other requests come meanwhile, until one of them is restored.
    probes = (tokens(100 + i, 2 * BLOCK_SIZE) for i in itertools.count())
    until(lambda: restored_again(engine, next(probes)), "the engine is served by the restarted daemon", 120)
    assert tier_events(restarted).get("found_at_start", 0) >= 18
    engine.reset_prefix_cache()
    before = restored_blocks(restarted)
    again = engine.generate(PROMPT)
    assert again.cached == RESTORED and again.same_as(expected(baseline, again))
    assert restored_blocks(restarted) - before == RESTORED // 32


def restored_again(engine, prompt: list[int]) -> bool:
    engine.generate(prompt, max_tokens=4)  # (vLLM stores a request's blocks at its next step: not with 1 token)
    engine.reset_prefix_cache()
    return engine.generate(prompt, max_tokens=1).cached > 0


def test_two_engines_share_one_daemon(make_daemon, make_engine, baseline):
    daemon = make_daemon()
    computes, restores = make_engine(daemon.socket), make_engine(daemon.socket)
    first = computes.generate(PROMPT)
    assert first.cached == 0
    second = restores.generate(PROMPT)
    assert second.cached == RESTORED and second.same_as(expected(baseline, second))
    assert first.same_as(baseline["prompt"])


def test_cache_salt_and_cache_group_isolate(make_daemon, make_engine, baseline):
    daemon = make_daemon()
    engine = make_engine(daemon.socket)
    engine.generate(PROMPT, cache_salt="tenant-a")
    engine.reset_prefix_cache()
    other_tenant = engine.generate(PROMPT, cache_salt="tenant-b")
    assert other_tenant.cached == 0 and other_tenant.same_as(baseline["prompt"])
    engine.reset_prefix_cache()
    assert engine.generate(PROMPT, cache_salt="tenant-a").cached == RESTORED
    other_group = make_engine(daemon.socket, cache_group="team-b")
    answer = other_group.generate(PROMPT, cache_salt="tenant-a")
    assert answer.cached == 0 and answer.same_as(baseline["prompt"])


def test_no_daemon_the_engine_recomputes(make_engine, baseline, tmp_path):
    engine = make_engine(str(tmp_path / "nobody.sock"))
    assert engine.generate(PROMPT).same_as(baseline["prompt"])
    engine.reset_prefix_cache()
    again = engine.generate(PROMPT)
    assert again.cached == 0 and again.same_as(baseline["prompt"])
