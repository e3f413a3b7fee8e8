"""``kvxfer bench mooncake-restore``: a Restore of blocks only the Mooncake Store holds, through a real daemon,
beside the store's own client reading the same values.

A daemon (its own process, one CPU pool whose host tier holds ``--blocks`` blocks of ``--block-kib`` KiB, a
``mooncake`` section whose values carry the MAC ``--mac`` names: keyed BLAKE3 by default), a
``mooncake_master``, and a second daemon that
only lends the cluster its memory (so that the daemon and the baseline both read over the network, as from
another node), all on loopback over TCP.
Each round, untimed: ``--blocks`` new blocks of random bytes are offloaded, as many more push them out of the
host tier into the cluster, and those are deleted again (the host tier has room: the Restore evicts nothing).
Timed, in turn: the engine's Restore of the blocks into its pool (one call: the daemon asks the store, reads
the values, checks header, MAC and checksum, and copies each block into the pool), then the baseline, a bare
client of the same cluster in this process reading the same values into registered memory with one
``batch_get_into`` (the API alone: no record, no checks, no copy into a pool). Wall time, and CPU time of
every process involved (``kvxfer.bench.cpu_time``: the daemon, this process, the master, the segment's
holder; the baseline is not charged for the idle daemon). Every byte is compared after each round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvxfer.bench.common import GB, wait_for

NAMESPACE = "bench"
MACS = ("blake3", "hmac-sha256", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-kib", type=int, default=192, help="a multiple of 32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mac", nargs="+", choices=MACS, default=["blake3"],
                   help="the daemon's mooncake.mac, a run each (none: no secret_file, values without a MAC)")
    p.add_argument("--json", help="write the figures here too (a list: one entry a run)")
    p.add_argument("--plot", help="a PNG of each run's ratios to the bare call, wall and CPU")


def run(args: argparse.Namespace) -> int:
    if args.block_kib % 32 or args.blocks < 1:
        raise SystemExit("--block-kib: a multiple of 32; --blocks: at least 1")
    results = [_run_one(args, mac) for mac in args.mac]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        _plot(results, args.plot)
    return 0


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    where = range(len(results))
    ax.bar([x - 0.2 for x in where], [r["wall_ratio"] for r in results], 0.4, label="wall clock")
    ax.bar([x + 0.2 for x in where], [r["cpu_ratio"] for r in results], 0.4, label="CPU time")
    ax.axhline(1.3, color="grey", linestyle="--", linewidth=1, label="target 1.3x")
    ax.set_xticks(list(where), [f"mac: {r['mac']}" for r in results])
    ax.set_ylabel("Restore / bare batch_get_into")
    ax.set_title(f"A Restore of {results[0]['blocks']} blocks of {results[0]['block_kib']} KiB from Mooncake")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _run_one(args: argparse.Namespace, mac: str) -> dict:
    import tempfile

    import numpy as np
    import torch

    from kvxfer.bench import launch
    from kvxfer.bench.cpu_time import CpuMeter, Figures, measured
    from kvxfer.bench.mooncake_master import MooncakeMaster
    from kvxfer.client import Client
    from kvxfer.core.records import Outcome, TierKind
    from kvxfer.tiers.record import MAC_BYTES, header_length

    n, nbytes = args.blocks, args.block_kib << 10
    spec = {"num_layers": args.block_kib // 32, "num_blocks": n + 1, "block_size": 16, "num_kv_heads": 8,
            "head_size": 64, "dtype": "float16"}  # 32 KiB a layer
    pool = {"id": "rank0", "device": "cpu", "layout": "BLHNC", "spec": spec, "host_capacity_mib": n * nbytes / 2**20}
    rounds = args.reps + 1
    segment_mib = max(64, int(rounds * 2 * n * (nbytes + 4096) * 1.3) >> 20)  # every round's values, under 90 %
    workdir = Path(tempfile.mkdtemp(prefix="kvxmcr"))
    secret = workdir / "secret"
    secret.write_text("a-bench-secret-of-at-least-32-bytes\n")
    master = MooncakeMaster()
    sealed = mac != "none"
    section = master.section(max_inflight=2 * n, timeout_ms=30_000,
                             **({"secret_file": str(secret), "mac": mac} if sealed else {}))
    # The cluster's memory is a third node's (a daemon that only lends it): both readers fetch over the network.
    holder = launch.spawn({"pools": [{**pool, "spec": {**spec, "num_blocks": 4}, "host_capacity_mib": 1}],
                           "mooncake": {**section, "segment_mib": segment_mib}})
    daemon = launch.spawn({"pools": [pool], "mooncake": {**section, "segment_mib": 0}})
    from mooncake.store import MooncakeDistributedStore

    bare = MooncakeDistributedStore()
    if bare.setup("127.0.0.1", master.metadata, 0, 64 << 20, "tcp", "", master.master) != 0:
        raise SystemExit("a bare client could not join the bench's cluster")
    value_bytes = header_length(NAMESPACE, b"r0000-00000") + nbytes + (MAC_BYTES if sealed else 0)
    landing = np.zeros((n, value_bytes), dtype=np.uint8)
    assert bare.register_buffer(landing.ctypes.data, landing.nbytes) == 0
    client = Client(daemon.target, NAMESPACE, pool_id="rank0", timeout=120)
    storage = client.map_pool().storage
    state: dict = {"round": 0}

    def prepare() -> None:
        """New blocks, pushed out of the host tier into the cluster (untimed)."""
        r = state["round"] = state["round"] + 1
        keys, filler = [b"r%04d-%05d" % (r, i) for i in range(n)], [b"f%04d-%05d" % (r, i) for i in range(n)]
        data = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8)
        storage[nbytes:(n + 1) * nbytes].copy_(data.view(-1))
        assert client.offload(list(zip(range(1, n + 1), keys))).outcomes == [Outcome.DONE] * n
        assert client.offload(list(zip(range(1, n + 1), filler))).outcomes == [Outcome.DONE] * n
        wait_for(lambda: client.lookup(keys).tiers == [TierKind.MOONCAKE] * n, "the blocks reached the cluster")
        client.delete(filler)
        storage[nbytes:(n + 1) * nbytes].zero_()
        state.update(keys=keys, data=data)

    def restore() -> None:
        result = client.restore(list(zip(state["keys"], range(1, n + 1))), partial=True)
        assert result.outcomes == [Outcome.DONE] * n, [o.value for o in result.outcomes if o is not Outcome.DONE][:4]

    def batch_get() -> None:
        names = [f"kvxfer:rank0/{NAMESPACE}/{k.hex()}" for k in state["keys"]]
        sizes = bare.batch_get_into(names, [row.ctypes.data for row in landing], [value_bytes] * n)
        assert all(s == value_bytes for s in sizes), sizes[:4]

    def check() -> None:
        data = state["data"].numpy()
        assert np.array_equal(storage[nbytes:(n + 1) * nbytes].view(n, nbytes).numpy(), data)
        split = value_bytes - nbytes - (MAC_BYTES if sealed and mac == "hmac-sha256" else 0)  # (blake3: MAC first)
        assert np.array_equal(landing[:, split:split + nbytes], data)
        print(f"round {state['round']}/{rounds} done", flush=True)

    meters = {"daemon Restore": CpuMeter([daemon.proc.pid, master.proc.pid, holder.proc.pid]),
              "batch_get_into (bare)": CpuMeter([master.proc.pid, holder.proc.pid])}
    try:
        samples = measured({"daemon Restore": restore, "batch_get_into (bare)": lambda: (batch_get(), check())},
                           args.reps, meters, setup={"daemon Restore": prepare})
    finally:
        client.close()
        bare.close()
        daemon.cleanup()
        holder.cleanup()
        master.close()
    figures = Figures.of(samples["daemon Restore"], samples["batch_get_into (bare)"], n * nbytes)
    base = samples["batch_get_into (bare)"]
    print(f"\n{n} blocks of {args.block_kib} KiB ({n * nbytes / 2**20:.0f} MiB), mac: {mac}"
          f", median of {args.reps} (after a warm-up round); the values in a third node's segment, everything on "
          "loopback over TCP")
    print(f"{'':24} {'wall ms':>9} {'GB/s':>7} {'CPU ms':>8} {'CPU s/GB':>9}")
    for name, wall, cpu in (("daemon Restore", figures.wall_ms, figures.cpu_ms),
                            ("batch_get_into (bare)", base.median_wall() * 1e3, base.median_cpu() * 1e3)):
        print(f"{name:24} {wall:9.1f} {n * nbytes / (wall / 1e3) / GB:7.2f} {cpu:8.1f} "
              f"{cpu / 1e3 / (n * nbytes / GB):9.3f}")
    print(f"Restore / bare: wall {figures.wall_ratio:.2f}x, CPU {figures.cpu_ratio:.2f}x (medians of per-round "
          "ratios); CPU: the daemon's (not the baseline's), this process's, the master's and the segment holder's")
    return {"blocks": n, "block_kib": args.block_kib, "mac": mac, **figures.as_dict(),
            "base_wall_ms": base.median_wall() * 1e3, "base_cpu_ms": base.median_cpu() * 1e3}

