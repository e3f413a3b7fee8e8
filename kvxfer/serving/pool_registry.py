"""The pools one daemon serves, owned or registered, addressed by id and epoch.

Each pool has its own manager (copies) and job runner (ordering, leases), so
ranks never wait for each other; its tier and index belong to its cache group.

Who may do what (docs/design.md, threat model): a registration maps only memory
its client handed over as an open descriptor (``kvxfer.serving.handoff``); a cache group is
joined only by the party that created it (the daemon for its own pools, else the
registering uid); only the holder of a pool's registration token unregisters it.
A group whose last pool is gone is released after ``cache_group_retention_s`` (``group_table``).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence

from kvxfer.core.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                                ResourceExhausted)
from kvxfer.core.records import LookupResult, Medium, PoolRef
from kvxfer.core.validate import check_pool_id, shown
from kvxfer.events.event_hub import EventHub
from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout
from kvxfer.geometry.sharding import Sharding, stored_format
from kvxfer.index.admission import AdmissionSettings
from kvxfer.index.hintbook import DEFAULT_SHARE
from kvxfer.index.tenancy import Tenant
from kvxfer.memory import cuda_mem, room
from kvxfer.memory.pool import Pool, PoolDescriptor, PoolHandle, new_epoch
from kvxfer.memory.shm import size_sealed
from kvxfer.serving.group import CacheGroup, Reservations
from kvxfer.serving.group_table import DAEMON_SHARING, GroupEntry, GroupTable, Sharing, close_released
from kvxfer.serving.handoff import HandOff, HandOffs, check_path_names, file_identity, token_digest
from kvxfer.serving.jobs import JobRunner
from kvxfer.serving.lifetimes import ProcessWatch, UntilLanded
from kvxfer.serving.limits import Limits
from kvxfer.serving.pool_manager import PoolManager, TransferObserver
from kvxfer.serving.served_pool import DAEMON, ServedPool
from kvxfer.tiers.host import capacity_blocks
from kvxfer.tiers.registry import lower_tiers as make_lower_tiers
from kvxfer.transfer import native

log = logging.getLogger(__name__)


class PoolRegistry:
    """Thread-safe map of pool id -> served pool."""

    def __init__(self, limits: Limits = Limits(), observer: TransferObserver | None = None,
                 kv_events: EventHub | None = None, lower_tiers: Mapping[str, object] | None = None,
                 admission: AdmissionSettings | None = None, tenants: Sequence[Tenant] = (),
                 reservations: Reservations | None = None, hint_share: float = DEFAULT_SHARE) -> None:
        """``lower_tiers``: every group's lower tiers, their sources by config section (settings; ``peering``:
        the daemon's peering, built beside the registry: ``service/parts.py``; ``kvxfer.tiers.registry``).
        ``admission``: every group's rules for the new blocks engines offload (``kvxfer.index.admission``).
        ``tenants``: their shares of every group's host tier (``kvxfer.index.tenancy``). ``reservations``: peers'
        pushes into the groups peers reach. ``hint_share``: of a host tier, per tenant, what hinted blocks hold."""
        self.limits = limits
        self.admission = admission
        self.tenants = tuple(tenants)
        self.hint_share = hint_share
        self.observer = observer  # told of every transfer of every pool (the daemon's metrics)
        self.kv_events = kv_events  # where the groups' tiers announce their blocks (WatchEvents)
        self.handoffs = HandOffs(max_pending=2 * limits.max_pools)
        self._pools: dict[str, ServedPool] = {}
        self._groups = GroupTable(limits.cache_group_retention_s, limits.max_cache_groups)
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)  # job ids are unique across the daemon's pools
        self._watch = ProcessWatch(self._registrant_exited)
        self.until_landed = UntilLanded()  # pools whose late GPU copies may still land: freed once they have
        self._reservations = reservations
        self._lower_tiers = make_lower_tiers(lower_tiers or {})

    def add(self, pool: Pool, host_capacity_blocks: int, cache_group: str = "", owner: str = DAEMON,
            token: bytes = b"", registrant_pid: int = 0, sharing: Sharing | None = None,
            chosen: bytes = b"") -> ServedPool:
        """Serve a mapped pool (owned, or registered) in a cache group (default: its own id).

        A new group gets a host tier of ``host_capacity_blocks`` and ``sharing`` (default: the
        daemon's groups shared, others private); an existing group keeps its own, admits only its
        ``owner``, and refuses a pool that asks for other sharing. A new private group reaches the
        tiers other nodes read through ``chosen`` (its registrant's chosen token), or not at all.
        """
        sharing = sharing if sharing is not None else DAEMON_SHARING if owner == DAEMON else Sharing()
        pool_id = pool.descriptor.pool_id
        name = check_pool_id(cache_group or pool_id, "cache group")
        released: list[CacheGroup] = []
        try:
            with self._lock:
                if pool_id in self._pools:
                    raise AlreadyExists(f"pool {shown(pool_id)} exists")
                if len(self._pools) >= self.limits.max_pools:
                    raise ResourceExhausted(f"the daemon serves {len(self._pools)} pools; at most "
                                            f"{self.limits.max_pools}")
                entry = self._groups.admit(name, owner, sharing)
                if entry is None:
                    stored, manifest = stored_format(pool.layout, pool.descriptor.sharding)
                    if owner != DAEMON and not self.limits.allow_overcommit:  # the daemon's own: checked at start
                        room.ensure(host_capacity_blocks * stored.block_bytes,
                                    f"the host tier of pool {shown(pool_id)}")
                    released = self._groups.take_expired(time.monotonic(), force_room=True)  # closed below
                    self._groups.check_room()
                    entry = GroupEntry(CacheGroup(name, stored, host_capacity_blocks, pin_device=pool.cuda_device,
                                              lower=self._lower_tiers,
                                              kv_events=self.kv_events.scoped(private=not sharing.events)
                                              if self.kv_events is not None else None, manifest=manifest,
                                              reservations=self._reservations,
                                              admission=self.admission, tenants=self.tenants,
                                              hash_threads=self.limits.copy_threads, hint_share=self.hint_share,
                                              reach=sharing.reach(name, chosen)),
                                       owner, sharing)
                # PoolManager refuses a pool whose block format differs from the group's.
                manager = PoolManager(pool, entry.group, checksum_on_device=self.limits.checksum_on_device,
                                      observer=self.observer, copy_threads=self.limits.copy_threads,
                                      deadline_s=self.limits.gpu_copy_deadline_s)
                self._groups.join(name, entry, pool_id)
                jobs = JobRunner(manager, self._job_ids, self.limits.max_queued_jobs, self.limits.default_lease_s,
                                 self.limits.max_lease_s, self.limits.max_jobs_per_client)
                served = self._pools[pool_id] = ServedPool(manager, jobs, owner, token_digest(token) if token else b"",
                                                           registrant_pid)
        finally:
            close_released(released, self._written_down)  # (outside the lock: it writes blocks down to disk)
        return served

    def create(self, pool_id: str, spec: KVSpec, layout: Layout, device: str = "auto",
               host_capacity_mib: float = 512, cache_group: str = "", sharding: Sharding | None = None
               ) -> ServedPool:
        """Allocate and serve one of the daemon's own pools (a sealed memfd on CPU: no client can
        shrink it under the daemon) in its cache group (default: its own id)."""
        check_pool_id(pool_id)
        capacity = capacity_blocks(host_capacity_mib, stored_format(PoolLayout(spec, layout), sharding)[0].block_bytes)
        pool = Pool.create(pool_id, spec, layout, device=cuda_mem.resolve_device(device), shm_dir=None,
                           sharding=sharding)
        try:
            return self.add(pool, capacity, cache_group)
        except BaseException:
            pool.close()
            raise

    def register(self, pool_id: str, spec: KVSpec, layout: Layout, handle: PoolHandle, token: bytes,
                 host_capacity_mib: int = 0, cache_group: str = "", sharding: Sharding | None = None,
                 sharing: Sharing = Sharing(), chosen: bytes = b"") -> tuple[ServedPool, bytes]:
        """Serve memory an engine allocated and handed over; returns the pool (with a fresh epoch) and its
        registration token (``chosen``, or one made here). The hand-off is used up whether it succeeds or not."""
        if not self.limits.allow_register:
            raise FailedPrecondition("this daemon does not accept registered pools (allow_register: false)")
        handoff = self.handoffs.take(token)
        try:
            self._end_lost_registration(pool_id, handoff)
            pool, capacity = self._map_registered(PoolDescriptor(pool_id, spec, layout, handle, epoch=new_epoch(),
                                                                 owned=False, sharding=sharding),
                                                  handoff, host_capacity_mib)
        except BaseException:
            if handoff.fd >= 0:
                os.close(handoff.fd)
            raise
        unregister_token = chosen or secrets.token_bytes(16)
        try:
            served = self.add(pool, capacity, cache_group, owner=f"uid:{handoff.uid}", token=unregister_token,
                              registrant_pid=handoff.pid, sharing=sharing, chosen=chosen)
        except BaseException:
            pool.close()
            raise
        watched = self._watch.watch(pool_id, handoff.pid, handoff.uid)
        log.info("pool registered", extra={"pool": pool_id, "uid": handoff.uid, "pid": handoff.pid,
                                           "access": pool.access.value, "cache_group": served.cache_group,
                                           "ends_with_process": watched})
        if not watched:
            log.warning("the registering process cannot be watched (another PID namespace?): the pool is served "
                        "until it is unregistered", extra={"pool": pool_id, "pid": handoff.pid})
        return served, unregister_token

    def _map_registered(self, descriptor: PoolDescriptor, handoff: HandOff, host_capacity_mib: int
                        ) -> tuple[Pool, int]:
        """Check a registration and map its memory (the pool then owns the hand-off's descriptor)."""
        pool_id, handle = check_pool_id(descriptor.pool_id), descriptor.handle
        limit = self.limits.registered_host_capacity_mib
        if not 0 <= host_capacity_mib <= limit:
            raise InvalidArgument(f"host_capacity_mib {host_capacity_mib} out of range [1, {limit}] (0: {limit})")
        stored = stored_format(descriptor.pool_layout, descriptor.sharding)[0]
        capacity = capacity_blocks(host_capacity_mib or limit, stored.block_bytes)
        with self._lock:
            if pool_id in self._pools:
                raise AlreadyExists(f"pool {shown(pool_id)} exists")
        if handle.medium is Medium.CUDA:
            reason = cuda_mem.why_unusable(0)
            if reason is not None:
                raise FailedPrecondition(f"a CUDA pool was registered, but this daemon cannot serve one: {reason}")
            if handoff.fd >= 0:
                raise InvalidArgument("a CUDA pool is named by its IPC handle: hand over no descriptor")
            return Pool.attach(descriptor), capacity  # opens the handle; the allocation must hold the geometry
        if handle.medium is not Medium.SHM:
            raise InvalidArgument("a registered pool has medium MEDIUM_SHM (its descriptor handed over) or "
                                  "MEDIUM_CUDA (its IPC handle)")
        if handoff.fd < 0:
            raise InvalidArgument("a shared-memory pool needs its descriptor handed over")
        check_path_names(handle.path, handoff.dev, handoff.ino)
        # A sealed memfd cannot shrink: map it and copy at memory speed. Any other file may be shrunk
        # under us: map it for the C loop's guarded copies, which survive the SIGBUS (docs/design.md),
        # or, where that loop is not built, reach it through its descriptor only.
        sealed = size_sealed(handoff.fd)
        guarded = not sealed and native.load() is not None
        return Pool.from_fd(descriptor, handoff.fd, mapped=sealed or guarded, guarded=guarded), capacity

    def unregister(self, ref: PoolRef, token: bytes, drain_timeout: float = 10.0) -> int:
        """Stop serving a registered pool: its queued jobs get ``drain_timeout`` to finish, the
        rest are cancelled (returned). New requests for it fail at once. Only the holder of
        the pool's registration token may."""
        served = self.get(ref)
        if served.descriptor.owned:
            raise FailedPrecondition(f"pool {shown(ref.pool_id)} is owned by the daemon; only registered pools "
                                     "are unregistered")
        if not hmac.compare_digest(token_digest(bytes(token)), served.token_digest):
            raise PermissionDenied(f"pool {shown(ref.pool_id)} was registered by another client: only the "
                                   "registration token it was given unregisters it")
        self._watch.forget(ref.pool_id)
        return self._end(served, drain_timeout)

    def _end(self, served: ServedPool, drain_timeout: float) -> int:
        """Stop serving a registered pool and release its memory (the IPC mapping, the descriptor)."""
        pool_id = served.descriptor.pool_id
        with self._lock:
            if self._pools.get(pool_id) is not served:
                raise FailedPrecondition(f"pool {shown(pool_id)} is being unregistered")
            del self._pools[pool_id]
        cancelled = served.jobs.close(drain_timeout)
        served.manager.close()

        def free() -> None:
            served.manager.pool.close()
            self._release(served)

        self.until_landed.release(served.manager.engine.reap, free, pool_id)  # never under a copy still running
        return cancelled

    def _end_lost_registration(self, pool_id: str, handoff: HandOff) -> None:
        """The same process registering a pool id again: the answer to its earlier registration was lost
        (a deadline), so it never got the token. That registration ends, and this one replaces it."""
        with self._lock:
            old = self._pools.get(pool_id)
        mine = old is not None and handoff.pid > 0 and (old.registrant_pid, old.owner) == (handoff.pid,
                                                                                            f"uid:{handoff.uid}")
        if mine:  # else someone else's, or unknown: AlreadyExists below
            self._watch.forget(pool_id)
            self._end(old, drain_timeout=0.0)
            log.warning("a pool was registered again by its registrant (the answer to the first registration was "
                        "lost); the first registration ended", extra={"pool": pool_id, "pid": handoff.pid})

    def _registrant_exited(self, pool_id: str) -> None:
        """The process that registered ``pool_id`` exited without unregistering it: nothing may touch
        its memory any more, and the daemon must not keep it (a GPU's would stay allocated)."""
        with self._lock:
            served = self._pools.get(pool_id)
        if served is None or served.descriptor.owned:
            return
        try:
            cancelled = self._end(served, drain_timeout=0.0)
        except FailedPrecondition:
            return  # unregistered meanwhile
        log.warning("the process that registered a pool exited; the pool is unregistered",
                    extra={"pool": pool_id, "cancelled_jobs": cancelled, "cache_group": served.cache_group})

    def accept_handoff(self, fd: int, uid: int, pid: int) -> bytes:
        """Keep a descriptor a client passed; returns the token RegisterPool presents. Memory the same
        process registered already may come again (its first registration's answer may have been lost)."""
        return self.handoffs.accept(fd, uid, pid, self._served_files(except_pid=pid))

    def pool_fd(self, pool_id: str, epoch: int) -> int:
        """The descriptor of one of the daemon's own memfd pools, for a client to map."""
        served = self.get(PoolRef(pool_id, epoch))
        pool = served.manager.pool
        if not served.descriptor.owned or pool.descriptor.handle.medium is not Medium.MEMFD or pool.fd is None:
            raise FailedPrecondition(f"pool {shown(pool_id)} is not one of the daemon's memfd pools; map it "
                                     "as its handle says")
        return pool.fd

    def get(self, ref: PoolRef, registrant: bool = False, reader: bool = False) -> ServedPool:
        """A live pool whose epoch matches; FAILED_PRECONDITION otherwise. ``registrant``: the request moves or
        deletes blocks, which on a registered pool only its registrant may (PERMISSION_DENIED); ``reader``: it
        learns of its keys (a Lookup, a hint), which on a private group (one that shows its keys to no watcher)
        only its registrant may."""
        if not ref.pool_id:
            raise InvalidArgument("a request must name its pool (pool.pool_id)")
        with self._lock:
            served = self._pools.get(ref.pool_id)
        if served is None:
            raise FailedPrecondition(f"unknown pool {shown(ref.pool_id)}")
        epoch = served.descriptor.epoch
        if ref.epoch != epoch:
            raise FailedPrecondition(f"stale epoch {ref.epoch} for pool {shown(ref.pool_id)} (now {epoch}): "
                                     "call GetPoolInfo and map the pool again")
        registrant = registrant or (reader and served.manager.group.event_scope != 0)
        if registrant and served.token_digest and not hmac.compare_digest(token_digest(bytes(ref.token)),
                                                                           served.token_digest):
            raise PermissionDenied(f"pool {shown(ref.pool_id)} was registered by another client: only its registrant "
                                   "(with the registration token it was given) moves its blocks or asks what it holds")
        return served

    def served(self, pool_id: str = "") -> list[ServedPool]:
        """Every pool, or the named one (NOT_FOUND if absent)."""
        with self._lock:
            if not pool_id:
                return list(self._pools.values())
            served = self._pools.get(pool_id)
        if served is None:
            raise NotFound(f"no pool {shown(pool_id)}")
        return [served]

    def groups(self) -> list[CacheGroup]:
        """The cache groups served now (a Snapshot reads their indexes)."""
        with self._lock:
            return self._groups.groups()

    def peer_groups(self) -> list[CacheGroup]:
        """The cache groups other nodes' daemons may reach: the daemon's own and those shared with peers."""
        with self._lock:
            return self._groups.groups(peers_only=True)

    def event_scopes(self, refs: Sequence[PoolRef] = ()) -> frozenset[int]:
        """The event scopes a caller may see besides the public one (0: the daemon's groups and those shared
        with events): those of the registered pools it names with their registration tokens
        (PERMISSION_DENIED for a wrong token, FAILED_PRECONDITION for an unknown pool)."""
        return frozenset({0} | {self.get(ref, registrant=True).manager.group.event_scope for ref in refs})

    def lookup(self, refs: Sequence[PoolRef], namespace: str, keys: Sequence[bytes],
               deadline: float | None = None) -> LookupResult:
        """Hits present in every listed pool (the ranks of one model): the minimum over pools,
        since a block is reusable only when every rank holds its shard (``deadline``: ``PoolManager.lookup``)."""
        if not refs:
            raise InvalidArgument("a lookup names at least one pool")
        if len({r.pool_id for r in refs}) != len(refs):
            raise InvalidArgument("a lookup names each pool once")
        results = [self.get(ref, reader=True).manager.lookup(namespace, keys, deadline) for ref in refs]
        tiers = [t if all(r.tiers[i] is not None for r in results) else None for i, t in enumerate(results[0].tiers)]
        return LookupResult(min(r.hits for r in results), tiers)

    def sweep(self) -> list[str]:
        """Release cache groups whose last pool left more than the retention ago (their host tiers written
        down to the tiers that keep blocks, then freed); returns their names. Blocks on disk I/O: call it
        from a worker thread."""
        with self._lock:
            released = self._groups.take_expired(time.monotonic())
        close_released(released, self._written_down)
        return [group.name for group in released]

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop every pool's jobs, write the host tiers to their disk tiers (for up to
        ``drain_timeout``), and release every pool (owned pool files are removed)."""
        with self._lock:
            served, self._pools = list(self._pools.values()), {}
            groups = self._groups.groups()
            self._groups.entries.clear()
        for s in served:
            s.jobs.close(drain_timeout)
        deadline = time.monotonic() + drain_timeout
        for group in groups:
            demoted = group.demote_all(max(0.0, deadline - time.monotonic()))
            group.close(max(0.0, deadline - time.monotonic()), announce=False)
            if group.restart_warm:
                log.info("host tier written to disk", extra={"cache_group": group.name, "blocks": demoted})
        for s in served:
            s.manager.close()
            s.manager.pool.close()
        self.handoffs.close()
        self._watch.close()

    # -- internals ---------------------------------------------------------------
    def _release(self, served: ServedPool) -> None:
        with self._lock:
            now = time.monotonic()
            self._groups.leave(served.cache_group, served.descriptor.pool_id, now)
            released = self._groups.take_expired(now)
        close_released(released, self._written_down)

    def _written_down(self, group: str) -> None:
        with self._lock:
            self._groups.closing.discard(group)

    def _served_files(self, except_pid: int = 0) -> set[tuple[int, int]]:
        with self._lock:
            pools = [s.manager.pool for s in self._pools.values()
                     if except_pid <= 0 or s.registrant_pid != except_pid]
        return {file_identity(p.fd) for p in pools if p.fd is not None}


__all__ = ["DAEMON", "Limits", "PoolRegistry", "ServedPool", "Sharing"]
