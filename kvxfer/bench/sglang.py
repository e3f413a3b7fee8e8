"""``kvxfer bench sglang``: SGLang HiCache's write-through and prefetch through kvxfer beside SGLang's file backend.

SGLang 0.5.23's own ``HiCacheController`` (its backup, prefetch, I/O and sync threads) over a
CPU device pool and its own host pool (``--layout``, bf16 pages of ``--page-size`` tokens), in
this process, against a real daemon (``kvxfer.bench.sglang_engine.Controller``). Each
repetition writes ``--pages`` fresh pages through to storage (``write_storage``: batch sets of
128 pages, SGLang's STORAGE_BATCH_SIZE) and then prefetches them into other host pages (the hit
query, then batch gets), as its radix cache drives the controller:

- ``kvxfer zero copy``: interface_v1, the host pool in SGLang's memfd (``allocator: shm``):
  the daemon copies pages out of it and into it;
- ``kvxfer zero copy, gRPC only``: the same with the backend's ``lane`` off: every batch and hit
  query a gRPC call (the baseline of the local lane, ``kvxfer.client.lane_client``);
- ``kvxfer staged``: the same with SGLang's default (private) host memory: one copy through
  the backend's staging area;
- ``file``: SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``) in ``--dir``;
- ``copy``: a plain copy of the same pages into another host buffer and back, timed just before each
  subject's write-through and prefetch; each subject's ratio is to the copy beside it (this VM's
  copy speed drifts 3x within a minute).

Each subject's time is split in two: inside the backend's calls (``BackendClock``), and the rest,
SGLang's own work (hashing, its threads and queues), which no backend can take away. The daemon's
host tiers are faulted in after the warm-up repetition (``Daemon.wait_warm``), as a server's long
have been: the copy's destination is touched memory too.

The prefetched bytes are checked against the written ones. A first repetition warms up and is not
counted (SGLang compiles its page-hash extension on first use). The subjects are interleaved in
every repetition, in an order that alternates between repetitions; ratios are medians of
per-repetition ratios. Needs SGLang (``make
test-sglang`` installs it into .venv-sglang).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import textwrap
import threading
import time

import torch

from kvxfer.bench import launch
from kvxfer.bench.common import GB, Progress, human_bytes, save
from kvxfer.bench.cpu_time import CPU_NOTE, CpuMeter
from kvxfer.core.defaults import DEFAULT_POOL
from kvxfer.core.text_table import format_table

BATCH = 128
#: kvxfer's subjects: (name, SGLang's host allocator, the backend's lane setting).
KVXFER_SUBJECTS = (("kvxfer zero copy", "shm", True), ("kvxfer zero copy, gRPC only", "shm", False),
                   ("kvxfer staged", "default", True))
SUBJECTS = [name for name, _, _ in KVXFER_SUBJECTS] + ["file"]


def _pages(host, indices: torch.Tensor) -> torch.Tensor:
    """The host pages at ``indices`` (token indices, whole pages), as bytes."""
    from kvxfer.integrations.sglang.backend import host_geometry

    g = host_geometry(host)
    pages = host.kv_buffer.view(-1).view(g.shape).index_select(g.page_axis, indices[::host.page_size] // host.page_size)
    return pages.view(torch.uint8)


class BackendClock:
    """The seconds SGLang's controller spends inside its storage backend's calls (the outermost, on any of
    its threads), by op: ``set`` the write-through's batch sets, ``get`` the prefetch's hit queries and batch
    gets. What is left of a repetition is SGLang's own work, which no backend can take away."""

    CALLS = {"batch_set_v1": "set", "batch_set": "set", "batch_get_v1": "get", "batch_get": "get",
             "batch_exists": "get"}

    def __init__(self, store) -> None:
        self.seconds = {"set": 0.0, "get": 0.0}
        self._depth = threading.local()
        for name, op in self.CALLS.items():
            setattr(store, name, self._timed(getattr(store, name), op))

    def _timed(self, inner, op: str):
        def call(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:  # a backend's batch call that calls its own others is counted once
                    self.seconds[op] += time.perf_counter() - start

        return call

    def take(self, op: str) -> float:
        seconds, self.seconds[op] = self.seconds[op], 0.0
        return seconds


def _timed(fn, meter: CpuMeter, cpu: list[float]) -> float:
    """``fn``'s wall seconds; its CPU seconds (of ``meter``'s processes) go to ``cpu``."""
    c0, start = meter.now(), time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    cpu.append(meter.now() - c0)
    return wall


def run(args: argparse.Namespace) -> int:
    try:
        from kvxfer.bench import sglang_engine
    except ImportError as exc:
        raise SystemExit(f"kvxfer bench sglang needs SGLang (make test-sglang installs it into .venv-sglang): {exc}")
    model = sglang_engine.Model(layers=args.layers, heads=args.heads, head_dim=args.head_size, page_size=args.page_size,
                        device_tokens=args.pages * args.page_size)
    small = {**DEFAULT_POOL, "spec": {**DEFAULT_POOL["spec"], "num_blocks": 16}, "host_capacity_mib": 4}
    daemon = launch.spawn({"pools": [small], "log_level": "warning", "registered_host_capacity_mib": args.host_mib})
    progress = Progress(2 * args.reps + 4)
    workdir = tempfile.mkdtemp(prefix="kvxfer-hicache-file-", dir=args.dir)
    subjects: dict = {}
    try:
        for name, allocator, lane in KVXFER_SUBJECTS:
            if name in args.subjects:
                extra = sglang_engine.extra_config(daemon.config["socket"], allocator, deadline_s=60.0, timeout_s=10.0,
                                                   lane=lane)
                subjects[name] = sglang_engine.Controller(extra, layout=args.layout, model=model, model_name=name)
        if "file" in args.subjects:
            subjects["file"] = sglang_engine.Controller({"file_storage_path": workdir}, backend="file",
                                                        layout=args.layout, model=model)
        progress.step(f"daemon up; {len(subjects)} HiCache controllers attached")
        results = _measure(args, subjects, progress, settle=daemon.wait_warm, meter=CpuMeter([daemon.proc.pid]))
    finally:
        for controller in subjects.values():
            controller.close()
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    columns = ["set GB/s", "get GB/s", "set / copy", "get / copy", "set backend / copy", "get backend / copy",
               "set SGLang ms", "get SGLang ms", "set CPU s/GB", "get CPU s/GB", "set CPU / copy", "get CPU / copy"]
    print(format_table(["subject", *columns], [[r["subject"], *(r.get(c, "") for c in columns)]
                                               for r in results["subjects"]],
                       {"x / copy": "time / a plain copy of the same pages' (median of per-repetition ratios)",
                        "backend": "the time inside the backend's calls; SGLang ms: the rest, SGLang's own work",
                        "CPU": CPU_NOTE + "; a subject's: SGLang (this process) and the daemon; the copy's: this "
                                          "process alone"}))
    print(f"{args.pages} pages of {human_bytes(results['page_bytes'])} ({args.layout}), batches of {BATCH}, "
          f"median of {args.reps} repetitions")
    save(args, results, plot)
    return 0


def _measure(args: argparse.Namespace, subjects: dict, progress: Progress, settle, meter: CpuMeter) -> dict:
    """Per repetition and subject: write fresh pages through (set), then prefetch them into other host pages
    (get, checked). ``settle`` runs after the warm-up repetition (the backends register their pools, and
    the daemon makes their host tiers, on first use)."""
    tokens_n = args.pages * args.page_size
    first = next(iter(subjects.values())).host
    page_bytes = first.get_data_page(0, flat=True).numel() * first.dtype.itemsize
    nbytes = args.pages * page_bytes
    times: dict[str, list[float]] = {f"{name} {op}": [] for name in [*subjects, "copy"] for op in ("set", "get")}
    clocks = {name: BackendClock(c.store) for name, c in subjects.items()}
    inside = {f"{name} {op}": [] for name in subjects for op in ("set", "get")}
    paired = {f"{name} {op}": [] for name in subjects for op in ("set", "get")}  # the copy just before each
    # each subject's CPU, and that of the copy just before each of its calls
    cpu: dict[str, list[float]] = {f"{series}{of}": [] for series in paired for of in ("", " copy")}
    alone = CpuMeter()
    spare = None  # the copy's destination, made (and touched) once, as the tiers' memory is
    for rep in range(args.reps + 1):  # repetition 0 warms up (SGLang builds its page-hash extension on first use)
        gen = torch.Generator().manual_seed(rep)
        tokens = {name: torch.randint(0, 1 << 30, (tokens_n,), generator=gen).tolist() for name in subjects}
        sources = {}
        for name, c in subjects.items():  # fresh prompts: no subject finds another repetition's pages
            sources[name] = c.host.alloc(tokens_n)
            raw = c.host.kv_buffer.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        source = _pages(first, sources[next(iter(subjects))])
        spare = torch.empty_like(source) if spare is None else spare
        order = list(subjects.items())[::-1 if rep % 2 else 1]  # who goes first alternates between repetitions
        for name, c in order:
            done = []
            paired[f"{name} set"].append(_timed(lambda: spare.copy_(source), alone, cpu[f"{name} set copy"]))
            clocks[name].take("set")
            times[f"{name} set"].append(_timed(lambda: done.append(c.backup(tokens[name], sources[name])), meter,
                                               cpu[f"{name} set"]))
            inside[f"{name} set"].append(clocks[name].take("set"))
            if done != [tokens_n]:
                raise SystemExit(f"{name}: the write-through stored {done[0]} of {tokens_n} tokens")
        progress.step(f"repetition {rep}: write-through")
        for name, c in order:
            got = []
            paired[f"{name} get"].append(_timed(lambda: source.copy_(spare), alone, cpu[f"{name} get copy"]))
            clocks[name].take("get")
            times[f"{name} get"].append(_timed(lambda: got.append(c.prefetch(f"rep{rep}", tokens[name])), meter,
                                               cpu[f"{name} get"]))
            inside[f"{name} get"].append(clocks[name].take("get"))
            found, loaded, into = got[0]
            if (found, loaded) != (tokens_n, tokens_n) or not torch.equal(_pages(c.host, into),
                                                                         _pages(c.host, sources[name])):
                raise SystemExit(f"{name}: the prefetch found {found} and loaded {loaded} of {tokens_n} tokens, "
                                 "or other bytes")
            c.host.free(into)
            c.host.free(sources[name])
        progress.step(f"repetition {rep}: prefetch, bytes checked")
        if rep == 0:
            for series in [*times.values(), *inside.values(), *paired.values(), *cpu.values()]:
                series.clear()
            settle()
            progress.step("host tiers faulted in")
    for op in ("set", "get"):
        times[f"copy {op}"] = [t for name in subjects for t in paired[f"{name} {op}"]]
        cpu[f"copy {op}"] = [t for name in subjects for t in cpu[f"{name} {op} copy"]]
    rows = []
    for name in [*subjects, "copy"]:
        row = {"subject": name}
        for op in ("set", "get"):
            seconds = statistics.median(times[f"{name} {op}"])
            row[f"{op} pages/s"] = round(args.pages / seconds)
            row[f"{op} GB/s"] = round(nbytes / seconds / GB, 3)
            row[f"{op} CPU s/GB"] = round(statistics.median(cpu[f"{name} {op}"]) / (nbytes / GB), 3)
            if name not in subjects:
                row[f"{op} CPU / copy"] = 1.0
                row[f"{op} / copy"] = 1.0
                continue
            base = paired[f"{name} {op}"]
            row[f"{op} / copy"] = round(statistics.median([a / b for a, b in zip(times[f"{name} {op}"], base)]), 2)
            row[f"{op} CPU / copy"] = round(statistics.median([a / max(b, 1e-9) for a, b in
                                                               zip(cpu[f"{name} {op}"], cpu[f"{name} {op} copy"])]), 2)
            # The backend's share, and SGLang's own: the floor of any backend.
            spent = inside[f"{name} {op}"]
            row[f"{op} backend / copy"] = round(statistics.median([a / b for a, b in zip(spent, base)]), 2)
            row[f"{op} SGLang ms"] = round(statistics.median([(a - b) * 1e3 for a, b in zip(times[f"{name} {op}"],
                                                                                           spent)]), 2)
        rows.append(row)
    return {"layout": args.layout, "pages": args.pages, "page_bytes": page_bytes, "reps": args.reps, "subjects": rows}


def plot(results: dict, path: str) -> None:
    """GB/s of each subject (left); each subject's time against the plain copy beside it, split into the
    backend's calls and SGLang's own work (right, clipped at 12x: SGLang's file backend is far above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["subjects"]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.38
    names = [textwrap.fill(r["subject"], 16) for r in rows]
    for j, op in enumerate(("set", "get")):
        xs = [i + j * width for i in range(len(rows))]
        speed.bar(xs, [r[f"{op} GB/s"] for r in rows], width, label=f"batch {op}")
        measured = [r for r in rows if f"{op} backend / copy" in r]
        xs = [rows.index(r) + j * width for r in measured]
        inside = [r[f"{op} backend / copy"] for r in measured]
        split.bar(xs, inside, width, color=f"C{j}", label=f"{op}: in the backend")
        split.bar(xs, [r[f"{op} / copy"] - b for r, b in zip(measured, inside)], width, bottom=inside, color=f"C{j}",
                  alpha=0.35, hatch="//", label=f"{op}: SGLang's own")
    for ax in (speed, split):
        ax.set_xticks([i + width / 2 for i in range(len(rows))], names)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    speed.set_ylabel("GB/s of SGLang host pages")
    speed.set_xlabel("set: write-through (batch sets); get: prefetch (hit query + batch gets)")
    split.set_ylabel("time / a plain copy beside it")
    split.set_ylim(0, 12)
    split.axhline(2, color="k", lw=0.8, ls="--")
    fig.suptitle(f"SGLang HiCache L3: {results['pages']} pages of {human_bytes(results['page_bytes'])} "
                 f"({results['layout']}), median of {results['reps']} repetitions")
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
    p.add_argument("--subjects", nargs="+", choices=SUBJECTS, default=SUBJECTS,
                   help="which to run (the copy always runs); the file backend's writeback competes with the others")
    p.add_argument("--host-mib", type=int, default=4096, help="the daemon's host tier for registered pools")
    p.add_argument("--dir", default=None, help="where the file backend writes (default: the system's temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a bar chart here (PNG)")
