"""The composition root: the daemon's parts, built in one place and handed each only what it uses.

The registry keeps pools and their lifecycles (``kvxfer.serving.pool_registry``). Beside it: the KV event
hub every group's tiers announce to; peering (the NIXL agent, links, leases), which the registry's
groups reach only as a lower tier (``kvxfer.tiers.peer``) and as the reservations peers' pushes hold;
and what hints need beside the pools (``Hints``). ``service/server.py`` builds the daemon from them;
``close`` releases them in the one order that is safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvxfer.core.envelope import EnvelopeCounts
from kvxfer.events.event_hub import EventHub
from kvxfer.peering.hub import Peering
from kvxfer.serving.pool_manager import TransferObserver
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.serving.prefetch import HintSettings, Prefetcher
from service.config import Config


@dataclass
class Hints:
    """What the Hint RPC and routers' envelopes use beside the pools."""

    settings: HintSettings
    prefetcher: Prefetcher  # PREFETCH hints, every group's, at the lowest priority
    kv_events: EventHub | None = None  # where an envelope's actions are announced (HINTED events)
    envelopes: EnvelopeCounts = field(default_factory=EnvelopeCounts)  # routers' envelopes: actions by outcome
    # Hints run one at a time: a storm of them takes one thread's share of the GIL, not every worker's.
    gate: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, settings: HintSettings, kv_events: EventHub | None = None) -> Hints:
        return cls(settings, Prefetcher(settings), kv_events)


@dataclass
class Parts:
    """The daemon's parts, each built once."""

    kv_events: EventHub
    peering: Peering | None
    registry: PoolRegistry
    hints: Hints

    def drain(self, timeout: float) -> None:
        """Stop prefetching, let every pool's queued jobs finish (up to ``timeout``) and write the host tiers down.
        Blocks: call it from a worker thread."""
        self.hints.prefetcher.stop()  # its promotions read the groups the registry closes
        self.registry.close(timeout)

    def close(self) -> None:
        """Release everything (after ``drain``, or on a failed start)."""
        self.hints.prefetcher.stop()
        if self.peering is not None:
            self.peering.leases.close()  # before the groups whose slots they pin
        self.registry.close()
        if self.peering is not None:
            self.peering.close()


def build(config: Config, observer: TransferObserver | None = None) -> Parts:
    """The daemon's parts for ``config`` (no pool yet: the daemon creates its own once it listens)."""
    events = config.events
    kv_events = EventHub(events.replay_keys, events.linger_ms / 1000, events.max_subscribers, events.replay_mib << 20)
    registry: PoolRegistry | None = None
    # Peering serves the groups peers may reach; the registry that holds them is built next, with peering as
    # one of its groups' lower tiers: the one cycle, closed here by a name looked up when peering asks.
    peering = Peering(config.peering, lambda: registry.peer_groups()) if config.peering else None
    registry = PoolRegistry(config.limits, observer, kv_events, {**config.tiers, "peering": peering},
                            config.admission, config.tenants, peering.leases if peering is not None else None,
                            config.hints.share)
    return Parts(kv_events, peering, registry, Hints.of(config.hints, kv_events))
