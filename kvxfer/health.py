"""``kvxfer health``: exit 0 when the daemon answers SERVING (an exec probe for Kubernetes).

Kubelet's gRPC probe reaches only TCP ports, and the daemon serves gRPC on a Unix
socket inside the pod; this command asks the standard gRPC health service over that
socket instead. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING while shutting
down, no answer within ``--timeout``, no daemon).

A probe runs every few seconds in every pod, so this imports gRPC and the health
stubs only (never torch or the client library): ``kvxfer health`` is dispatched here
before the rest of the program is imported. Over TCP (TLS and a token) it uses the
full client.
"""

from __future__ import annotations

import argparse
import sys


def check(target: str, timeout: float) -> str:
    """The health status the daemon at ``target`` reports ("SERVING", "NOT_SERVING", ...)."""
    if not target.startswith("unix:"):
        from kvxfer.client import Client  # TLS and the token: the client knows how

        with Client(target, timeout=timeout) as client:
            return client.health(timeout=timeout)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def run(args: argparse.Namespace) -> int:
    import grpc

    try:
        status = check(args.target, args.timeout)
    except grpc.RpcError as exc:
        print(f"kvxfer health: {args.target}: no answer ({exc.code().name}): is the daemon running there?",
              file=sys.stderr)
        return 1
    except Exception as exc:  # the full client's errors over TCP: one line, never a traceback in a probe
        print(f"kvxfer health: {args.target}: {exc}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="unix:/tmp/kvxfer.sock", help="the daemon's socket (unix:PATH)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")


def main(argv: list[str]) -> int:
    """``kvxfer health ARGS`` without the rest of the program."""
    parser = argparse.ArgumentParser(prog="kvxfer health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
