"""The ``kvxfer`` program: the library's tools plus the daemon's own subcommands."""

from __future__ import annotations

import argparse
import sys


def _serve_command(args: argparse.Namespace) -> int:
    from service import config, preflight, server  # the daemon's dependencies load only for `serve`

    overrides = {"socket": args.socket, "listen": args.listen, "metrics_listen": args.metrics_listen,
                 "log_level": args.log_level, "log_format": args.log_format,
                 "allow_overcommit": args.allow_overcommit or None}
    pool_overrides = {"device": args.device, "layout": args.layout, "num_blocks": args.num_blocks,
                      "host_capacity_mib": args.host_capacity_mib}
    cfg = config.load(args.config, overrides=overrides, pool_overrides=pool_overrides)
    if not args.check:
        return server.serve(cfg)
    cfg = preflight.check(cfg)
    preflight.reachable(cfg)
    for line in [*config.unknown_variables(), *cfg.notes]:
        print(f"warning: {line}")
    for p in cfg.pools:
        print(f"pool {p.id}: {p.device}, {p.layout.name}, {p.spec.num_blocks} blocks of {p.spec.block_bytes} bytes, "
              f"host tier {p.host_capacity_mib} MiB, cache group {p.cache_group or p.id}")
    print(f"memory: needs {preflight.memory_need(cfg).describe()}")
    print(f"listens on: {', '.join(filter(None, [cfg.socket and 'unix:' + cfg.socket, cfg.listen]))}; "
          f"/metrics on {cfg.metrics_listen or 'nothing'}")
    print("configuration OK (nothing was started or changed)")
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon (defaults: one CPU pool of a small model's geometry)",
                       description="Run the daemon. Settings come from defaults < --config YAML < KVXFER_* "
                                   "environment < these flags (docs/configuration.md lists every key).")
    p.add_argument("--config", help="YAML config file (docs/configuration.md; example: docs/kvxfer.example.yaml)")
    p.add_argument("--socket", help="Unix socket path (default /tmp/kvxfer.sock)")
    p.add_argument("--listen", help="HOST:PORT for TCP; needs TLS and a token in the config")
    p.add_argument("--metrics-listen", help="HOST:PORT of /metrics (default 127.0.0.1:9470; '' turns it off)")
    p.add_argument("--log-level", help="debug, info, warning or error (default info)")
    p.add_argument("--log-format", help="json (one object a line, for log pipelines; the default) or text")
    pools = p.add_argument_group("every configured pool (the embedded default pool when the config has none)")
    pools.add_argument("--device", help="auto, cpu, cuda or cuda:N (default auto: cuda:0 when a GPU is usable)")
    pools.add_argument("--layout", help="the pool's layout, e.g. BLHNC or LBHNC (default BLHNC)")
    pools.add_argument("--num-blocks", type=int, help="blocks in the pool (default 1024)")
    pools.add_argument("--host-capacity-mib", type=float, help="the host tier's size in MiB (default 512)")
    p.add_argument("--allow-overcommit", action="store_true",
                   help="start even when pools and tiers need more memory than is free here")
    p.add_argument("--check", action="store_true",
                   help="validate the configuration, devices and memory, print what would be served, and exit")
    p.set_defaults(func=_serve_command)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["health"]:  # an exec probe, every few seconds: gRPC only, nothing else imported
        from kvxfer.cli import health_cmd

        return health_cmd.main(args[1:])
    from kvxfer.cli import commands

    return commands.main(args, commands=[_serve_parser])


def parser() -> argparse.ArgumentParser:
    """The whole ``kvxfer`` command line (the docs check parses every documented command with it)."""
    from kvxfer.cli import commands

    return commands.build_parser([_serve_parser])


if __name__ == "__main__":
    sys.exit(main())
