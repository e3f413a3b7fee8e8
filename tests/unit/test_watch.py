"""WatchEvents' generator on its own: a position from another daemon's stream is a resync whatever its number,
and a quiet watch hears where the stream stands every ``idle_s`` of the daemon's clock, also while other
namespaces are busy, and subscribers send at phases spread over the linger period (a virtual clock: no
wall-clock figure is asserted)."""

import asyncio

import pytest

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import TierKind
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import EventKind, TierEvent
from kvxfer.v1 import kvxfer_pb2 as pb
from service.watch import Encoded, watch


def first_responses(hub, request, n=1):
    async def run():
        hub.attach(asyncio.get_running_loop())
        stream = watch(hub, Encoded(), request, frozenset({0}), linger=0)
        try:
            return [pb.WatchEventsResponse.FromString(await anext(stream)) for _ in range(n)]
        finally:
            await stream.aclose()
    return asyncio.run(run())


def test_a_position_in_another_stream_is_a_resync_whatever_its_number():
    hub = EventHub()
    for i in range(3):
        hub.emit(EventKind.STORED, TierKind.HOST, "g", "m", [b"k%d" % i])
    # The old daemon's stream had reached 1260; this one is at 3: told to resync, never INVALID_ARGUMENT.
    (first,) = first_responses(hub, pb.WatchEventsRequest(namespaces=["m"], from_sequence=1260, stream_id="old"))
    assert first.resync and first.stream_id == hub.stream_id and first.next_sequence == 4
    # A position past the end of this very stream is still refused.
    for stream_id in ("", hub.stream_id):
        with pytest.raises(InvalidArgument, match="past the next event"):
            first_responses(hub, pb.WatchEventsRequest(namespaces=["m"], from_sequence=1260, stream_id=stream_id))


class ScriptedHub:
    """A hub whose events of another namespace arrive every ``every`` seconds of a virtual clock; ``wait``
    advances the clock to the next event or by its timeout, whichever comes first."""

    def __init__(self, every: float) -> None:
        self.now, self.every = 0.0, every
        self.stream_id, self.subscribers, self.max_subscribers, self.closed = "s", 0, 1, False
        self.joined = 0  # the ordinal the next subscriber gets

    def clock(self) -> float:
        return self.now

    @property
    def last_sequence(self) -> int:
        return int((self.now + 1e-9) // self.every)  # (an event due at now has arrived)

    def read(self, after: int, limit: int):
        return [TierEvent(s, 0.0, EventKind.STORED, TierKind.HOST, "g", "busy", (b"k",))
                for s in range(after + 1, min(self.last_sequence, after + limit) + 1)], False

    async def wait(self, after: int, timeout: float) -> None:
        self.now = min(self.now + timeout, (after + 1) * self.every)


@pytest.mark.parametrize("every", [0.7, 4.0, 6.0])
def test_a_quiet_watch_hears_its_position_every_idle_period_of_the_clock(every):
    hub = ScriptedHub(every)

    async def run():
        stream = watch(hub, Encoded(), pb.WatchEventsRequest(namespaces=["quiet"]), frozenset({0}), linger=0,
                       idle_s=5.0, clock=hub.clock)
        times = []
        try:
            for _ in range(6):
                response = pb.WatchEventsResponse.FromString(await anext(stream))
                assert not response.events and response.next_sequence == hub.last_sequence + 1
                times.append(hub.now)
        finally:
            await stream.aclose()
        return times

    times = asyncio.run(run())
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert all(gap <= 5.0 for gap in gaps), gaps  # (the old timer restarted on each event: up to 9 s apart)


def test_subscribers_send_at_phases_spread_over_the_linger_period():
    """A hundred subscribers woken by the same events must not all send in one instant: that burst held the
    event loop and tripled an offload's p99 (``bench events``). Each sends once a period, at its own phase,
    and no event waits longer than ``linger`` for its response."""
    linger, every = 0.05, 0.003
    phases = []
    for ordinal in range(100):
        hub = ScriptedHub(every)
        hub.joined = ordinal

        async def sleep(seconds):
            assert 0 <= seconds < linger
            hub.now += seconds

        async def run():
            stream = watch(hub, Encoded(), pb.WatchEventsRequest(namespaces=["busy"]), frozenset({0}),
                           linger=linger, clock=hub.clock, sleep=sleep)
            sent = []
            try:
                for _ in range(4):
                    response = pb.WatchEventsResponse.FromString(await anext(stream))
                    oldest = response.events[0].sequence * every  # when its first event arrived
                    assert hub.now - oldest <= linger + 1e-9
                    sent.append(hub.now)
            finally:
                await stream.aclose()
            return sent

        sent = asyncio.run(run())
        assert all(abs((b - a) - linger) < 1e-6 for a, b in zip(sent[1:], sent[2:]))  # once a period
        phases.append(sent[-1] % linger)
    assert hub.joined == 100
    phases.sort()
    gaps = [b - a for a, b in zip(phases, phases[1:] + [phases[0] + linger])]
    assert max(gaps) < linger / 25, gaps  # (the old watch: every subscriber at the same instant)
