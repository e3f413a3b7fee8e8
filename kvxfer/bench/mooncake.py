"""``kvxfer bench mooncake``: the Mooncake Store tier's stores and fetches beside the store's own client.

``--blocks`` blocks of ``--block-kib`` KiB go down through the tier (copied into its registered staging
buffers, header and MAC written in place, ``batch_put_from`` a batch at a time) and come back (one
``batch_is_exist``, then ``batch_get_into_multi_buffers``: each block straight into its slot of a registered
host-tier-like buffer, its header beside it, both checked there). Beside them, in the same process and run, on
the same bytes and through the same client (its segment, its transport): the store's plain ``put`` and ``get``
of each block (what a client that does not register memory does), and its zero-copy ``batch_put_from``
and ``batch_get_into`` of the bare blocks (the floor: the API alone, no record, no checks). Wall and CPU
time of each (this process's and the master's, ``kvxfer.bench.cpu_time``); against a ``mooncake_master``
started here on loopback (TCP), the client lending the cluster its memory (so its values land in its
own segment: a one-node cluster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvxfer.bench.cpu_time import CpuMeter

ROWS = ("tier: store", "tier: fetch", "plain put", "plain get", "batch_put_from (bare)", "batch_get_into (bare)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-kib", type=int, default=192)
    p.add_argument("--reps", type=int, default=3)


def _timed(fn: Callable[[], object], meter: CpuMeter) -> tuple[float, float]:
    """(wall s, CPU s of this process and the master)."""
    wall, cpu = time.perf_counter(), meter.now()
    fn()
    return time.perf_counter() - wall, meter.now() - cpu


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from kvxfer.bench.mooncake_master import MooncakeMaster
    from kvxfer.geometry.block_checksum import block_checksum
    from kvxfer.tiers.mooncake.settings import parse
    from kvxfer.tiers.mooncake.store import BATCH, MooncakeTier

    nbytes, n = args.block_kib << 10, args.blocks
    # Room for every round's values (the tier's, the plain client's, the bare ones), under Mooncake's eviction mark.
    segment_mib = max(64, int(args.reps * 3 * n * (nbytes + 8192) * 1.3) >> 20)
    master = MooncakeMaster()
    meter = CpuMeter([master.proc.pid])
    figures: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
    try:
        settings = parse({**master.section(), "segment_mib": segment_mib, "max_inflight": n, "timeout_ms": 30_000,
                          "secret_file": ""})
        host = torch.empty((n, nbytes), dtype=torch.uint8)  # the host tier's slots (registered: read straight in)
        tier = MooncakeTier(settings, "bench", b"f" * 32, nbytes, host_memory=(host.data_ptr(), host.numel()))
        plain = tier.client.call(lambda store: store)  # the same client: the same segment, the same transport
        blocks = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8)
        bare = np.ascontiguousarray(blocks.numpy())
        landing = np.empty_like(bare)
        assert plain.register_buffer(bare.ctypes.data, bare.nbytes) == 0
        assert plain.register_buffer(landing.ctypes.data, landing.nbytes) == 0
        sums = [block_checksum(b) for b in bare]
        slots = list(host)
        for rep in range(args.reps):
            keys = [b"r%d-%05d" % (rep, i) for i in range(n)]
            names = [f"plain/{rep}/{i}" for i in range(n)]
            bare_names = [f"bare/{rep}/{i}" for i in range(n)]

            def store() -> None:
                tier.stage("ns", [(k, c, blocks[i]) for i, (k, c) in enumerate(zip(keys, sums))])
                assert tier.flush(120)

            def fetch() -> None:
                fetched = tier.fetch("ns", keys)
                verdicts = fetched.read(list(enumerate(slots)))
                assert len(fetched.keys) == n and all(v[0].value == "done" for v in verdicts), verdicts[:3]

            def batched(call: Callable, names_: list[str], rows: np.ndarray) -> None:
                for first in range(0, n, BATCH):
                    chunk = range(first, min(n, first + BATCH))
                    codes = call([names_[i] for i in chunk], [rows[i].ctypes.data for i in chunk],
                                 [nbytes] * len(chunk))
                    assert all(c >= 0 for c in codes), codes

            figures["tier: store"].append(_timed(store, meter))
            figures["tier: fetch"].append(_timed(fetch, meter))
            figures["plain put"].append(_timed(lambda: [plain.put(name, b) for name, b in zip(names, bare)], meter))
            figures["plain get"].append(_timed(lambda: [plain.get(name) for name in names], meter))
            figures["batch_put_from (bare)"].append(_timed(lambda: batched(plain.batch_put_from, bare_names, bare),
                                                           meter))
            figures["batch_get_into (bare)"].append(_timed(lambda: batched(plain.batch_get_into, bare_names, landing),
                                                           meter))
            assert all(torch.equal(s, blocks[i]) for i, s in enumerate(slots)) and np.array_equal(landing, bare)
            print(f"round {rep + 1}/{args.reps} done", flush=True)
        events = tier.stats().events
        tier.close(5)
    finally:
        master.close()
    total = n * nbytes
    print(f"\n{n} blocks of {args.block_kib} KiB ({total / 2**20:.0f} MiB), median of {args.reps}, one process, "
          f"mooncake_master on loopback over TCP; tier events: {events}")
    print(f"{'':24} {'wall ms':>9} {'GB/s':>7} {'CPU ms':>8} {'CPU s/GB':>9} {'CPU / bare':>10}")
    for i, row in enumerate(ROWS):
        wall = statistics.median(w for w, _ in figures[row])
        cpu = statistics.median(c for _, c in figures[row])
        bare_row = ROWS[4 + i % 2]  # (ROWS alternate: a put, then a get)
        ratio = statistics.median(c / max(b, 1e-9) for (_, c), (_, b) in zip(figures[row], figures[bare_row]))
        print(f"{row:24} {wall * 1e3:9.1f} {total / wall / 1e9:7.2f} {cpu * 1e3:8.1f} {cpu / (total / 1e9):9.3f} "
              f"{ratio:10.2f}")
    print("CPU: user and system seconds of this process and the master, from each one's CPU clock; CPU / bare: "
          "median of per-round ratios to the bare zero-copy call of the same direction")
    return 0
