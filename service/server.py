"""Server lifecycle: pools, listeners, health, reflection, auth, graceful shutdown.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, new RPCs are refused,
in-flight RPCs get ``grace_period_s`` to finish, then pools are released (owned
pool files removed), the socket file is removed, and the process exits 0.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import socket
import stat
import threading
from concurrent import futures
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer.errors import FailedPrecondition
from kvxfer.pool import Medium, Pool
from kvxfer.registry import PoolRegistry
from kvxfer.shm import resolve_group
from kvxfer.transfer import ENGINES
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from service import logs
from service.config import Config, PoolConfig
from service.servicer import KVTransferServicer

log = logging.getLogger("kvxfer.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class TokenAuth(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every RPC but health and reflection."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_METHODS):
            return continuation(details)
        presented = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(details)
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token"))


def resolve_device(device: str) -> str:
    """``auto`` is the GPU when there is one and a copy engine serves CUDA pools, else the CPU."""
    cuda_served = any(medium is Medium.CUDA for medium, _ in ENGINES)
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() and cuda_served else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise FailedPrecondition(f"pool device {device} asked for, but no CUDA device is available")
        if not cuda_served:
            raise FailedPrecondition(f"pool device {device}: this version has no copy engine for CUDA pools yet; "
                                     "use device: cpu")
    return device


def create_pools(config: Config) -> PoolRegistry:
    registry = PoolRegistry(config.limits)
    try:
        for pc in config.pools:
            _create_pool(registry, pc, config)
    except BaseException:
        registry.close()
        raise
    return registry


def _create_pool(registry: PoolRegistry, pc: PoolConfig, config: Config) -> None:
    device = resolve_device(pc.device)
    pool = Pool.create(pc.id, pc.spec, pc.layout, device=device, shm_dir=config.shm_dir, mode=config.shm_mode,
                       group=config.shm_group or None)
    registry.add(pool, pc.host_capacity_blocks, pc.cache_group)
    log.info("pool ready", extra={"pool": pc.id, "device": device, "layout": pc.layout.name,
                                  "block_bytes": pc.spec.block_bytes, "num_blocks": pc.spec.num_blocks,
                                  "host_capacity_blocks": pc.host_capacity_blocks, "epoch": pool.descriptor.epoch,
                                  "path": pool.descriptor.handle.path})


def _claim_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse if a live one answers there."""
    p = Path(path)
    if not p.exists():
        return
    if not stat.S_ISSOCK(p.stat().st_mode):
        raise FailedPrecondition(f"socket path {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        p.unlink(missing_ok=True)
        log.warning("removed a stale socket file", extra={"socket": path})
        return
    finally:
        probe.close()
    raise FailedPrecondition(f"another daemon is serving on {path}")


class Daemon:
    """A started server and the pools it serves."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry = create_pools(config)
        self.health = health.HealthServicer()
        options = [("grpc.max_receive_message_length", config.max_message_mib << 20),
                   ("grpc.max_send_message_length", config.max_message_mib << 20),
                   ("grpc.so_reuseport", 0)]
        token = config.token
        self.server = grpc.server(futures.ThreadPoolExecutor(config.workers, thread_name_prefix="kvxfer-rpc"),
                                  interceptors=[TokenAuth(token)] if token else [], options=options,
                                  maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self.registry), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        self.addresses: list[str] = []
        try:
            self._listen()
        except BaseException:
            self.server.stop(None).wait()
            self.registry.close()
            raise

    def _listen(self) -> None:
        c = self.config
        if c.socket:
            _claim_socket(c.socket)
            if not self.server.add_insecure_port(f"unix:{c.socket}"):
                raise FailedPrecondition(f"cannot listen on unix:{c.socket}")
            os.chmod(c.socket, c.socket_mode)
            gid = resolve_group(c.socket_group or None)
            if gid >= 0:
                os.chown(c.socket, -1, gid)
            self.addresses.append(f"unix:{c.socket}")
        if c.listen:
            creds = grpc.ssl_server_credentials([(Path(c.tls_key).read_bytes(), Path(c.tls_cert).read_bytes())])
            if not self.server.add_secure_port(c.listen, creds):
                raise FailedPrecondition(f"cannot listen on {c.listen}")
            self.addresses.append(c.listen)

    def start(self) -> None:
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("listening", extra={"addresses": self.addresses, "pools": [d.pool_id for d in
                                                                          self.registry.descriptors()]})

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()  # NOT_SERVING, and stays so
        log.info("shutting down", extra={"grace_period_s": self.config.grace_period_s})
        self.server.stop(self.config.grace_period_s).wait()
        self.registry.close(drain_timeout=self.config.grace_period_s)  # queued jobs finish first
        if self.config.socket:
            Path(self.config.socket).unlink(missing_ok=True)
        log.info("stopped")


def serve(config: Config) -> int:
    """Run until SIGTERM or SIGINT; returns the exit code."""
    logs.setup(config.log_level, config.log_format)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    daemon = Daemon(config)
    daemon.start()
    while not stop.wait(0.5):
        pass
    daemon.stop()
    return 0
