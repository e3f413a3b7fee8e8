"""The ``events`` section of the daemon's configuration."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: What ``publish`` and ``replay`` may be: a TCP address to bind (``*`` for every interface) or an IPC path.
ENDPOINT_RE = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}|ipc:///[^\0]{1,200}")


@dataclass(frozen=True)
class EventSettings:
    """The ``events`` config section."""

    replay_keys: int = 1 << 18  # keys the hub's replay buffer holds (WatchEvents resumes within it)
    replay_mib: int = 64  # ... and the most memory they take (an event holds its namespace and its keys)
    linger_ms: int = 50  # a response (a published batch) waits this long for more events: fewer, larger ones
    max_subscribers: int = 256  # WatchEvents streams open at once; beyond: RESOURCE_EXHAUSTED
    publish: str = ""  # a ZeroMQ PUB endpoint to bind ("tcp://*:5557", "ipc:///run/kvxfer/events"); "": none
    replay: str = ""  # a ROUTER endpoint for vLLM's replay requests; "": none
    topic: str = ""
    replay_bytes: int = 64 << 20  # payload bytes of past batches the ROUTER can replay (publish_replay_mib)
    replay_batches: int = 4096  # past batches it can replay; also the most messages queued for one replay client
    hwm: int = 100_000  # the PUB socket's high-water mark (messages queued for a slow subscriber)
    int_block_hashes: bool = False  # block hashes as vLLM's 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


__all__ = ["ENDPOINT_RE", "EventSettings"]
