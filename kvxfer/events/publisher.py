"""The KV events on a ZeroMQ PUB socket in vLLM's format, with vLLM's replay socket convention.

Like vLLM's ``ZmqEventPublisher``: each message is (topic, sequence as 8 big-endian bytes,
msgpack ``KVEventBatch``), the sequence numbering batches from 0; a ROUTER socket answers a
request (an empty frame, then the first sequence wanted as 8 big-endian bytes) with every
buffered batch from there, then an end marker (empty topic, sequence -1, empty payload). Where
vLLM would replay from a position it no longer holds and leave a silent gap, this publisher
first sends a batch of ``AllBlocksCleared`` (forget what you know of me), and does the same on
the PUB socket if it ever falls behind the hub's buffer itself. Only the events of groups anyone may
see are published (the daemon's own, and those registered with ``share_events``): a ZeroMQ
subscriber proves nothing. One thread does it all (ZeroMQ
sockets are not thread-safe); it reads the hub from its own position like any subscriber.

The replay socket answers anyone who connects (ZeroMQ has no authentication), so what it may
hold is bounded: the buffer by bytes and batches; each answer's payloads are the buffer's own
bytes (zero copy: a thousand answers do not hold a thousand copies); and at most
``replay_batches`` + 2 messages wait for one client (the socket's high-water mark, which a whole
answer always fits in): an answer to a client that does not read what it asked for is dropped
whole and counted (``replay_dropped``), never queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq
from zmq import ZMQError

from kvxfer.core.records import TierKind
from kvxfer.events.event_hub import EventHub
from kvxfer.events.settings import EventSettings
from kvxfer.events.vllm_wire import VllmEncoder

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqPublisher:
    """Publishes the hub's events until ``close``."""

    def __init__(self, hub: EventHub, settings: EventSettings,
                 placement: dict[TierKind, tuple[str, str]] | None = None) -> None:
        """``placement``: each tier's (medium, locality) as vLLM's events name them (``VllmEncoder``)."""
        self.hub, self.settings = hub, settings
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(settings.publish)
            if settings.replay:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, settings.replay_batches + 2)  # one whole answer
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue says so (EAGAIN), never grows
                self._replay.bind(settings.replay)
        except ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._topic = settings.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0
        self._seq = 0
        self._closed = threading.Event()
        self._encoder = VllmEncoder(settings.int_block_hashes, placement=placement)
        self._thread = threading.Thread(target=self._run, name="kvxfer-events-zmq", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        after = self.hub.last_sequence  # subscribers of this socket see what happens from now on
        while not self._closed.is_set():
            try:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._answer_replay()
                events, gap = self.hub.read(after, 1024)
                if not events:
                    self.hub.wait_blocking(after, 0.05)
                    continue
                if len(events) < 1024 and self.hub.linger_s:  # one batch for what comes meanwhile
                    self._closed.wait(self.hub.linger_s)
                    more, lost = self.hub.read(events[-1].sequence, 1024 - len(events))
                    if not lost:  # (else the next read sees the gap, and says so)
                        events += more
                after = events[-1].sequence
                now = time.time()
                if gap:  # behind the hub's buffer: the subscribers are told, never shown a gap
                    self.hub.count("publisher_resyncs")
                    self._send(self._encoder.cleared(now))
                public = [e for e in events if e.scope == 0]  # a private group's keys are its registrant's
                if public:
                    self._send(self._encoder.encode(public, now))
            except ZMQError as exc:  # a socket error: logged, and the thread goes on
                log.warning("KV event publisher", extra={"error": str(exc)})
                self._closed.wait(0.1)

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while (self._buffered > self.settings.replay_bytes or len(self._buffer) > self.settings.replay_batches) \
                and len(self._buffer) > 1:
            self._buffered -= len(self._buffer.popleft()[1])
        self.hub.count("published_batches")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request (vLLM's publisher ignores these too)
        client, _, start = frames
        first = int.from_bytes(start, "big")
        answer = []
        if self._buffer and first < self._buffer[0][0]:  # part of what was asked is gone: say so first
            answer.append((self._topic, start, self._encoder.cleared(time.time())))
        answer += [(self._topic, seq.to_bytes(8, "big"), payload) for seq, payload in self._buffer if seq >= first]
        answer.append((b"", END_SEQ, b""))
        try:
            for topic, seq, payload in answer:  # (the payloads by reference: no copy a request)
                self._replay.send_multipart((client, b"", topic, seq, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # it has not read its earlier answers: this one is dropped, not queued
            self.hub.count("replay_dropped")
            return
        except ZMQError as exc:  # gone meanwhile (EHOSTUNREACH)
            log.debug("replay client gone", extra={"error": str(exc)})
            return
        self.hub.count("replays")


__all__ = ["ZMQError", "ZmqPublisher"]
