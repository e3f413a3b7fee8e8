"""Who may find a cache group's blocks on the tiers other nodes read: a shared filesystem, a Mooncake Store
cluster, Redis, a bucket (the rows of ``kvxfer.tiers.registry`` marked ``shared``).

- ``SHARED``: the daemon's own groups, and groups registered with ``share_with_peers``. Every node's group of
  the same name reads them: values are named by the group's name and sealed with the tier's secret.
- ``TOKEN``: a private group registered with a ``chosen_token``. On those tiers it is named by a digest of its
  name under the token (``~`` and 32 hex digits: no group can be named so, for group names have no ``~``), and
  its values' MAC is keyed by the tier's secret and the token. Only a registrant presenting the same token, on
  any node, finds and reads them; another node's group of the same name without it asks other names, and a
  value copied under its names fails the MAC.
- ``NODE``: a private group registered without a chosen token (its token is made at random and dies with the
  registration). Its blocks stay on this node: those tiers are not its tiers at all.

Bookkeeping only: a tier is handed its settings and its group's context with the name and secret applied
(``kvxfer.tiers.registry``) and never knows which reach it serves.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass, field


class ReachKind(enum.Enum):
    SHARED = "shared"  # any node's group of the same name
    TOKEN = "token"  # the holders of the group's chosen token, on any node
    NODE = "node"  # this node alone


@dataclass(frozen=True)
class Reach:
    """A cache group's reach on the shared tiers (module docstring); ``key`` is derived from its token."""

    kind: ReachKind
    key: bytes = field(default=b"", repr=False)

    @classmethod
    def of_token(cls, group: str, token: bytes) -> Reach:
        """The reach of a private group registered with ``token`` (its ``chosen_token``)."""
        key = hmac.new(token, b"kvxfer private group\0" + group.encode(), hashlib.sha256).digest()
        return cls(ReachKind.TOKEN, key)

    def name(self, group: str) -> str:
        """What the shared tiers call the group (its own name unless it is a token's)."""
        if self.kind is not ReachKind.TOKEN:
            return group
        return "~" + hmac.new(self.key, b"name", hashlib.sha256).hexdigest()[:32]

    def secret(self, tier_secret: bytes) -> bytes:
        """The key of the group's values' MAC on a tier whose own secret is ``tier_secret`` (a token's group is
        sealed even on a tier configured without one)."""
        if self.kind is not ReachKind.TOKEN:
            return tier_secret
        return hmac.new(self.key, b"mac\0" + tier_secret, hashlib.sha256).digest()


SHARED = Reach(ReachKind.SHARED)
NODE = Reach(ReachKind.NODE)
