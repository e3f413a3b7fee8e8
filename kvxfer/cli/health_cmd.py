"""``kvxfer health``: exit 0 when the daemon answers SERVING (an exec probe for Kubernetes).

Kubelet's gRPC probe reaches only TCP ports, and the daemon serves gRPC on a Unix
socket inside the pod; this command asks the standard gRPC health service over that
socket instead. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING while shutting
down, no answer within ``--timeout``, no daemon, a TLS handshake that fails). A TCP
target needs ``--ca`` (the CA that signed the daemon's certificate) and ``--token-file``.

A probe runs every few seconds in every pod, so this imports gRPC and the health
stubs only (never torch or the client library): ``kvxfer health`` is dispatched here
before the rest of the program is imported. Over TCP (TLS and a token) it uses the
full client.
"""

from __future__ import annotations

import argparse
import os
import sys


def check(target: str, timeout: float, ca: bytes | None = None, token: str | None = None) -> str:
    """The health status the daemon at ``target`` reports ("SERVING", "NOT_SERVING", ...)."""
    if not target.startswith("unix:"):
        from kvxfer.client import Client  # TLS and the token: the client knows how

        with Client(target, timeout=timeout, root_certificates=ca, token=token) as client:
            return client.health(timeout=timeout)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout,
                                                             metadata=metadata)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)



def run(args: argparse.Namespace) -> int:
    import grpc
    from pathlib import Path

    try:
        ca = Path(args.ca).read_bytes() if args.ca else None
        token = Path(args.token_file).read_text().strip() if args.token_file else None
    except OSError as exc:
        print(f"kvxfer health: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        status = check(args.target, args.timeout, ca, token)
    except grpc.RpcError as exc:  # the socket: nothing there, or a daemon that does not answer in time
        print(f"kvxfer health: {args.target}: no answer ({exc.code().name}): is the daemon running there?",
              file=sys.stderr)
        return 1
    except Exception as exc:  # the full client's errors over TCP (a TLS failure named): one line, never a traceback
        print(f"kvxfer health: {args.target}: {exc}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="unix:/tmp/kvxfer.sock", help="the daemon's socket (unix:PATH)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    p.add_argument("--ca", help="a TCP target: the CA certificate (PEM) that signed the daemon's certificate")
    p.add_argument("--token-file", help="a file holding the daemon's token (its token_file)")


def main(argv: list[str]) -> int:
    """``kvxfer health ARGS`` without the rest of the program."""
    # gRPC's core would log a failed TLS handshake itself, on stderr: the probe's one line says it.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = argparse.ArgumentParser(prog="kvxfer health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
