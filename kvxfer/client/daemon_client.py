"""The engine-side client: connect, map the pool with zero copy, and call the daemon.

Every call has a deadline (``timeout``), over the lane and gRPC together; a daemon that is down or slow fails
the call by then with ``Unavailable`` or ``DeadlineExceeded`` instead of hanging the engine. A status from the
daemon raises the kvxfer exception of that code. A well-formed request whose blocks did not all succeed raises
``BlockFailures`` carrying every block's outcome, unless the caller passes ``partial=True``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer.client import fdpass
from kvxfer.client import lane_client as lane_mod
from kvxfer.client.channel import monotonic_ns, open_channel, rpc_error, time_left
from kvxfer.client.results import DROPPABLE, FinishedJobs, PendingJobs, failures, finished
from kvxfer.core.errors import FailedPrecondition, InvalidArgument, KvxferError
from kvxfer.core.records import PB_TO_TIER, HintAction, LookupResult, Medium, PoolStats, TransferResult
from kvxfer.core.validate import check_uint32, checked_keys, shown
from kvxfer.events.event_records import EngineBlocks
from kvxfer.events.event_stream import EventBatch, SnapshotBatch, event_batches, snapshot_batches
from kvxfer.events.event_wire import engine_to_pb
from kvxfer.geometry.keys import block_keys
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.geometry.sharding import Sharding
from kvxfer.memory import cuda_mem
from kvxfer.memory.ipc_event import CudaEvent, event_handle
from kvxfer.memory.pool import Pool, PoolDescriptor, PoolHandle
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire import messages as wire


class Client:
    """A connection to one daemon. ``target`` is ``unix:/path/to.sock`` or ``host:port`` (TLS; with
    ``certificate_chain`` and ``private_key`` this client's certificate, which a daemon with peering asks for)."""

    def __init__(self, target: str, namespace: str = "default", *, pool_id: str | None = None,
                 timeout: float = 5.0, token: str | None = None, root_certificates: bytes | None = None,
                 certificate_chain: bytes | None = None, private_key: bytes | None = None,
                 lane: bool = True) -> None:
        """``lane``: send Offload, Restore and Lookup over the daemon's local lane where it serves one
        (``kvxfer.client.lane_client``: the same messages without gRPC's per-call cost); False: gRPC only."""
        self.client_id = uuid.uuid4().hex  # names this client's asynchronous jobs
        self.namespace = namespace
        self.timeout = timeout
        self.default_pool = pool_id
        self._channel, self._metadata = open_channel(target, token, root_certificates, certificate_chain, private_key)
        self._target = target
        self._token = token  # the descriptor socket asks for it too
        self._stub = pb_grpc.KVTransferStub(self._channel)
        self._lane = lane_mod.Lane.beside(target, token, self._stub) if lane else None
        self._registrations: dict[str, bytes] = {}  # pool id -> registration token
        self._descriptors: dict[str, PoolDescriptor] = {}
        self._mapped: dict[str, Pool] = {}

    # -- pools -----------------------------------------------------------------
    def pools(self) -> list[PoolDescriptor]:
        """Every pool the daemon serves (and refresh what this client knows of them)."""
        response = self._call(self._stub.GetPoolInfo, pb.GetPoolInfoRequest())
        self._descriptors = {p.pool_id: wire.descriptor_from_pb(p) for p in response.pools}
        return list(self._descriptors.values())

    def pool_info(self, pool_id: str | None = None) -> PoolDescriptor:
        """One pool's descriptor; without an id, the client's default or the daemon's only pool."""
        pool_id = pool_id or self.default_pool
        if pool_id is None:
            pools = self.pools()
            if len(pools) != 1:
                raise InvalidArgument(f"the daemon serves {len(pools)} pools; name one: "
                                      f"{[p.pool_id for p in pools]}")
            return pools[0]
        response = self._call(self._stub.GetPoolInfo, pb.GetPoolInfoRequest(pool_id=pool_id))
        desc = wire.descriptor_from_pb(response.pools[0])
        self._descriptors[pool_id] = desc
        return desc

    def map_pool(self, pool_id: str | None = None) -> Pool:
        """Map the pool into this process (zero copy); requests then carry the mapped epoch."""
        desc = self.pool_info(pool_id)
        old = self._mapped.get(desc.pool_id)
        if old is not None and old.descriptor.epoch == desc.epoch:
            return old
        if desc.handle.medium is Medium.MEMFD:  # the daemon's own pool: it passes the descriptor
            fd = fdpass.receive_pool(fdpass.socket_path_for(self._target), desc.pool_id, desc.epoch, self._token)
            try:
                pool = Pool.from_fd(desc, fd)
            except BaseException:
                os.close(fd)
                raise
        else:
            pool = Pool.attach(desc)
        self._mapped[desc.pool_id] = pool
        return pool

    def kv_views(self, pool_id: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K and V views over the mapped pool."""
        return self.map_pool(pool_id).views()

    # -- blocks ----------------------------------------------------------------
    def offload(self, pairs: Sequence[tuple[int, bytes]], *, pool_id: str | None = None,
                namespace: str | None = None, partial: bool = False, best_effort: bool = False,
                timeout: float | None = None, cuda_event: CudaEvent = None,
                deadline: float | None = None, engine: EngineBlocks | None = None,
                hint: tuple[HintAction, int] | None = None) -> TransferResult | None:
        """Copy (block, key) pairs into the daemon's tiers (a block is the API's ``slot``).

        ``best_effort=True``: if the daemon is down, slow or full, return None instead of
        raising (the engine goes on; it loses a future cache hit, nothing else).
        ``cuda_event`` (GPU pools): recorded after the kernels that wrote these blocks (see
        ``event_handle``); the daemon copies once it has completed. Without it the copy
        waits for nothing and may read the blocks before they are written.
        ``deadline`` (a ``time.monotonic()`` value of this host): no block copied after it is
        stored (DEADLINE_EXCEEDED), so the engine may overwrite the blocks once it passed.
        ``hint``: (RETAIN, TTL seconds) or (RELEASE, 0) for the blocks once stored (docs/api.md, Hints).
        """
        request = self._offload_request(pairs, pool_id, namespace, cuda_event, deadline, engine, hint)
        try:
            return self._transfer(self._stub.Offload, request, partial or best_effort, timeout)
        except DROPPABLE:
            if best_effort:
                return None
            raise

    def restore(self, pairs: Sequence[tuple[bytes, int]], *, pool_id: str | None = None,
                namespace: str | None = None, partial: bool = False, timeout: float | None = None,
                deadline: float | None = None, peer: str = "") -> TransferResult:
        """Copy stored (key, block) pairs into the pool blocks this engine chose.

        ``deadline`` (a ``time.monotonic()`` value of this host): no copy into the pool starts after it; blocks not
        written by then are DEADLINE_EXCEEDED (allow a few ms for a copy started just before it to land). ``peer``:
        a configured peer known to hold the keys (docs/peering.md); those the daemon lacks are read from it first."""
        request = pb.RestoreRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace,
                                    keys=[p[0] for p in pairs], slots=[p[1] for p in pairs],
                                    pool_deadline_ns=monotonic_ns(deadline), peer=peer)
        return self._transfer(self._stub.Restore, request, partial, timeout)

    def push(self, keys: Sequence[bytes], peer: str, *, pool_id: str | None = None, namespace: str | None = None,
             partial: bool = False, timeout: float | None = None) -> TransferResult:
        """Copy the blocks of ``keys`` the daemon holds into peer ``peer``'s host tier (docs/peering.md)."""
        request = pb.PushRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace, keys=list(keys),
                                 peer=peer)
        return self._transfer(self._stub.Push, request, partial, timeout)

    # -- asynchronous jobs -------------------------------------------------------
    def submit_offload(self, pairs: Sequence[tuple[int, bytes]], *, pool_id: str | None = None,
                       namespace: str | None = None, lease_s: float = 0.0, timeout: float | None = None,
                       cuda_event: CudaEvent = None, deadline: float | None = None,
                       engine: EngineBlocks | None = None, hint: tuple[HintAction, int] | None = None) -> int:
        """Queue an offload; returns its job id at once. Do not write the blocks until it is finished
        (or ``deadline``, as for ``offload``, has passed).

        The job's lease (``lease_s``, 0: the daemon's default) is renewed by every
        ``wait_jobs`` call; if this client stops calling, the daemon cancels the job.
        ``cuda_event``, ``hint``: as for ``offload``; keep the event alive until the job is finished.
        """
        request = self._offload_request(pairs, pool_id, namespace, cuda_event, deadline, engine, hint, wait=False,
                                        lease_ms=int(lease_s * 1000), client_id=self.client_id)
        return self._call(self._stub.Offload, request, timeout).job_id

    def _offload_request(self, pairs: Sequence[tuple[int, bytes]], pool_id: str | None, namespace: str | None,
                         cuda_event: CudaEvent, deadline: float | None, engine: EngineBlocks | None,
                         hint: tuple[HintAction, int] | None, **job) -> pb.OffloadRequest:
        return pb.OffloadRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace,
                                 slots=[p[0] for p in pairs], keys=[p[1] for p in pairs],
                                 cuda_event_handle=event_handle(cuda_event), pool_deadline_ns=monotonic_ns(deadline),
                                 engine=engine_to_pb(engine) if engine else None,
                                 hint=pb.BlockHint(action=wire.HINT_TO_PB[hint[0]], ttl_s=hint[1]) if hint else None,
                                 **job)

    def submit_restore(self, pairs: Sequence[tuple[bytes, int]], *, pool_id: str | None = None,
                       namespace: str | None = None, lease_s: float = 0.0, timeout: float | None = None,
                       deadline: float | None = None) -> int:
        """Queue a restore; returns its job id at once. Do not read the blocks until it is finished
        (``deadline`` as for ``restore``)."""
        request = pb.RestoreRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace,
                                    keys=[p[0] for p in pairs], slots=[p[1] for p in pairs], wait=False,
                                    lease_ms=int(lease_s * 1000), client_id=self.client_id,
                                    pool_deadline_ns=monotonic_ns(deadline))
        return self._call(self._stub.Restore, request, timeout).job_id

    def wait_jobs(self, job_ids: Sequence[int] = (), *, wait_s: float = 0.0, wait_all: bool = False,
                  pool_id: str | None = None, timeout: float | None = None) -> FinishedJobs:
        """Finished jobs of this client (those named, or any): job id -> per-block outcomes.

        Each job is reported once. ``wait_s=0`` polls (like vLLM's get_finished);
        otherwise the call waits up to ``wait_s`` for one to finish, or with
        ``wait_all`` for every named one (restores a forward pass needs). Failed
        blocks are in the outcomes; nothing is raised for them. Renews this client's leases.
        Named ids the daemon does not know (expired, say) are in the answer's ``unknown``.
        """
        request = pb.WaitJobsRequest(pool=self._ref(pool_id), client_id=self.client_id, job_ids=list(job_ids),
                                     timeout_ms=int(wait_s * 1000), wait_all=wait_all)
        return finished(self._call(self._stub.WaitJobs, request, timeout or self.timeout + wait_s))

    def wait_jobs_async(self, job_ids: Sequence[int] = (), *, wait_s: float = 0.0, wait_all: bool = False,
                        pool_id: str | None = None, timeout: float | None = None) -> PendingJobs:
        """``wait_jobs`` without waiting for its answer: the call is sent and this returns at once. The
        daemon answers as soon as a job finishes, so an engine that asks ``done()`` each step learns of a
        finished job within a step, and spends no round trip on steps where none finished."""
        request = pb.WaitJobsRequest(pool=self._ref(pool_id), client_id=self.client_id, job_ids=list(job_ids),
                                     timeout_ms=int(wait_s * 1000), wait_all=wait_all)
        timeout = timeout or self.timeout + wait_s
        deadline = time.monotonic() + timeout
        call = self._lane.start(self._stub.WaitJobs, request, timeout) if self._lane else None
        if call is None:  # (the lane does not carry it: gRPC does, in what is left of the deadline)
            call = self._stub.WaitJobs.future(request, timeout=time_left(deadline, timeout), metadata=self._metadata)
        return PendingJobs(call, self, self._error)

    # -- registered pools ----------------------------------------------------------
    def register_pool(self, pool_id: str, spec: KVSpec, layout: Layout, handle: PoolHandle, *,
                      host_capacity_mib: int = 0, cache_group: str = "", fd: int | None = None,
                      sharding: Sharding | None = None, share_with_peers: bool = False, share_events: bool = False,
                      chosen_token: bytes = b"", timeout: float | None = None) -> PoolDescriptor:
        """Have the daemon serve memory this engine allocated (a file, or a memfd as ``fd``).

        This process opens the file itself (or passes ``fd``) and hands the open descriptor to the daemon,
        which serves exactly that memory (it never opens a path for a client; a sealed memfd is copied at
        memory speed, any other file served through its descriptor). Returns the descriptor with the epoch the
        daemon assigned. Pools of one ``cache_group`` (default: the pool id) share a host tier: register an
        engine's restart in the group it used before (a group admits only the user that created it); never put
        two tensor-parallel ranks in one group, unless each names its ``sharding``: then the ranks of engines
        of any TP size and layout share one group of canonical blocks. A new group is private: other nodes'
        daemons reach it only with ``share_with_peers``, and callers that do not present one of its pools'
        tokens see its keys (Lookup, WatchEvents, the ZeroMQ publisher) only with ``share_events``; later
        pools of the group ask for the same. ``chosen_token``: the pool's registration token (16-64 random
        bytes) instead of the daemon's, kept when the daemon restarts (``present`` shows it elsewhere).
        """
        if handle.medium is Medium.CUDA:  # named by its IPC handle: the hand-off only says who registers
            token = fdpass.hand_over(fdpass.socket_path_for(self._target), None, self._token)
        else:
            token = self._hand_over(handle.path, fd)
        request = pb.RegisterPoolRequest(pool_id=pool_id, spec=wire.spec_to_pb(spec), layout=layout.spelled,
                                         handle=wire.handle_to_pb(handle), host_capacity_mib=host_capacity_mib,
                                         cache_group=cache_group, registration_token=token,
                                         sharding=wire.sharding_to_pb(sharding), share_with_peers=share_with_peers,
                                         share_events=share_events, chosen_token=chosen_token)
        response = self._call(self._stub.RegisterPool, request, timeout)
        desc = wire.descriptor_from_pb(response.pool)
        self._descriptors[pool_id] = desc
        self._registrations[pool_id] = response.registration_token
        return desc

    def register_cuda_tensor(self, pool_id: str, spec: KVSpec, layout: Layout, tensor: torch.Tensor,
                             **kwargs) -> PoolDescriptor:
        """Register an engine's own CUDA KV tensor (its caching allocator's segment and the
        tensor's byte offset in it, as torch shares CUDA storage). Keep the tensor, and so its
        segment, alive until ``unregister_pool`` returns: the daemon maps that memory."""
        ipc, offset = cuda_mem.share_tensor(tensor)
        handle = PoolHandle(Medium.CUDA, ipc_handle=ipc, device=tensor.device.index or 0, offset=offset,
                            device_uuid=cuda_mem.device_uuid(tensor.device.index or 0))
        return self.register_pool(pool_id, spec, layout, handle, **kwargs)

    def _hand_over(self, path: str, fd: int | None) -> bytes:
        """Open the pool's file as this process (unless given ``fd``) and pass it to the daemon."""
        opened = fd is None
        if opened:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise FailedPrecondition(f"cannot open pool file {path!r}: {exc.strerror}") from None
        try:
            return fdpass.hand_over(fdpass.socket_path_for(self._target), fd, self._token)
        finally:
            if opened:
                os.close(fd)

    def unregister_pool(self, pool_id: str, *, drain_s: float = 10.0, timeout: float | None = None) -> int:
        """Stop the daemon serving a pool this client registered; returns how many queued jobs
        were cancelled."""
        request = pb.UnregisterPoolRequest(pool=self._ref(pool_id), drain_timeout_ms=int(drain_s * 1000),
                                           registration_token=self._registrations.get(pool_id, b""))
        cancelled = self._call(self._stub.UnregisterPool, request, timeout or self.timeout + drain_s).cancelled_jobs
        self._descriptors.pop(pool_id, None)
        self._registrations.pop(pool_id, None)
        return cancelled

    def present(self, tokens: Mapping[str, bytes]) -> None:
        """Show these registration tokens (pool id -> the ``chosen_token`` another process of this engine
        registered it with) in calls naming those pools: a private group answers Lookups to its registrant only."""
        self._registrations.update(tokens)

    def lookup(self, keys: Sequence[bytes], *, pool_ids: Sequence[str] | None = None,
               namespace: str | None = None, timeout: float | None = None) -> LookupResult:
        """Keys in prefix order: leading hits present in every named pool (default: this client's pool)."""
        refs = [self._ref(p) for p in (pool_ids or [None])]
        response = self._call(self._stub.Lookup, pb.LookupRequest(pools=refs, namespace=namespace or self.namespace,
                                                                  keys=list(keys)), timeout)
        return LookupResult(response.hits, [PB_TO_TIER.get(t) for t in response.tiers])

    def hint(self, action: HintAction, keys: Sequence[bytes] = (), *, ttl_s: int = 0, request_id: str = "",
             pool_id: str | None = None, namespace: str | None = None, timeout: float | None = None) -> None:
        """What is coming (docs/api.md, Hints): PREFETCH ``keys`` (retained ``ttl_s`` once up; ``request_id``
        cancels it), RETAIN them ``ttl_s``, RELEASE them, or CANCEL ``request_id``'s. Says nothing of what is held."""
        try:
            pb_action = wire.HINT_TO_PB[HintAction(action)]
        except (ValueError, TypeError):
            raise InvalidArgument(f"hint action {shown(action)} is none of "
                                  f"{', '.join(a.value for a in HintAction)}") from None
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {shown(request_id)}")
        if pb_action == pb.HINT_ACTION_ENVELOPE:
            raise InvalidArgument("an envelope is sent with hint_envelope")
        request = pb.HintRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace,
                                 action=pb_action, keys=checked_keys(keys),
                                 ttl_s=check_uint32(ttl_s, "ttl_s"), request_id=request_id)
        self._call(self._stub.Hint, request, timeout)

    def hint_envelope(self, envelope: Mapping | bytes, keys: Sequence[bytes] = (), *, vllm_keys: bool = False,
                      request_id: str = "", pool_id: str | None = None, namespace: str | None = None,
                      timeout: float | None = None) -> None:
        """A router's hint envelope (vLLM's ``KvHintsEnvelope`` as a mapping, or its JSON; docs/api.md, The hint
        envelope): ``keys``, the request's blocks in prefix order, are its scope and what 64-bit block hashes are
        matched against (``vllm_keys``: they are vLLM's offload keys). Actions the daemon cannot carry out are
        counted there, never an error; an envelope that is not one is INVALID_ARGUMENT."""
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {shown(request_id)}")
        try:
            data = envelope if isinstance(envelope, bytes) else json.dumps(envelope).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"the envelope is not JSON: {str(exc)[:120]}") from None
        request = pb.HintRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace,
                                 action=pb.HINT_ACTION_ENVELOPE, keys=checked_keys(keys, unique=False),
                                 request_id=request_id, envelope=data,
                                 key_format=pb.KEY_FORMAT_VLLM if vllm_keys else pb.KEY_FORMAT_OPAQUE)
        self._call(self._stub.Hint, request, timeout)

    def delete(self, keys: Sequence[bytes], *, pool_id: str | None = None, namespace: str | None = None,
               timeout: float | None = None) -> int:
        request = pb.DeleteRequest(pool=self._ref(pool_id), namespace=namespace or self.namespace, keys=list(keys))
        return self._call(self._stub.Delete, request, timeout).deleted

    def stats(self, pool_id: str = "", timeout: float | None = None) -> list[PoolStats]:
        """Per pool (every pool, or the named one): tiers, bytes moved, outcomes, jobs."""
        request = pb.StatsRequest(pool_id=pool_id, registration_token=self._registrations.get(pool_id, b""))
        return [wire.pool_stats_from_pb(p) for p in self._call(self._stub.Stats, request, timeout).pools]

    def health(self, timeout: float | None = None) -> str:
        """The daemon's health status on this channel: "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest()
        response = self._call(health_pb2_grpc.HealthStub(self._channel).Check, request, timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    block_keys = staticmethod(block_keys)

    # -- plumbing --------------------------------------------------------------
    def _ref(self, pool_id: str | None) -> pb.PoolRef:
        """The pool and the epoch this process mapped (or last saw); no RPC once known."""
        pool_id = pool_id or self.default_pool
        if pool_id is None:
            self.default_pool = pool_id = self.pool_info().pool_id  # the daemon's only pool
        token = self._registrations.get(pool_id, b"")  # a pool this client registered: its transfers show it
        mapped = self._mapped.get(pool_id)
        desc = mapped.descriptor if mapped is not None else self._descriptors.get(pool_id) or self.pool_info(pool_id)
        return pb.PoolRef(pool_id=pool_id, epoch=desc.epoch, registration_token=token)

    def _registered_refs(self) -> list[pb.PoolRef]:  # a watch sees the (private) groups of these pools too
        return [self._ref(pool_id) for pool_id in self._registrations]

    def _transfer(self, method, request, partial: bool, timeout: float | None) -> TransferResult:
        answer = self._call(method, request, timeout)
        result = TransferResult([wire.STATUS_TO_OUTCOME[s] for s in answer.statuses], answer.bytes, answer.seconds)
        if not partial:
            failures(result)
        return result

    def _call(self, method, request, timeout: float | None = None):
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout  # one deadline, whichever way the call goes (a lane refused costs time)
        answer = self._lane.carry(method, request, timeout) if self._lane else None
        if answer is not None:  # (None: the lane does not carry it, nothing was sent: gRPC does)
            return answer
        try:
            return method(request, timeout=time_left(deadline, timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _stream(self, method, request, timeout: float | None) -> Iterator:
        try:
            yield from method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _error(self, exc: grpc.RpcError) -> KvxferError:
        return rpc_error(exc, self._target)

    # -- KV events ----------------------------------------------------------------
    def watch_events(self, namespaces: Sequence[str] = (), *, from_sequence: int = 0, stream_id: str = "",
                     timeout: float | None = None) -> Iterator[EventBatch]:
        """The tiers' events for these namespaces (default: this client's), from ``from_sequence`` (0: the
        next), until ``timeout`` (None: for ever). Pass the ``stream_id`` last seen: another one is a resync.
        Shown: the daemon's own cache groups, groups registered with ``share_events``, and the groups of
        the pools this client registered."""
        request = pb.WatchEventsRequest(namespaces=list(namespaces) or [self.namespace], from_sequence=from_sequence,
                                        stream_id=stream_id, pools=self._registered_refs())
        return event_batches(self._stream(self._stub.WatchEvents, request, timeout))

    def snapshot(self, namespaces: Sequence[str] = (), timeout: float | None = None) -> Iterator[SnapshotBatch]:
        """What the host and disk tiers hold of these namespaces, and where to watch from after it."""
        request = pb.SnapshotRequest(namespaces=list(namespaces) or [self.namespace], pools=self._registered_refs())
        return snapshot_batches(self._stream(self._stub.Snapshot, request, timeout or self.timeout * 12))

    def close(self) -> None:
        self._channel.close()
        if self._lane is not None:
            self._lane.close()
        for pool in self._mapped.values():
            pool.close()
        self._mapped.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
