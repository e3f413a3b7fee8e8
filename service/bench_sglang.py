"""``kvxfer bench sglang``: SGLang HiCache's batch set and get through kvxfer beside SGLang's file backend.

SGLang 0.5.23's own host pool (``--layout``, bf16 pages of ``--page-size`` tokens) and its own
storage-backend factory, in this process, against a real daemon; each repetition moves
``--pages`` pages in batches of 128 (SGLang's STORAGE_BATCH_SIZE) as SGLang's cache controller
calls its backend:

- ``kvxfer zero copy``: interface_v1 with host page indices, the host pool in SGLang's memfd
  (``allocator: shm``): the daemon copies pages out of it and into it;
- ``kvxfer staged``: the same with SGLang's default (private) host memory: one copy through
  the backend's staging area;
- ``file``: SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``) in ``--dir``, through
  the generic interface the controller uses for it (get_data_page + batch_set;
  get_dummy_flat_data_page + batch_get + set_from_flat_data_page);
- ``copy``: a plain copy of the same pages into another host buffer and back.

A set stores fresh keys every repetition; a get loads the pages the last set stored, into
zeroed pages, and the bytes are checked. The subjects are interleaved in every repetition.
Needs SGLang (``make test-sglang`` installs it into .venv-sglang).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time

import torch

from kvxfer.bench.common import GB, Progress, format_table, human_bytes, save
from service import launch
from service.config import DEFAULT_POOL

BATCH = 128


class Subject:
    """One way of storing SGLang's pages: ``put(keys, pages)`` and ``get(keys, pages)`` as the controller calls."""

    def __init__(self, name: str, pool, store, generic: bool) -> None:
        self.name, self.pool, self.store, self.generic = name, pool, store, generic

    def put(self, keys: list[str], indices: torch.Tensor) -> bool:
        if not self.generic:
            return all(self.store.batch_set_v1(keys, indices))
        size = self.pool.page_size
        data = [self.pool.get_data_page(indices[i * size], flat=True) for i in range(len(keys))]
        return bool(self.store.batch_set(keys, data))

    def get(self, keys: list[str], indices: torch.Tensor) -> bool:
        if not self.generic:
            return all(self.store.batch_get_v1(keys, indices))
        size = self.pool.page_size
        pages = self.store.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(pages):
            if page is None:
                return False
            self.pool.set_from_flat_data_page(indices[i * size], page)
        return True


def _batches(keys: list[str], indices: torch.Tensor, size: int):
    for start in range(0, len(keys), BATCH):
        yield keys[start:start + BATCH], indices[start * size:(start + BATCH) * size]


def _used(pool, pages: int) -> torch.Tensor:
    """The first ``pages`` host pages, as bytes (the ones the benchmark moves)."""
    from kvxfer.integrations.sglang.backend import host_geometry

    g = host_geometry(pool)
    return pool.kv_buffer.view(-1).view(g.shape).narrow(g.page_axis, 0, pages).view(torch.uint8)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    try:
        from kvxfer.integrations.sglang import drive
    except ImportError as exc:
        raise SystemExit(f"kvxfer bench sglang needs SGLang (make test-sglang installs it into .venv-sglang): {exc}")
    model = drive.Model(layers=args.layers, heads=args.heads, head_dim=args.head_size, page_size=args.page_size,
                        device_tokens=args.pages * args.page_size)
    small = {**DEFAULT_POOL, "spec": {**DEFAULT_POOL["spec"], "num_blocks": 16}, "host_capacity_mib": 4}
    daemon = launch.spawn({"pools": [small], "log_level": "warning", "registered_host_capacity_mib": args.host_mib})
    progress = Progress(2 * args.reps + 1)
    workdir = tempfile.mkdtemp(prefix="kvxfer-hicache-file-", dir=args.dir)
    subjects: list[Subject] = []
    try:
        for name, allocator in (("kvxfer zero copy", "shm"), ("kvxfer staged", "default")):
            pool = drive.host_pool(args.layout, allocator, model=model)
            extra = drive.extra_config(daemon.config["socket"], allocator, deadline_s=60.0, timeout_s=10.0)
            subjects.append(Subject(name, pool, drive.attach("dynamic", pool, extra), generic=False))
        pool = drive.host_pool(args.layout, "default", model=model)
        subjects.append(Subject("file", pool, drive.attach("file", pool, {"file_storage_path": workdir}),
                                generic=True))
        progress.step(f"daemon up; {len(subjects)} backends attached")
        results = _measure(args, subjects, progress)
    finally:
        for s in subjects:
            if hasattr(s.store, "close"):
                s.store.close()
        daemon.cleanup()
    print(format_table(["subject", "set pages/s", "set GB/s", "get pages/s", "get GB/s", "set / copy", "get / copy"],
                       [[r["subject"], r["set pages/s"], r["set GB/s"], r["get pages/s"], r["get GB/s"],
                         r["set / copy"], r["get / copy"]] for r in results["subjects"]],
                       {"x / copy": "time / a plain copy of the same pages's (median of per-repetition ratios)"}))
    print(f"{args.pages} pages of {human_bytes(results['page_bytes'])} ({args.layout}), batches of {BATCH}, "
          f"median of {args.reps} repetitions")
    save(args, results, plot)
    return 0


def _measure(args: argparse.Namespace, subjects: list[Subject], progress: Progress) -> dict:
    first = subjects[0].pool
    indices = first.alloc(args.pages * first.page_size)
    for s in subjects[1:]:
        assert torch.equal(s.pool.alloc(args.pages * s.pool.page_size), indices)
    page_bytes = first.get_data_page(0, flat=True).numel() * first.dtype.itemsize
    nbytes = args.pages * page_bytes
    spare = torch.empty_like(first.kv_buffer)
    times: dict[str, list[float]] = {f"{s.name} {op}": [] for s in subjects for op in ("set", "get")}
    times.update({"copy set": [], "copy get": []})
    for rep in range(args.reps):
        gen = torch.Generator().manual_seed(rep)
        for s in subjects:
            raw = s.pool.kv_buffer.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        times["copy set"].append(_timed(lambda: spare.copy_(first.kv_buffer)))
        keys = {s.name: [hashlib.sha256(f"{s.name}-{rep}-{i}".encode()).hexdigest() for i in range(args.pages)]
                for s in subjects}  # each its own pages: none finds another's stored
        for s in subjects:
            stored = []
            times[f"{s.name} set"].append(_timed(lambda: stored.extend(
                s.put(k, i) for k, i in _batches(keys[s.name], indices, s.pool.page_size))))
            if not all(stored):
                raise SystemExit(f"{s.name}: a batch set failed")
        progress.step(f"repetition {rep + 1}: sets")
        times["copy get"].append(_timed(lambda: first.kv_buffer.copy_(spare)))
        for s in subjects:
            expected = _used(s.pool, args.pages).clone()
            s.pool.kv_buffer.zero_()
            loaded = []
            times[f"{s.name} get"].append(_timed(lambda: loaded.extend(
                s.get(k, i) for k, i in _batches(keys[s.name], indices, s.pool.page_size))))
            if not all(loaded) or not torch.equal(_used(s.pool, args.pages), expected):
                raise SystemExit(f"{s.name}: a batch get failed or loaded other bytes")
        progress.step(f"repetition {rep + 1}: gets, bytes checked")
    rows = []
    for s in subjects + [Subject("copy", None, None, False)]:
        row = {"subject": s.name}
        for op in ("set", "get"):
            seconds = statistics.median(times[f"{s.name} {op}"])
            row[f"{op} pages/s"] = round(args.pages / seconds)
            row[f"{op} GB/s"] = round(nbytes / seconds / GB, 3)
            ratios = [a / b for a, b in zip(times[f"{s.name} {op}"], times[f"copy {op}"])]
            row[f"{op} / copy"] = round(statistics.median(ratios), 2)
        rows.append(row)
    return {"layout": args.layout, "pages": args.pages, "page_bytes": page_bytes, "reps": args.reps, "subjects": rows}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["subjects"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for j, op in enumerate(("set", "get")):
        ax.bar([i + j * width for i in range(len(rows))], [r[f"{op} GB/s"] for r in rows], width, label=f"batch {op}")
    ax.set_xticks([i + width / 2 for i in range(len(rows))], [r["subject"] for r in rows])
    ax.set_ylabel("GB/s of SGLang host pages")
    ax.set_title(f"SGLang HiCache L3: {results['pages']} pages of {human_bytes(results['page_bytes'])} "
                 f"({results['layout']})")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=1024, help="pages moved per repetition")
    p.add_argument("--page-size", type=int, default=16, help="tokens a page")
    # The embedded default pool's model (Qwen2.5-0.5B: 24 layers, 2 KV heads of 64), as in ``bench vllm``.
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=2, help="KV heads")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--layout", default="page_first", help="SGLang's --hicache-mem-layout")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--host-mib", type=int, default=4096, help="the daemon's host tier for registered pools")
    p.add_argument("--dir", default=None, help="where the file backend writes (default: the system's temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a bar chart here (PNG)")
