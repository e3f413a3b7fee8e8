"""Peering for one daemon: its NIXL agent, the leases it grants, the peers it reads from.

The reading side is a lower tier of each cache group (``kvxfer.tiers.peer``, made from this
object by ``kvxfer.tiers.registry``): a pull goes down to it through the group's promotion and
comes back as return values. This package is the serving side (leases, reservations, pushes) and
the links and agent both use.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.validate import shown
from kvxfer.peering.agent import Agent
from kvxfer.peering.counters import PeerCounters
from kvxfer.peering.group_access import PeeredGroup
from kvxfer.peering.leases import LeaseTable
from kvxfer.peering.link import PeerLink
from kvxfer.peering.push import Pushed, push
from kvxfer.peering.settings import PeeringSettings

RELEASES_DRAIN_S = 2.0  # at shutdown, how long the releases still queued may take to leave (all peers together)


class Peering:
    """Made once by the daemon; each cache group gets a peer tier of it (``kvxfer.tiers.peer.PeerTier``)."""

    def __init__(self, settings: PeeringSettings, groups: Callable[[], list[PeeredGroup]]) -> None:
        self.settings = settings
        self.agent = Agent(settings)
        self.counters = PeerCounters()
        self.leases = LeaseTable(self.agent, settings, groups, self.counters)
        timeout = settings.timeout_ms / 1000
        self.links = [PeerLink(settings.name, peer, self.agent, timeout, settings.tls_cert, settings.tls_key)
                      for peer in settings.peers]

    def admits(self, peer: str) -> bool:
        return self.settings.peer(peer) is not None

    def push(self, group: PeeredGroup, namespace: str, keys: list[bytes], peer: str) -> Pushed:
        """Write the blocks of ``keys`` this daemon holds into peer ``peer``'s host tier."""
        return push(self.agent, self._link(peer), self.counters, group, namespace, keys, self.settings.lease_ms)

    def _link(self, peer: str) -> PeerLink:
        link = next((link for link in self.links if link.name == peer), None)
        if link is None:
            raise InvalidArgument(f"peer {shown(peer)} is not one of peering.peers")
        return link

    def close(self) -> None:
        self.leases.close()
        until = time.monotonic() + RELEASES_DRAIN_S  # one bound for all peers' queued releases, not one each
        for link in self.links:
            link.close(until)
        self.agent.close()
