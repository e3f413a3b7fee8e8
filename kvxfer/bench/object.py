"""``kvxfer bench object``: the object tier's stores, fetches and lookups beside the raw client's.

``--blocks`` blocks of ``--block-kib`` KiB are stored by the object tier (copied into its staging
buffers, then its writer: a header and the block per object, conditional puts, ``--workers`` at
once) and fetched back (concurrent GETs, header and XXH3 checked, copied into host-slot-sized
buffers); a Lookup of as many keys no one stored (concurrent HEADs) is timed too. Beside them, in
the same process and run, with the same concurrency: obstore's own ``put`` and ``get`` of objects
of the same size, and boto3's ``put_object`` and ``get_object`` (the client the tier did not
choose). Against a ``weed mini`` (SeaweedFS) started here on loopback, or ``--endpoint``.
"""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from kvxfer.bench.object_rounds import main  # (obstore, boto3, SeaweedFS: only when the benchmark runs)

    return main(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--block-kib", type=int, default=192)
    p.add_argument("--workers", type=int, default=16, help="calls in flight at once (the tier's object.workers)")
    p.add_argument("--reps", type=int, default=3)
