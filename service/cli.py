"""The ``kvxfer`` program: the library's tools plus the daemon's own subcommands."""

from __future__ import annotations

import argparse
import sys

#: ``kvxfer bench daemon`` starts a real daemon, so it lives beside it.
DAEMON_BENCHES = [("daemon", "service.bench_daemon", "throughput and latency through a real daemon"),
                  ("vllm", "service.bench_vllm", "vLLM's scheduler loading 1,024 blocks through the kvxfer backend"),
                  ("peer", "service.bench_peer", "kvxfer beside LMCache 0.5.6 on CPU, each against a plain copy"),
                  ("demotion", "service.bench_demotion", "host-tier evictions reaching the disk under several clients")]


def _serve_command(args: argparse.Namespace) -> int:
    from service import config, server  # the daemon's dependencies load only for `serve`

    overrides = {"socket": args.socket, "listen": args.listen, "metrics_listen": args.metrics_listen,
                 "log_level": args.log_level}
    cfg = config.load(args.config, overrides=overrides)
    return server.serve(cfg)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon (defaults: one CPU pool of a small model's geometry)")
    p.add_argument("--config", help="YAML config file (see README: Configuration)")
    p.add_argument("--socket", help="Unix socket path (default /tmp/kvxfer.sock)")
    p.add_argument("--listen", help="HOST:PORT for TCP; needs TLS and a token in the config")
    p.add_argument("--metrics-listen", help="HOST:PORT of /metrics (default 127.0.0.1:9400; '' turns it off)")
    p.add_argument("--log-level", help="debug, info, warning or error")
    p.set_defaults(func=_serve_command)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["health"]:  # an exec probe, every few seconds: gRPC only, nothing else imported
        from kvxfer import health

        return health.main(args[1:])
    from kvxfer import cli

    return cli.main(args, commands=[_serve_parser], benches=DAEMON_BENCHES)


if __name__ == "__main__":
    sys.exit(main())
