"""The device check's canonical-blocks stage: TP=4 rank pools on the GPU assemble canonical blocks and a
TP=1 pool restores them, checked head by head, beside the same bytes per rank (``kvxfer bench shards``)."""

from __future__ import annotations

import argparse

from kvxfer.bench import shards
from kvxfer.geometry.layout import Layout

#: A 32-layer model of 8 KV heads of 128 bf16 elements, blocks of 16 tokens: 2 MiB canonical blocks,
#: 512 KiB a rank; 512 MiB of whole blocks a measurement.
ARGS = argparse.Namespace(tp=4, heads=8, layers=32, batch=64, min_mib=512, reps=3, threads=0)


def canonical_blocks(ctx: dict, args: argparse.Namespace = ARGS) -> dict:
    return {"results": [shards.measure(args, Layout.parse(name), device="cuda:0") for name in ("BLHNC", "LBHNC")]}
