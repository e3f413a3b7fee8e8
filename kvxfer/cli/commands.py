"""The library's command-line tools: one subcommand per tool, each registered in COMMANDS.

The ``kvxfer`` program (``service.program``) adds the daemon's own subcommands
(``serve``, ``bench daemon``) to these; the library never imports the daemon.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvxfer.core.errors import InvalidArgument, KvxferError
from kvxfer.geometry.names import DTYPE_NAMES, PRESET_NAMES

if TYPE_CHECKING:
    from kvxfer.geometry.layout import KVSpec


def add_spec_arguments(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Pool geometry flags shared by every subcommand that needs a KVSpec."""
    d = {"layers": 4, "blocks": 4, "block_size": 4, "heads": 2, "head_size": 2, "dtype": "bfloat16",
         "layout": "BLHNC", **(defaults or {})}
    parser.add_argument("--layers", type=int, default=d["layers"], help="number of layers (L)")
    parser.add_argument("--blocks", type=int, default=d["blocks"], help="number of physical blocks (B)")
    parser.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per block (N)")
    parser.add_argument("--heads", type=int, default=d["heads"], help="KV heads (H)")
    parser.add_argument("--head-size", type=int, default=d["head_size"], help="elements per head vector (D)")
    parser.add_argument("--dtype", default=d["dtype"], choices=sorted(DTYPE_NAMES), help="element type")
    parser.add_argument("--kv-parts", type=int, default=2, choices=(1, 2),
                        help="2: K and V; 1: one latent vector a token (MLA: --heads 1 --head-size 576)")
    parser.add_argument("--layout", default=d["layout"],
                        help=f"a preset ({', '.join(PRESET_NAMES)}) or axes like L,KV,B,N,H,D")


def spec_from_args(args: argparse.Namespace) -> KVSpec:
    from kvxfer.geometry.layout import KVSpec, parse_dtype  # (torch: only when a command runs)

    return KVSpec(args.layers, args.blocks, args.block_size, args.heads, args.head_size, parse_dtype(args.dtype),
                  args.kv_parts)


SHOWN_BLOCKS = 16  # blocks ``kvxfer layout`` prints unless --all (``--blocks 4096`` printed 7.4 MB)


def _layout_command(args: argparse.Namespace) -> int:
    from kvxfer.geometry.layout import Layout, PoolLayout
    from kvxfer.geometry.sharding import Sharding, stored_format
    from kvxfer.transfer.plan import shard_pieces

    spec, sharding = spec_from_args(args), None
    if args.tp_size > 1 or args.tp_rank:  # --heads is the model's: the pool is the rank's share
        sharding = Sharding("layout", args.tp_rank, args.tp_size, spec.num_kv_heads)
        first, end = sharding.heads
        spec = dataclasses.replace(spec, num_kv_heads=end - first)
    pool_layout = PoolLayout(spec, Layout.parse(args.layout))
    info = pool_layout.describe()
    if sharding is not None:
        canonical, _ = stored_format(pool_layout, sharding)
        offsets, places, length = shard_pieces(pool_layout, canonical, sharding.heads[0])
        info["canonical"] = {"tp_rank": sharding.tp_rank, "tp_size": sharding.tp_size, "heads": list(sharding.heads),
                             "block_bytes": canonical.block_bytes,
                             "pieces": [[int(o), int(p), length] for o, p in zip(offsets, places)]}
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    print(f"layout {info['layout']} ({info['order']}), dtype {info['spec']['dtype']}")
    print("byte strides: " + ", ".join(f"s_{axis}={stride}" for axis, stride in info["strides"].items()))
    print(f"pool {info['nbytes']} B, block {info['block_bytes']} B over all layers, "
          f"{info['runs_per_block']} run(s) per block")
    shown = len(info["block_runs"]) if args.all else min(len(info["block_runs"]), SHOWN_BLOCKS)
    blocks = range(shown)
    print("\npage offset(layer, block) in bytes")
    print("layer " + "".join(f"{'P' + str(b):>10}" for b in blocks))
    for layer, row in enumerate(info["page_offsets"]):
        print(f"{layer:>5} " + "".join(f"{offset:>10}" for offset in row[:shown]))
    print("\nblock runs [offset, end)")
    for block, runs in enumerate(info["block_runs"][:shown]):
        print(f"P{block}: " + " ".join(f"[{o},{o + n})" for o, n in runs))
    if shown < len(info["block_runs"]):
        print(f"... the first {shown} of {len(info['block_runs'])} blocks (every block: --all, or --json)")
    if sharding is not None:
        c = info["canonical"]
        print(f"\nrank {c['tp_rank']} of {c['tp_size']} holds heads [{c['heads'][0]}, {c['heads'][1]}) of the model's "
              f"{sharding.total_kv_heads}; a canonical block (L,H,N,KV,D of every head) is {c['block_bytes']} B")
        print("its pieces of block P0 -> their offsets in the canonical block: "
              + " ".join(f"[{o},{o + n})->{p}" for o, p, n in c["pieces"]))
    return 0


def _layout_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="print strides, page offsets and block runs of a pool layout")
    add_spec_arguments(p)
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (--heads: the model's KV heads)")
    p.add_argument("--tp-rank", type=int, default=0, help="the rank whose pool and canonical pieces to print")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all", action="store_true", help=f"print every block (else the first {SHOWN_BLOCKS})")
    p.set_defaults(func=_layout_command)


class _BenchHelp(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's text as written, and every option's default."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A subcommand whose module (``add_arguments``, ``run``, its docstring) is imported only when the
    command line names it: ``kvxfer --help`` lists every tool without importing torch through them."""

    name: str
    help: str
    module: str
    formatter: type[argparse.HelpFormatter] = argparse.RawDescriptionHelpFormatter

    def register(self, sub: argparse._SubParsersAction, load: bool) -> None:
        if not load:
            sub.add_parser(self.name, help=self.help)
            return
        module = importlib.import_module(self.module)
        p = sub.add_parser(self.name, help=self.help, description=module.__doc__, formatter_class=self.formatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)


#: A subcommand defined in place (it imports nothing heavy to build its parser).
Command = Callable[[argparse._SubParsersAction], None]

#: ``kvxfer bench NAME``: (name, module, help); each module has ``add_arguments`` and ``run``.
BENCHES: list[tuple[str, str, str]] = [
    ("store", "kvxfer.bench.store_core", "offload/restore throughput of the store core"),
    ("kernels", "kvxfer.bench.kernels", "slot mapping and cache write (torch path)"),
    ("checksum", "kvxfer.bench.checksum", "the block checksum on the host against a plain copy"),
    ("bookkeeping", "kvxfer.bench.bookkeeping", "per-block cost of validation, index and outcomes, alone"),
    ("disk", "kvxfer.bench.disk", "the disk tier's demotion and promotion beside plain file I/O"),
    ("remote", "kvxfer.bench.remote", "the remote tier's stores and fetches beside raw redis-py SET/GET"),
    ("object", "kvxfer.bench.object", "the object tier against obstore's and boto3's PUT/GET on a real S3 server"),
    ("mooncake", "kvxfer.bench.mooncake", "the Mooncake Store tier beside the store's own put/get and batch calls"),
    ("mooncake-restore", "kvxfer.bench.mooncake_restore",
     "a Restore of blocks only Mooncake holds, through a daemon, beside the bare batch_get_into"),
    ("scale", "kvxfer.bench.scale", "the index of a tier of millions of blocks, fragmented and shuffled"),
    ("shards", "kvxfer.bench.shards", "cross-rank canonical blocks beside the same bytes per rank"),
    ("policy", "kvxfer.bench.policy", "a request trace through the index: LRU and Belady's hit ratio by tier size"),
    ("policy-bounds", "kvxfer.bench.policy_bounds",
     "what a policy would need to know: oracles of a block's future from its past, a fitted hazard, a queue"),
    ("trace", "kvxfer.bench.traces", "a synthetic request trace (chats, agents, a shared system prompt, scans)"),
    ("hints", "kvxfer.bench.hints", "a prefetched load against a disk read and a host hit; a hint storm's cost"),
    # through real daemons (``kvxfer serve`` processes: kvxfer.bench.launch)
    ("daemon", "kvxfer.bench.daemon", "throughput and latency through a real daemon"),
    ("lane", "kvxfer.bench.lane", "Offload, Restore and Lookup over the local lane against gRPC"),
    ("vllm", "kvxfer.bench.vllm", "vLLM's scheduler loading 1,024 blocks through the kvxfer backend"),
    ("engine", "kvxfer.bench.engine.ttft", "a real vLLM CPU engine's time to first token with kvxfer and without"),
    ("engine-replay", "kvxfer.bench.engine.replay",
     "a multi-turn trace through a real vLLM CPU engine: TTFT p50/p99, tokens/s, hit ratio, with kvxfer and without"),
    ("vllm-prefetch", "kvxfer.bench.vllm_prefetch", "a request whose blocks are on disk, prefetched while it waits"),
    ("vllm-fetch", "kvxfer.bench.vllm_fetch",
     "a request whose prefix only a peer holds, with a router's kv.fetch and without"),
    ("lmcache", "kvxfer.bench.lmcache", "kvxfer beside LMCache 0.5.6 on CPU, each against a plain copy"),
    ("demotion", "kvxfer.bench.demotion", "host-tier evictions reaching the disk under several clients"),
    ("events", "kvxfer.bench.events", "offloads with 100 KV event subscribers against none"),
    ("sglang", "kvxfer.bench.sglang", "SGLang HiCache's write-through and prefetch, beside its files"),
    ("peer-transfer", "kvxfer.bench.peer_transfer",
     "one daemon restoring blocks another holds, over NIXL, against a plain memcpy"),
    ("steps", "kvxfer.bench.steps", "where a command's requests spend their time, step by step, in every process"),
]


#: The library's tools; ``kvxfer bench`` is added after them.
COMMANDS: list[Command | Tool] = [
    _layout_parser,
    Tool("devcheck", "on a GPU machine: check the GPU path (exit 3 without a GPU)", "kvxfer.devcheck.__main__"),
    Tool("status", "the daemon at a glance: pools, tiers, hit ratio, bandwidth, jobs", "kvxfer.cli.status_cmd"),
    Tool("health", "exit 0 when the daemon is SERVING (a Kubernetes exec probe)", "kvxfer.cli.health_cmd"),
    Tool("events", "the tiers' KV events, a line a batch (--follow: like kubectl get --watch)",
         "kvxfer.cli.events_cmd"),
    Tool("hint", "tell the daemon what is coming: prefetch, retain, release keys", "kvxfer.cli.hint_cmd"),
    Tool("demo", "a conversation with a small vLLM CPU engine, with kvxfer and without: TTFT and hits "
         "(needs vLLM's CPU build: make demo)", "kvxfer.bench.engine.demo")]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvxfer")
    except PackageNotFoundError:  # (run from a checkout that was never installed)
        return "unknown (not installed)"


def build_parser(commands: list[Command | Tool] | None = None, benches: list[tuple[str, str, str]] | None = None,
                 argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvxfer`` parser: the library's tools, plus ``commands`` and ``benches`` (the daemon's).

    With ``argv``, only the tool it names is loaded whole (the others are listed by name and help);
    without, every tool is (the docs' check parses every documented command)."""
    words = [word for word in argv or [] if not word.startswith("-")]
    chosen = words[:2] if argv is not None else None

    def wanted(*path: str) -> bool:
        return chosen is None or chosen[:len(path)] == list(path)

    parser = argparse.ArgumentParser(prog="kvxfer", description="KV-cache offload and transfer daemon and tools")
    parser.add_argument("--version", action="version", version=f"kvxfer {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in [*COMMANDS, *(commands or [])]:
        if isinstance(command, Tool):
            command.register(sub, wanted(command.name))
        else:
            command(sub)
    bench = sub.add_parser("bench", help="benchmarks, each beside a baseline measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module, text in BENCHES + (benches or []):
        Tool(name, text, module, _BenchHelp).register(bench_sub, wanted("bench", name))
    return parser


def main(argv: list[str] | None = None, commands: list[Command | Tool] | None = None,
         benches: list[tuple[str, str, str]] | None = None) -> int:
    """Parse and run one subcommand; a bad input is one line on stderr and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(commands, benches, argv).parse_args(argv)
    try:
        return args.func(args)
    except InvalidArgument as exc:  # bad input or configuration
        print(f"kvxfer {args.command}: {exc}", file=sys.stderr)
        return 2
    except KvxferError as exc:  # could not run (e.g. another daemon on the socket)
        print(f"kvxfer {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`| head`): not an error, and no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
