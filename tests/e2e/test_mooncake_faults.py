"""The Mooncake Store tier when its cluster fails, through real daemons and a real ``mooncake_master``: a master
stopped, stalled or restarted, a node gone with the segment that held blocks, a store full. Calls stay bounded,
the tier says it is degraded and comes back by itself, nothing wrong is served, and the daemon serves on from
its other tiers; what Mooncake evicted is a miss and is announced removed."""

import time

import pytest

from kvxfer import Client
from kvxfer.bench.mooncake_master import MooncakeMaster
from kvxfer.core.errors import DeadlineExceeded
from kvxfer.core.records import Outcome, TierKind
from kvxfer.events.event_records import EventKind, Reason
from tests.e2e.mooncake_node import KEYS, events, master, needs_mooncake, node, tiers, until  # noqa: F401
from tests.e2e.test_remote import offload, restore

pytestmark = [pytest.mark.e2e, needs_mooncake]


def test_a_stopped_master_is_a_miss_within_the_deadline_and_a_restarted_one_serves_again(master, tmp_path):
    daemon = node(master, tmp_path)
    try:
        offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        master.stop()
        start = time.monotonic()
        assert tiers(daemon, KEYS[:8]) == [None] * 8  # asked, not answered: misses
        assert restore(daemon, KEYS[:8])[0] == [Outcome.NOT_FOUND] * 8  # (none is there as far as anyone knows)
        offload(daemon, KEYS[40:48])  # the host tier takes them; its evictions are dropped, counted
        assert time.monotonic() - start < 60  # (a hang guard: each call within 1 s)
        assert daemon.health() == 1 and events(daemon)["degraded"]
        master.start()  # holds nothing: its metadata lived in its memory
        until(lambda: not events(daemon)["degraded"], "back after the restart", seconds=60)
        until(lambda: tiers(daemon, KEYS[:1]) == [None], "the old blocks are misses, never errors")
        shadow: dict = {}
        rounds = iter(range(60))

        def demoted_again() -> bool:  # (the client mounts its segment at the new master within about a second;
            round_ = next(rounds)  # puts meanwhile find no space)
            keys = [b"after%02d-%02d" % (round_, i) for i in range(40)]
            shadow.update(offload(daemon, keys))
            time.sleep(0.5)
            return tiers(daemon, keys[:1]) == [TierKind.MOONCAKE]

        until(demoted_again, "demoted to the new master", seconds=60)
        first = min(k for k in shadow if tiers(daemon, [k]) == [TierKind.MOONCAKE])
        outcomes, blocks = restore(daemon, [first])
        assert outcomes == [Outcome.DONE] and blocks[0].equal(shadow[first])
    finally:
        daemon.cleanup()


def test_a_stalled_master_holds_no_call_past_its_deadline_and_the_tier_is_back_soon_after(master, tmp_path):
    daemon = node(master, tmp_path)
    try:
        shadow = offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        master.pause()
        try:
            start = time.monotonic()
            tiers(daemon, KEYS[:8])  # whatever the client still knows, answered within the deadline
            restore(daemon, KEYS[8:16])
            offload(daemon, [b"during%d" % i for i in range(8)])
            assert time.monotonic() - start < 60  # (a hang guard: each call within 1 s)
            assert daemon.health() == 1
        finally:
            master.resume()
        until(lambda: tiers(daemon, KEYS[:8]) == [TierKind.MOONCAKE] * 8, "served again after the stall", seconds=60)
        outcomes, blocks = restore(daemon, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
    finally:
        daemon.cleanup()


def test_a_node_gone_with_its_segment_costs_misses_never_a_wrong_byte_or_a_hang(tmp_path):
    """A lends the memory B's blocks went to; A is killed: B's restores of them fail or miss within their
    deadline, and once the master has dropped A's segment (its client TTL) they are plain misses."""
    cluster = MooncakeMaster("--client_ttl=2")
    a = node(cluster, tmp_path, "gone:")
    b = node(cluster, tmp_path, "gone:", segment_mib=0)  # lends nothing: its blocks land in A's segment
    try:
        offload(b, KEYS[:40])
        until(lambda: events(b).get("stored", 0) >= 8, "b demoted into a's segment")
        a.stop(9)
        start = time.monotonic()
        outcomes, _ = restore(b, KEYS[:8])
        assert set(outcomes) <= {Outcome.FAILED, Outcome.NOT_FOUND} and time.monotonic() - start < 60
        assert b.health() == 1
        until(lambda: tiers(b, KEYS[:8]) == [None] * 8, "the master dropped a's segment", seconds=60)
        assert restore(b, KEYS[:8])[0] == [Outcome.NOT_FOUND] * 8
    finally:
        a.cleanup()
        b.cleanup()
        cluster.close()


def test_blocks_a_full_store_evicted_are_misses_and_are_announced_removed(tmp_path):
    """The cluster's only memory is the daemon's 16 MiB segment (about 1,000 blocks); waves of 400 go down until
    Mooncake has evicted some that it held. It evicts on its own, and never a block under a read lease: every
    existence check grants one (the audit's and a Lookup's), 10 s by default, so this master's lease is 0.3 s,
    under the audit's period. Those it evicted are misses (never errors), and the audit announces them removed."""
    short_leases = MooncakeMaster("--default_kv_lease_ttl=300")
    daemon = node(short_leases, tmp_path, segment_mib=16, audit_s=1)
    try:
        keys = [b"full%05d" % i for i in range(6000)]
        sent, ever_held, evicted = 32, set(), set()  # the first 32 stay in the host tier
        offload(daemon, keys[:32])
        deadline = time.monotonic() + 240
        while not evicted:
            assert time.monotonic() < deadline and sent + 400 <= len(keys), "Mooncake evicted none of its blocks"
            offload(daemon, keys[sent:sent + 400])
            sent += 400
            down = sent - 32  # demoted, or failed to be
            until(lambda: sum(events(daemon).get(e, 0) for e in ("stored", "stores_no_space", "stores_dropped",
                                                                 "stores_unconfirmed")) >= down,
                  "demotions settled", seconds=120)
            held = tiers(daemon, keys[:down])
            assert set(held) <= {TierKind.MOONCAKE, None}
            now = {k for k, t in zip(keys, held) if t is TierKind.MOONCAKE}
            evicted = ever_held - now
            ever_held |= now
            time.sleep(1.0)  # (the master evicts in the background)
        outcomes, _ = restore(daemon, sorted(evicted)[:8])
        assert outcomes == [Outcome.NOT_FOUND] * len(sorted(evicted)[:8])
        removed: set[bytes] = set()
        with Client(daemon.target) as client:
            try:
                for batch in client.watch_events(["default"], from_sequence=1, timeout=60):
                    for e in batch.events:
                        if e.tier is TierKind.MOONCAKE and e.kind is EventKind.REMOVED:
                            assert e.reason is Reason.EXPIRED
                            removed |= set(e.keys)
                    if evicted <= removed:
                        break
            except DeadlineExceeded:
                pass  # (60 s: the audit asks every second)
        assert evicted <= removed, len(evicted - removed)
        still = {k for k, t in zip(keys, tiers(daemon, keys[:sent - 32])) if t is TierKind.MOONCAKE}
        assert not removed & still  # (held: never announced removed)
    finally:
        daemon.cleanup()
        short_leases.close()


def test_a_slow_network_to_the_master_holds_no_call_past_its_deadline(master, tmp_path):
    """Every byte to and from the master held 3 s (its timeout is 1 s), then the network is quick again."""
    from tests.e2e.slow_proxy import SlowProxy

    proxy = SlowProxy(("127.0.0.1", master.rpc_port))
    daemon = node(master, tmp_path, master=f"127.0.0.1:{proxy.port}")
    try:
        shadow = offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        proxy.delay_s = 3.0
        start = time.monotonic()
        tiers(daemon, KEYS[:8])
        restore(daemon, KEYS[8:16])
        offload(daemon, [b"slow%d" % i for i in range(8)])  # the host path goes on
        assert time.monotonic() - start < 60 and daemon.health() == 1  # (a hang guard: each call within 1 s)
        proxy.delay_s = 0.0
        until(lambda: tiers(daemon, KEYS[:8]) == [TierKind.MOONCAKE] * 8, "served again", seconds=60)
        outcomes, blocks = restore(daemon, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
    finally:
        daemon.cleanup()
        proxy.close()


def test_a_master_down_at_start_leaves_the_daemon_serving_and_the_tier_joins_once_it_answers(master, tmp_path):
    """Mooncake's setup against a master that does not answer retries for tens of seconds holding the GIL: the
    daemon must not call it then. It answers health, serves its host tier, says the tier is degraded, stops on
    SIGTERM at once, and joins by itself when the master comes up (no restart)."""
    master.stop()
    daemon = node(master, tmp_path)  # (spawn waits until health says SERVING)
    try:
        until(lambda: events(daemon)["degraded"], "the tier says it is degraded", seconds=30)
        shadow = offload(daemon, KEYS[:8])  # the host tier serves meanwhile
        outcomes, blocks = restore(daemon, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
        assert tiers(daemon, [b"never"]) == [None]
        master.start()
        until(lambda: not events(daemon)["degraded"], "joined once the master answers", seconds=60)
        shadow.update(offload(daemon, KEYS[8:48]))
        until(lambda: tiers(daemon, KEYS[:8]) == [TierKind.MOONCAKE] * 8, "demoted to the cluster it joined late")
        master.stop()  # and a daemon whose master is gone again stops at once on SIGTERM
        start = time.monotonic()
        assert daemon.stop(timeout=60) == 0
        assert time.monotonic() - start < 30  # (a hang guard: it ignored SIGTERM for 30 s while setup held the GIL)
    finally:
        daemon.cleanup()


def test_a_daemon_whose_master_never_answers_stops_on_sigterm(tmp_path):
    """No master at all (a port nothing listens on): health answers and SIGTERM ends the daemon."""
    cluster = MooncakeMaster()
    cluster.stop()
    daemon = node(cluster, tmp_path)
    try:
        until(lambda: events(daemon)["degraded"], "degraded", seconds=30)
        assert daemon.health() == 1
        start = time.monotonic()
        assert daemon.stop(timeout=60) == 0
        assert time.monotonic() - start < 30  # (a hang guard, as above)
    finally:
        daemon.cleanup()
        cluster.close()


def test_a_master_stopped_at_start_still_takes_connections_and_leaves_the_daemon_serving(master, tmp_path):
    """A SIGSTOPped master's ports take connections (the kernel's backlog) but answer nothing: the join waits for
    its HTTP metadata server to answer, and the daemon serves meanwhile."""
    master.pause()
    daemons = []
    try:
        daemons.append(daemon := node(master, tmp_path))
        until(lambda: events(daemon)["degraded"], "degraded", seconds=30)
        assert daemon.health() == 1
        master.resume()
        until(lambda: not events(daemon)["degraded"], "joined once the master answers", seconds=60)
        start = time.monotonic()
        assert daemon.stop(timeout=60) == 0 and time.monotonic() - start < 30  # (a hang guard)
    finally:
        master.resume()
        for daemon in daemons:
            daemon.cleanup()
