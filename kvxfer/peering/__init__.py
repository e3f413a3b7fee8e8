"""Daemon-to-daemon transfer: blocks another node's kvxfer holds, read with NIXL (docs/peering.md).

``settings`` (the config section), ``agent`` (this daemon's NIXL agent), ``leases`` (the
serving side), ``link`` and ``store`` (the reading side: peers as a lower tier), ``hub``
(one per daemon), ``counters`` (metrics).
"""
