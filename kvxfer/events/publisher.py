"""The KV events on a ZeroMQ PUB socket in vLLM's format, with vLLM's replay socket convention.

Like vLLM's ``ZmqEventPublisher``: each message is (topic, sequence as 8 big-endian bytes,
msgpack ``KVEventBatch``), the sequence numbering batches from 0; a ROUTER socket answers a
request (an empty frame, then the first sequence wanted as 8 big-endian bytes) with every
buffered batch from there, then an end marker (empty topic, sequence -1, empty payload). Where
vLLM would replay from a position it no longer holds and leave a silent gap, this publisher
first sends a batch of ``AllBlocksCleared`` (forget what you know of me), and does the same on
the PUB socket if it ever falls behind the hub's buffer itself. One thread does it all (ZeroMQ
sockets are not thread-safe); it reads the hub from its own position like any subscriber.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq
from zmq import ZMQError

from kvxfer.events.hub import EventHub
from kvxfer.events.settings import EventSettings
from kvxfer.events.vllm_wire import VllmEncoder

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqPublisher:
    """Publishes the hub's events until ``close``."""

    def __init__(self, hub: EventHub, settings: EventSettings) -> None:
        self.hub, self.settings = hub, settings
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(settings.publish)
            if settings.replay:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 1 << 20)
                self._replay.bind(settings.replay)
        except ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._topic = settings.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0
        self._seq = 0
        self._closed = threading.Event()
        self._encoder = VllmEncoder(settings.int_block_hashes)
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
                self._send(self._encoder.encode(events, now))
            except ZMQError as exc:  # a socket error: logged, and the thread goes on
                log.warning("KV event publisher", extra={"error": str(exc)})
                self._closed.wait(0.1)

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while self._buffered > self.settings.replay_bytes and len(self._buffer) > 1:
            self._buffered -= len(self._buffer.popleft()[1])
        self.hub.count("published_batches")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request (vLLM's publisher ignores these too)
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.hub.count("replays")
        if self._buffer and first < self._buffer[0][0]:  # part of what was asked is gone: say so first
            self._replay.send_multipart((client, b"", self._topic, start, self._encoder.cleared(time.time())))
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


__all__ = ["ZMQError", "ZmqPublisher"]
