"""``kvxfer health``: exit 0 when the daemon answers SERVING (an exec probe for Kubernetes).

Kubelet's gRPC probe reaches only TCP ports, and the daemon serves gRPC on a Unix
socket inside the pod; this command asks the standard gRPC health service over that
socket instead. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING while shutting
down, no answer within ``--timeout``, no daemon).
"""

from __future__ import annotations

import argparse
import sys

from kvxfer.client import Client
from kvxfer.errors import KvxferError


def run(args: argparse.Namespace) -> int:
    try:
        with Client(args.target, timeout=args.timeout) as client:
            status = client.health(timeout=args.timeout)
    except KvxferError as exc:
        print(f"kvxfer health: {args.target}: {exc}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="unix:/tmp/kvxfer.sock", help="the daemon's socket (unix:PATH)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
