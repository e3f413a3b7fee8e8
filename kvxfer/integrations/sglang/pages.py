"""Moving SGLang host pages to and from the daemon, and never failing SGLang.

Two pools per engine process, in one cache group (so their pages are the same blocks):

- **host**: SGLang's own host pool, when SGLang allocated it in a memfd (the extra config's
  ``"allocator": "shm"``). Its descriptor is handed to the daemon, which copies a page
  straight out of it and into it: no copy in SGLang's process.
- **staging**: a sealed memfd of ``staging_pages`` pages in the same layout, mapped here and by
  the daemon. It carries what the host pool cannot: every page when the host pool is private
  memory, host page 0 (kvxfer's null block), and SGLang's generic (non-zero-copy) interface.

Every call has a deadline; a daemon that is down, slow or restarted turns into misses
(``False``) and the link rests for ``retry_s`` (``kvxfer.integrations.sidecar_link``). A restore
starts no copy after its deadline, so pages SGLang reclaims after a failed prefetch are never
written later; a store whose deadline passed stores nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvxfer.client import Client, EngineBlocks, KeyFormat, PoolHandle, PoolLayout, create_sealed
from kvxfer.core.errors import KvxferError
from kvxfer.core.records import NULL_BLOCK, Medium, Outcome
from kvxfer.integrations.settings import daemon_token, group_token
from kvxfer.integrations.sglang.naming import HostGeometry, PageNames
from kvxfer.integrations.sidecar_link import DaemonLink, LinkDown

log = logging.getLogger("kvxfer.sglang")
T = TypeVar("T")
#: SGLang moves at most this many pages a batch (its STORAGE_BATCH_SIZE): a staging area this size
#: moves a batch of private host pages in one request.
STORAGE_BATCH = 128
#: What a store may answer for a page that is (or is being) stored.
STORED = frozenset({Outcome.DONE, Outcome.ALREADY_PRESENT})


@dataclass(frozen=True)
class Settings:
    """The backend's knobs (keys of ``--hicache-storage-backend-extra-config``), with their defaults."""

    socket: str = "/tmp/kvxfer.sock"  # the sidecar's gRPC socket; its descriptor socket is <socket>.fd
    timeout_s: float = 1.0  # deadline of lookups and registrations
    retry_s: float = 2.0  # after a failure, no call to the daemon for this long
    deadline_s: float = 5.0  # a batch of pages moves within this long, or its pages are misses
    cache_group: str = ""  # prefix of the cache group; replicas that share it share a host tier
    model_id: str = ""  # the model's identity (default: the served weights, by content for a local directory)
    tenant: str = ""  # a deployment's own namespace: equal keys of another tenant never match
    staging_pages: int = 0  # pages of the staging area; 0: 1 beside a shared host pool (host page 0), else 128
    share_events: bool = True  # routers (WatchEvents, the ZeroMQ publisher) see the pages' keys
    share_with_peers: bool = False  # other nodes' daemons may read and push this cache group's pages
    daemon_token_file: str = ""  # the daemon's own token (token_file), where it has a TCP listener (peering)
    token_file: str = ""  # the private group's token: replicas given the same file share its pages on shared tiers
    lane: bool = True  # batches and lookups over the daemon's local lane (kvxfer.client.lane_client); False: gRPC only

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"


class Staging:
    """A sealed memfd of pages in the host pool's layout, mapped here and registered with the daemon."""

    def __init__(self, geometry: HostGeometry, name: str) -> None:
        self.geometry = geometry
        nbytes = PoolLayout(geometry.spec, geometry.layout).nbytes
        self.fd = create_sealed(name, nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self.pages = torch.frombuffer(self._map, dtype=torch.uint8).view(geometry.spec.dtype).view(geometry.shape)
        self.slots = list(range(NULL_BLOCK + 1, geometry.spec.num_blocks))  # every slot but the null block
        self.lock = threading.Lock()  # one batch at a time owns the slots

    def page(self, slot: int) -> torch.Tensor:
        return page_of(self.pages, self.geometry, slot)

    def close(self) -> None:
        if self.fd >= 0:
            self.pages = None  # the mapping goes with the last view of it
            os.close(self.fd)
            self.fd = -1


def page_of(pages: torch.Tensor, geometry: HostGeometry, index: int) -> torch.Tensor:
    return pages.select(geometry.page_axis, index)


class PageMover:
    """Stores and loads pages by SGLang's keys; every answer is per page, ``False`` meaning a miss."""

    def __init__(self, names: PageNames, settings: Settings, host: torch.Tensor | None, host_fd: int | None) -> None:
        """``host``: SGLang's host buffer (any shape, its bytes in ``names.geometry``'s layout);
        ``host_fd``: its memfd when SGLang allocated it in one (zero copy), else None."""
        self.names = names
        self.settings = settings
        # A private group's pages reach the tiers other nodes read only under a chosen token (kvxfer.tiers.reach).
        self.token = group_token("hicache-storage-backend-extra-config.token_file", settings.token_file) \
            if settings.token_file else b""
        g = names.geometry
        self.host = host.view(-1).view(g.shape) if host is not None else None
        self.host_fd = host_fd
        pages = settings.staging_pages or (1 if host_fd is not None else STORAGE_BATCH)
        self.staging = Staging(g.with_pages(pages + 1), names.pool_id("staging"))
        self.link = DaemonLink(settings.target, timeout_s=settings.timeout_s, retry_s=settings.retry_s,
                               role=f"HiCache rank {names.share.tp_rank}", on_connect=self._register, engine="SGLang",
                               lane=settings.lane, token=daemon_token("hicache-storage-backend-extra-config."
                                                                      "daemon_token_file", settings.daemon_token_file))

    # -- the session -----------------------------------------------------------------
    def _register(self, client: Client) -> None:
        """Register this process's pools (on every (re)connection: a restarted daemon knows none)."""
        n = self.names
        shared = {"share_events": self.settings.share_events, "share_with_peers": self.settings.share_with_peers,
                  "chosen_token": self.token}
        if self.host_fd is not None:
            client.register_pool(n.pool_id("host"), n.geometry.spec, n.geometry.layout, PoolHandle(Medium.SHM),
                                 fd=self.host_fd, cache_group=n.cache_group, **shared)
        s = self.staging.geometry
        client.register_pool(n.pool_id("staging"), s.spec, s.layout, PoolHandle(Medium.SHM), fd=self.staging.fd,
                             cache_group=n.cache_group, **shared)

    def _guarded(self, what: str, miss: T, fn: Callable[[Client], T]) -> T:
        """``fn`` through the link; a daemon that is down or refuses answers ``miss``, never an exception."""
        try:
            return self.link.call(fn)
        except LinkDown:
            return miss
        except KvxferError as exc:  # the daemon is up and said no (full, invalid): these pages miss
            log.warning("kvxfer: %s refused: %s", what, exc)
            return miss

    # -- SGLang's questions ----------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the daemon holds."""
        if not keys:
            return 0
        return self._guarded(f"a lookup of {len(keys)} pages", 0, lambda client: client.lookup(
            keys, pool_ids=[self.names.pool_id("staging")], namespace=self.names.namespace,
            timeout=self.settings.timeout_s).hits)

    def store(self, keys: Sequence[bytes], pages: Sequence[int], parent: bytes | None = None) -> list[bool]:
        """Store host pages ``pages`` under ``keys``. ``parent``: the key before ``keys[0]`` in SGLang's hash
        chain (empty: ``keys[0]`` starts one; None: not known), announced with the pages' KV events."""
        return self._move(keys, pages, True, parent)

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bool]:
        """Load ``keys`` into host pages ``pages``; a page whose answer is False was not written, nor any
        after it (SGLang uses the loaded prefix)."""
        return self._move(keys, pages, False, None)

    def store_tensors(self, keys: Sequence[bytes], values: Sequence[torch.Tensor]) -> list[bool]:
        """Store pages given as tensors (SGLang's flat data pages)."""
        return self._staged(keys, lambda i, page: page.copy_(values[i].view(page.shape)), True, None)

    def load_tensors(self, keys: Sequence[bytes], targets: Sequence[torch.Tensor]) -> list[bool]:
        """Load ``keys`` into the tensors ``targets`` (SGLang's flat data pages)."""
        return self._staged(keys, lambda i, page: targets[i].view(page.shape).copy_(page), False, None)

    # -- the data path ---------------------------------------------------------------
    def _move(self, keys: Sequence[bytes], pages: Sequence[int], store: bool, parent: bytes | None) -> list[bool]:
        """Runs of consecutive pages by the route they take (in place, or staged: host page 0 and private
        memory), in chain order, so that each run's parent key is the one before it."""
        if self.host is None:
            raise ValueError("kvxfer: the host pool is not registered")
        direct = [self.host_fd is not None and p != NULL_BLOCK for p in pages]
        results: list[bool] = []
        start = 0
        while start < len(keys):
            end = start + 1
            while end < len(keys) and direct[end] == direct[start]:
                end += 1
            run_parent = parent if start == 0 else (keys[start - 1] if parent is not None else None)
            run_keys, run_pages = keys[start:end], pages[start:end]
            if direct[start]:
                answers = self._transfer(self.names.pool_id("host"), run_keys, run_pages, store, run_parent)
            else:
                answers = self._staged(run_keys, self._host_copy(run_pages, store), store, run_parent)
            results += answers
            if not store and not all(answers):  # SGLang uses the loaded prefix only
                break
            start = end
        return results + [False] * (len(keys) - len(results))

    def _host_copy(self, pages: Sequence[int], store: bool) -> Callable[[int, torch.Tensor], None]:
        g = self.names.geometry

        def copy(j: int, page: torch.Tensor) -> None:
            host_page = page_of(self.host, g, pages[j])
            (page.copy_(host_page) if store else host_page.copy_(page))

        return copy

    def _staged(self, keys: Sequence[bytes], copy: Callable[[int, torch.Tensor], None], store: bool,
                parent: bytes | None) -> list[bool]:
        """Through the staging area, as many pages at a time as it holds; ``copy(i, page)`` moves
        page ``i`` of the batch between SGLang and staging ``page``."""
        results: list[bool] = []
        size = len(self.staging.slots)
        with self.staging.lock:
            for start in range(0, len(keys), size):
                chunk = keys[start:start + size]
                slots = self.staging.slots[:len(chunk)]
                if store:
                    for j, slot in enumerate(slots):
                        copy(start + j, self.staging.page(slot))
                chunk_parent = parent if start == 0 or parent is None else keys[start - 1]
                answers = self._transfer(self.names.pool_id("staging"), chunk, slots, store, chunk_parent)
                if not store:
                    for j, (slot, ok) in enumerate(zip(slots, answers)):
                        if ok:
                            copy(start + j, self.staging.page(slot))
                results += answers
                if not store and not all(answers):  # SGLang uses the loaded prefix only
                    break
        return results + [False] * (len(keys) - len(results))

    def _transfer(self, pool: str, keys: Sequence[bytes], slots: Sequence[int], store: bool,
                  parent: bytes | None) -> list[bool]:
        s, ns = self.settings, self.names.namespace
        deadline = time.monotonic() + s.deadline_s
        wait = s.deadline_s + s.timeout_s  # the answer of a copy started just before the deadline
        engine = None if parent is None else EngineBlocks(KeyFormat.OPAQUE, tuple(keys), parent,
                                                          self.names.geometry.spec.block_size)

        def offload(client: Client) -> list[bool]:
            result = client.offload(list(zip(slots, keys)), pool_id=pool, namespace=ns, partial=True, timeout=wait,
                                    deadline=deadline, engine=engine)
            return [o in STORED for o in result.outcomes]

        def restore(client: Client) -> list[bool]:
            result = client.restore(list(zip(keys, slots)), pool_id=pool, namespace=ns, partial=True, timeout=wait,
                                    deadline=deadline)
            if Outcome.DATA_LOSS in result.outcomes:
                log.warning("kvxfer: %d stored pages failed their checksum; dropped, loaded as misses",
                            result.outcomes.count(Outcome.DATA_LOSS))
            return [o is Outcome.DONE for o in result.outcomes]

        return self._guarded(f"a {'store' if store else 'load'} of {len(keys)} pages", [False] * len(keys),
                             offload if store else restore)

    def close(self) -> None:
        """Unregister this process's pools (SGLang detached the backend; the process may live on), then
        let go of the staging area. The daemon also drops them when this process exits."""
        client = self.link.client
        if client is not None:
            roles = (["host"] if self.host_fd is not None else []) + ["staging"]
            for role in roles:
                try:
                    client.unregister_pool(self.names.pool_id(role), drain_s=1.0, timeout=self.settings.timeout_s)
                except KvxferError as exc:
                    log.warning("kvxfer: could not unregister pool %s: %s", self.names.pool_id(role), exc)
        self.link.close()
        self.staging.close()
