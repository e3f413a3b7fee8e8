"""What a join to a Mooncake Store cluster would find, asked before the store's client is called.

Mooncake's ``setup`` retries an unreachable master for tens of seconds while holding the GIL: the
daemon's event loop, its workers and its SIGTERM handler all wait behind it. So the client is
called only once these cheap questions pass (``MooncakeClient`` asks them before every join,
``kvxfer serve --check`` before a start): the master's RPC port takes a TCP connection and an HTTP
metadata server answers a request within a second (a stopped master's ports still take
connections: its HTTP server answers nothing). (An RDMA transport without its devices on this node
is refused with the section: ``settings.missing_devices``.)
A master whose RPC port takes connections but answers nothing, behind etcd or P2PHANDSHAKE
metadata, is not told apart here. Each answer
is one line naming the setting.
"""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlsplit

from kvxfer.tiers.mooncake.settings import MooncakeSettings

CONNECT_S = 1.0  # a listening master answers a connection on loopback or a LAN well within this


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _answers(host: str, port: int, timeout: float) -> str | None:
    """None if ``host:port`` takes a TCP connection within ``timeout``; else why not, in a few words."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def unreachable(settings: MooncakeSettings, timeout: float = CONNECT_S) -> str | None:
    """Why a join would fail now (the master or the metadata server not answering), or None."""
    why = _answers(*_split(settings.master), timeout)
    if why is not None:
        return f"mooncake.master: {settings.master} does not answer ({why})"
    if settings.metadata != "P2PHANDSHAKE":
        why = _http_answers(settings.metadata, timeout)
        if why is not None:
            return f"mooncake.metadata: {settings.metadata} does not answer ({why})"
    return None


def _http_answers(address: str, timeout: float) -> str | None:
    """None if the metadata server answers an HTTP request within ``timeout`` (any status: it is alive); a master
    that is stopped (SIGSTOP) or stalled still takes connections, but answers nothing."""
    url = urlsplit(address)
    port = url.port or (443 if url.scheme == "https" else 80)
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    connection = kind(url.hostname or "", port, timeout=timeout)
    try:
        connection.request("GET", url.path or "/")
        connection.getresponse().read(0)
        return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except (OSError, http.client.HTTPException) as exc:
        return getattr(exc, "strerror", None) or type(exc).__name__
    finally:
        connection.close()
