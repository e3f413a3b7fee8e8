"""Server lifecycle: pools, listeners, health, reflection, auth, graceful shutdown.

The gRPC server is asyncio (``grpc.aio``): a request that waits (a long WaitJobs, a
transfer queued behind others, a sender that stalls mid-message) costs a coroutine,
not a thread, so health and other clients are always answered; copies run on
``workers`` threads.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, new RPCs are refused,
in-flight RPCs get ``grace_period_s`` to finish, then queued jobs as long again,
then pools are released, the socket files are removed, and the process exits 0.
A GPU that reports a sticky error (its context is unusable until the process exits)
starts the same shutdown, and the process exits ``EXIT_DEVICE_LOST`` (69) so that
the orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import socket
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer.core.errors import FailedPrecondition, InvalidArgument
from kvxfer.memory.cuda_driver import CudaError, on_device_lost
from kvxfer.memory.shm import resolve_group
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.tiers.registry import placements
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.descriptor_frames import SUFFIX
from kvxfer.wire.lane_frames import SUFFIX as LANE_SUFFIX
from service import logs, metrics_http, parts, preflight
from service.config import Config, unknown_variables
from service.fdsocket import DescriptorSocket
from service.lane_server import Lane
from service.metrics import Metrics
from service.peer_servicer import PeerServicer, peer_handlers
from service.servicer import KVTransferServicer, handlers
from service.transfers import RequestLimits

if TYPE_CHECKING:
    from kvxfer.events.publisher import ZmqPublisher

log = logging.getLogger("kvxfer.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
SWEEP_S = 1.0  # how often idle cache groups past their retention are released
EXIT_DEVICE_LOST = 69  # EX_UNAVAILABLE: a GPU's context broke; a new process gets a new one


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every RPC but health and reflection."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_METHODS):
            return await continuation(details)
        presented = dict(details.invocation_metadata).get("authorization", "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(details)
        return self._deny


def create_pools(config: Config, registry: PoolRegistry) -> None:
    """Allocate the daemon's own pools into ``registry`` (after its listeners are bound)."""
    for pc in config.pools:
        served = registry.create(pc.id, pc.spec, pc.layout, pc.device, pc.host_capacity_mib, pc.cache_group)
        d = served.descriptor
        log.info("pool ready", extra={"pool": pc.id, "device": pc.device, "layout": pc.layout.name,
                                      "block_bytes": pc.spec.block_bytes, "num_blocks": pc.spec.num_blocks,
                                      "host_capacity_mib": pc.host_capacity_mib, "epoch": d.epoch,
                                      "medium": d.handle.medium.value, "cache_group": served.cache_group,
                                      "copy_engine": served.manager.engine.describe()})


def claim_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse if a live one answers there."""
    p = Path(path)
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgument(f"socket: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody serves there: stale
    except OSError as exc:
        raise InvalidArgument(f"socket: {path} exists (uid {st.st_uid}) and cannot be probed: {exc.strerror}; "
                              "remove it or choose another socket path") from None
    else:
        raise FailedPrecondition(f"another daemon is serving on {path}")
    finally:
        probe.close()
    try:
        p.unlink(missing_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"socket: {path} is a stale socket file of uid {st.st_uid} that this user cannot "
                              f"remove ({exc.strerror}); remove it or choose another socket path") from None
    log.warning("removed a stale socket file", extra={"socket": path})


def _add_port(add, address: str) -> None:
    """gRPC's add_*_port, its failure in one line naming the cause (gRPC raises a RuntimeError that names none)."""
    try:
        if add():
            return
    except RuntimeError:
        pass
    raise FailedPrecondition(f"cannot listen on {address}: {_why_not(address)}")


def _why_not(address: str) -> str:
    """Why a TCP address cannot be bound, asked of the kernel directly."""
    if address.startswith("unix:"):
        return "the socket path cannot be bound (its directory missing or not writable?)"
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        return f"the host does not resolve ({exc})"
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(where)
        except OSError as exc:
            return exc.strerror or str(exc)
    return "gRPC could not bind it"


class Daemon:
    """A started server and the pools it serves. Build, ``start`` and ``stop`` inside one event loop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        if config.socket:  # before any memory is allocated: a socket problem fails fast
            claim_socket(config.socket)
            claim_socket(config.socket + SUFFIX)
            claim_socket(config.socket + LANE_SUFFIX)
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="kvxfer-rpc")
        self.metrics = Metrics()
        self.parts = parts.build(config, self.metrics.transfers)  # no pool until listening
        self.kv_events, self.registry, self.peering = self.parts.kv_events, self.parts.registry, self.parts.peering
        self.publisher: ZmqPublisher | None = None
        self.metrics_server: metrics_http.MetricsServer | None = None
        self.health = health.aio.HealthServicer()
        c = config
        options = [("grpc.max_receive_message_length", c.max_message_mib << 20),
                   ("grpc.max_send_message_length", c.max_message_mib << 20),
                   ("grpc.so_reuseport", 0),
                   # A peer that stops answering pings (killed, stopped, cut off) is dropped.
                   ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.max_connection_idle_ms", 600_000),
                   ("grpc.max_concurrent_streams", c.max_streams_per_connection)]
        token = c.token
        interceptors = [self.metrics.grpc, *([TokenAuth(token)] if token else [])]  # metrics see refusals too
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        limits = RequestLimits(c.max_concurrent_rpcs, c.max_batch_blocks, c.max_pools, c.max_queued_jobs,
                               c.hints.max_ttl_s, tuple(p.name for p in c.peering.peers) if c.peering else ())
        self.limits = limits
        servicer = KVTransferServicer(self.registry, limits, self.executor, self.parts.hints, self.peering)
        self.server.add_generic_rpc_handlers((handlers(servicer),))
        if self.peering is not None:
            self.server.add_generic_rpc_handlers((peer_handlers(PeerServicer(self.peering, self.executor,
                                                                             c.max_batch_blocks)),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        self.addresses: list[str] = []
        self.fd_socket: DescriptorSocket | None = None
        self.lane: Lane | None = None
        self._sweeper: asyncio.Task | None = None
        try:
            self._listen()  # before allocating: a busy port fails at once, not after the pools
            create_pools(config, self.registry)
            self.metrics.watch(self.registry, self.parts.hints, self.peering)
        except BaseException:
            self._release()
            raise

    def _listen(self) -> None:
        c = self.config
        if c.socket:
            _add_port(lambda: self.server.add_insecure_port(f"unix:{c.socket}"), f"unix:{c.socket}")
            gid = resolve_group(c.socket_group or None)
            os.chmod(c.socket, c.socket_mode)
            if gid >= 0:
                os.chown(c.socket, -1, gid)
            self.fd_socket = DescriptorSocket(c.socket + SUFFIX, self.registry, c.socket_mode, gid, c.token)
            self.lane = Lane(c.socket + LANE_SUFFIX, self.registry, self.parts.hints, self.limits, c.socket_mode,
                             gid, c.token, self.metrics.lane)
            self.addresses.append(f"unix:{c.socket}")
        if c.listen:
            # With peering, callers show a certificate of the peers' CA (a peer is known by the name it carries).
            client_ca = Path(c.peering.tls_client_ca).read_bytes() if c.peering is not None else None
            creds = grpc.ssl_server_credentials([(Path(c.tls_key).read_bytes(), Path(c.tls_cert).read_bytes())],
                                                root_certificates=client_ca, require_client_auth=client_ca is not None)
            _add_port(lambda: self.server.add_secure_port(c.listen, creds), c.listen)
            self.addresses.append(c.listen)
        if c.events.publish:
            from kvxfer.events.publisher import ZMQError, ZmqPublisher  # (pyzmq: only when publishing)
            try:
                self.publisher = ZmqPublisher(self.kv_events, c.events, placements())
            except ZMQError as exc:  # an address in use, an unknown interface: the daemon does not start
                raise FailedPrecondition(f"events.publish: cannot bind {c.events.publish} or {c.events.replay}: "
                                         f"{exc}") from None
        if c.metrics_listen:
            try:
                self.metrics_server = self.metrics.serve(c.metrics_listen)
            except OSError as exc:
                raise FailedPrecondition(f"metrics_listen: cannot listen on {c.metrics_listen}: {exc.strerror}") \
                    from None

    async def start(self) -> None:
        self.kv_events.attach(asyncio.get_running_loop())
        await self.server.start()
        if self.fd_socket is not None:
            self.fd_socket.start()
        if self.lane is not None:
            self.lane.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.metrics.serving.set(1)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        log.info("listening", extra={"addresses": self.addresses, "metrics": self.config.metrics_listen or None,
                                     "pools": [s.descriptor.pool_id for s in self.registry.served()]})

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()  # NOT_SERVING, and stays so
        self.metrics.serving.set(0)
        log.info("shutting down", extra={"grace_period_s": self.config.grace_period_s})
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.kv_events.close()  # WatchEvents streams end: they would hold the grace period
        loop = asyncio.get_running_loop()
        lane_closed = loop.run_in_executor(None, self.lane.close, self.config.grace_period_s) if self.lane else None
        await self.server.stop(self.config.grace_period_s)
        if lane_closed is not None:
            await lane_closed
        # Queued jobs finish first (on a thread: closing waits).
        await asyncio.get_running_loop().run_in_executor(None, self.parts.drain, self.config.grace_period_s)
        self._release()
        log.info("stopped")

    def _release(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.fd_socket is not None:
            self.fd_socket.close()
        if self.lane is not None:
            self.lane.close()
        self.parts.close()
        if self.publisher is not None:
            self.publisher.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.config.socket and self.addresses:
            Path(self.config.socket).unlink(missing_ok=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            # On a worker thread: a released group's blocks are written down to disk first.
            await asyncio.get_running_loop().run_in_executor(self.executor, self.registry.sweep)


async def _serve(config: Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    exit_code = 0

    def device_lost(device: int, error: CudaError) -> None:
        nonlocal exit_code
        exit_code = EXIT_DEVICE_LOST
        log.error("GPU lost: a sticky CUDA error broke its context; every pool on it fails; the daemon shuts "
                  "down (host tiers are written to disk) and exits to be restarted",
                  extra={"device": device, "error": str(error), "exit_code": EXIT_DEVICE_LOST})
        stop.set()

    unsubscribe = on_device_lost(lambda device, error: loop.call_soon_threadsafe(device_lost, device, error))
    try:
        daemon = Daemon(config)
        await daemon.start()
        await stop.wait()
        await daemon.stop()
    finally:
        unsubscribe()
    return exit_code


def serve(config: Config) -> int:
    """Run until SIGTERM or SIGINT; returns the exit code."""
    logs.setup(config.log_level, config.log_format)
    for line in [*unknown_variables(), *config.notes]:
        log.warning(line)
    return asyncio.run(_serve(preflight.check(config)))
