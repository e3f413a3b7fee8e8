"""Prometheus metrics on ``metrics_listen`` (``/metrics``): every figure measured, labels bounded.

The daemon's own counters (bytes and blocks as they moved, seconds from the clock
around each copy and checksum, outcomes, lookups, tier occupancy, jobs) are read at
scrape time by one collector, so that a scrape and a Stats call can never disagree.
Per-request histograms (durations, sizes) are observed as each transfer ends; the
gRPC figures use the names and labels of the Go and Python gRPC interceptors
(``grpc_server_started_total``, ``grpc_server_handled_total``,
``grpc_server_handling_seconds``), so existing dashboards work. Labels come only from
fixed sets: pool, cache_group, tier, direction, outcome, and the gRPC ones
(grpc_type, grpc_service, grpc_method: the served methods; grpc_code): never a key,
a namespace or a client id.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Iterator
from importlib import metadata

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvxfer.core.envelope import EnvelopeCounts
from kvxfer.core.records import PoolStats, TransferResult
from kvxfer.events.event_hub import EventHub
from kvxfer.peering.hub import Peering
from kvxfer.serving.batch import TransferKind
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.serving.prefetch import PrefetchCounts
from service import metrics_http
from service.parts import Hints

log = logging.getLogger("kvxfer.metrics")

#: Transfer kinds as the ``direction`` label (demote/promote join when lower tiers exist).
DIRECTION = {TransferKind.OFFLOAD: "offload", TransferKind.RESTORE: "restore"}
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(1 << n) for n in range(12, 35, 2))  # 4 KiB .. 16 GiB


class TransferObserver:
    """Per-request histograms, observed when each Offload or Restore (synchronous or a job) ends."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram("kvxfer_transfer_duration_seconds",
                                  "Seconds one transfer request's copies and checksums took.",
                                  ["direction"], buckets=SECONDS_BUCKETS, registry=registry)
        self.size = Histogram("kvxfer_transfer_request_bytes", "Bytes one transfer request moved.",
                              ["direction"], buckets=BYTES_BUCKETS, registry=registry)

    def __call__(self, kind: TransferKind, result: TransferResult) -> None:
        direction = DIRECTION[kind]
        self.duration.labels(direction).observe(result.seconds)
        self.size.labels(direction).observe(result.bytes)


class DaemonCollector(Collector):
    """The daemon's measured counters, read from its pools at scrape time."""

    def __init__(self, pools: PoolRegistry, hints: Hints, peering: Peering | None = None) -> None:
        self.pools = pools
        self.hints = hints
        self.peering = peering

    def collect(self) -> Iterator[Metric]:
        served = self.pools.served()
        stats = [s.stats() for s in served]
        yield from _transfers(stats)
        yield from _outcomes_and_lookups(stats)
        yield from _tiers(stats)
        yield from _tenants(stats)
        yield from _hints(served, self.hints.prefetcher.counts())
        yield from _envelopes(self.hints.envelopes)
        yield from _jobs(stats)
        limit = GaugeMetricFamily("kvxfer_jobs_max_queued", "Jobs a pool holds queued or uncollected at most "
                                  "(max_queued_jobs): beyond it submissions are refused.", labels=["pool"])
        for s in stats:
            limit.add_metric([s.pool_id], self.pools.limits.max_queued_jobs)
        yield limit
        info = InfoMetricFamily("kvxfer_pool", "Each served pool's geometry, layout and device.",
                                labels=["pool", "cache_group", "layout", "device", "dtype", "num_layers", "num_blocks",
                                        "block_size", "num_kv_heads", "head_size", "block_bytes", "registered"])
        for s in served:
            d, pool = s.descriptor, s.manager.pool
            spec = d.spec
            device = f"cuda:{pool.cuda_device}" if pool.is_cuda else "cpu"
            info.add_metric([d.pool_id, s.cache_group, d.layout.spelled, device,
                             str(spec.dtype).removeprefix("torch."), str(spec.num_layers), str(spec.num_blocks),
                             str(spec.block_size), str(spec.num_kv_heads), str(spec.head_size),
                             str(spec.block_bytes), str(not d.owned).lower()], {})
        yield info
        if self.pools.kv_events is not None:
            yield from _kv_events(self.pools.kv_events)
        if self.peering is not None:
            yield from _peering(self.peering)


def _peering(peering: Peering) -> Iterator[Metric]:
    """Daemon-to-daemon transfer: by peer (configured names) and direction (in: read from it; out: it
    read from here), failures by cause (kvxfer.peering.counters.CAUSES)."""
    blocks, nbytes, seconds, failures = peering.counters.snapshot()
    labels = ["peer", "direction"]
    moved = CounterMetricFamily("kvxfer_peer_bytes", "Bytes moved between this daemon and a peer over NIXL (in: "
                                "into this daemon's host tier, verified; out: from it, verified there).", labels=labels)
    count = CounterMetricFamily("kvxfer_peer_blocks", "Blocks moved between this daemon and a peer.", labels=labels)
    for (peer, direction), n in sorted(blocks.items()):
        count.add_metric([peer, direction], n)
        moved.add_metric([peer, direction], nbytes[peer, direction])
    read = CounterMetricFamily("kvxfer_peer_transfer_seconds", "Seconds the NIXL transfers this daemon made took "
                               "(in: its reads, out: its pushes; rate(bytes) / rate(seconds) = their bandwidth).",
                               labels=labels)
    for (peer, direction), s in sorted(seconds.items()):
        read.add_metric([peer, direction], s)
    failed = CounterMetricFamily("kvxfer_peer_failures", "Peer calls and reads that failed, by cause; each is a "
                                 "miss, never wrong bytes.", labels=["peer", "cause"])
    for (peer, cause), n in sorted(failures.items()):
        failed.add_metric([peer, cause], n)
    leases, leased = peering.leases.open
    open_leases = GaugeMetricFamily("kvxfer_peer_leases", "Leases granted to peers open now.")
    open_leases.add_metric([], leases)
    pinned = GaugeMetricFamily("kvxfer_peer_leased_blocks", "Host-tier blocks pinned by peers' leases now.")
    pinned.add_metric([], leased)
    expired = CounterMetricFamily("kvxfer_peer_leases_expired", "Leases that ended at their deadline, unreleased.")
    expired.add_metric([], peering.leases.expired)
    yield from (moved, count, read, failed, open_leases, pinned, expired)


def _kv_events(hub: EventHub) -> Iterator[Metric]:
    emitted = CounterMetricFamily("kvxfer_events_emitted", "KV events emitted (blocks stored or removed, by batch).")
    emitted.add_metric([], hub.emitted)
    dropped = CounterMetricFamily("kvxfer_events_dropped", "KV events dropped from the replay buffer (a subscriber "
                                  "behind them is told to resync).")
    dropped.add_metric([], hub.dropped)
    subscribers = GaugeMetricFamily("kvxfer_events_subscribers", "WatchEvents streams open.")
    subscribers.add_metric([], hub.subscribers)
    publisher = CounterMetricFamily("kvxfer_events_publisher", "The vLLM-format publisher: batches published, "
                                    "replays answered, resyncs sent.", labels=["event"])
    for name in ("published_batches", "replays", "publisher_resyncs", "replay_dropped"):
        publisher.add_metric([name], hub.counts[name])
    yield from (emitted, dropped, subscribers, publisher)


def _transfers(stats: list[PoolStats]) -> Iterator[Metric]:
    labels = ["pool", "cache_group", "direction", "tier"]
    moved = CounterMetricFamily("kvxfer_transfer_bytes", "Bytes copied between a pool and a tier, counted as "
                                "they moved.", labels=labels)
    blocks = CounterMetricFamily("kvxfer_transfer_blocks", "Blocks copied between a pool and a tier.", labels=labels)
    seconds = CounterMetricFamily("kvxfer_transfer_seconds", "Seconds the copies and checksums took (rate(bytes) / "
                                  "rate(seconds) is the bandwidth while moving).", labels=labels)
    for s in stats:
        for direction, t in (("offload", s.offloaded), ("restore", s.restored)):
            values = [s.pool_id, s.cache_group, direction, "host"]
            moved.add_metric(values, t.bytes)
            blocks.add_metric(values, t.blocks)
            seconds.add_metric(values, t.seconds)
    yield from (moved, blocks, seconds)


def _outcomes_and_lookups(stats: list[PoolStats]) -> Iterator[Metric]:
    outcomes = CounterMetricFamily("kvxfer_block_outcomes", "Blocks of Offload and Restore requests, by outcome.",
                                   labels=["pool", "outcome"])
    asked = CounterMetricFamily("kvxfer_lookup_keys", "Keys asked about by Lookup.", labels=["pool"])
    hits = CounterMetricFamily("kvxfer_lookup_hits", "Keys Lookup found (leading hits; hit ratio = hits / keys).",
                               labels=["pool"])
    for s in stats:
        for outcome, count in sorted(s.outcomes.items()):
            outcomes.add_metric([s.pool_id, outcome], count)
        asked.add_metric([s.pool_id], s.lookups.keys)
        hits.add_metric([s.pool_id], s.lookups.hits)
    yield from (outcomes, asked, hits)


def _tiers(stats: list[PoolStats]) -> Iterator[Metric]:
    labels = ["cache_group", "tier"]
    families = {name: GaugeMetricFamily(f"kvxfer_tier_{name}_blocks", text, labels=labels) for name, text in (
        ("capacity", "Blocks the tier can hold."), ("used", "Tier slots holding a block or being written."),
        ("ready", "Blocks a restore can read."), ("pinned", "Blocks held by transfers in flight."))}
    tokens = {name: GaugeMetricFamily(f"kvxfer_tier_{name}_tokens", text, labels=labels) for name, text in (
        ("capacity", "Tokens of KV the tier can hold (capacity in blocks x tokens a block): what a router that "
                     "scores this node's offloaded prefixes needs, read here instead of typed by hand."),
        ("ready", "Tokens of KV a restore can read now."))}
    slot = GaugeMetricFamily("kvxfer_tier_slot_bytes", "Bytes of one tier slot (one block; on disk, its header "
                             "included).", labels=labels)
    evictions = CounterMetricFamily("kvxfer_tier_evictions", "Blocks evicted to make room.", labels=labels)
    degraded = GaugeMetricFamily("kvxfer_tier_degraded", "1 once the tier hit an I/O error (it skips what fails).",
                                 labels=labels)
    loading = GaugeMetricFamily("kvxfer_tier_loading", "1 while the tier's index is loaded at start (it holds "
                                "nothing for lookups yet).", labels=labels)
    warming = GaugeMetricFamily("kvxfer_tier_warming", "1 while the host tier's memory is faulted in after start "
                                "(a write to a page not faulted in yet costs a page fault: first transfers are "
                                "slower).", labels=labels)
    events = CounterMetricFamily("kvxfer_tier_events", "Lower-tier events: demoted, demotions_dropped, promoted, "
                                 "corrupt, read_errors, write_errors, dropped_at_start_<reason>, ...",
                                 labels=[*labels, "event"])
    seen = set()
    for s in stats:  # a group's tiers are shared by its pools: once per group
        for t in s.tiers:
            if (s.cache_group, t.tier) in seen:
                continue
            seen.add((s.cache_group, t.tier))
            values = [s.cache_group, t.tier.value]
            if t.has_occupancy:
                for name, value in (("capacity", t.capacity_blocks), ("used", t.used_blocks),
                                    ("ready", t.ready_blocks), ("pinned", t.pinned_blocks)):
                    families[name].add_metric(values, value)
                if s.block_tokens:
                    tokens["capacity"].add_metric(values, t.capacity_blocks * s.block_tokens)
                    tokens["ready"].add_metric(values, t.ready_blocks * s.block_tokens)
                evictions.add_metric(values, t.evictions)
            slot.add_metric(values, t.slot_bytes)
            degraded.add_metric(values, int(t.degraded))
            loading.add_metric(values, int(t.loading))
            warming.add_metric(values, int(t.warming))
            for event, n in sorted(t.events.items()):
                events.add_metric([*values, event], n)
    yield from (*families.values(), *tokens.values(), slot, evictions, degraded, loading, warming, events)


def _hints(served: list, prefetch: PrefetchCounts) -> Iterator[Metric]:
    """Hints taken by action, hinted blocks and evictions by reason per tier, and the prefetcher's results."""
    taken = CounterMetricFamily("kvxfer_hints", "Hints taken (Hint calls, and Offloads carrying one), by action.",
                                labels=["cache_group", "action"])
    labels = ["cache_group", "tier"]
    hinted = GaugeMetricFamily("kvxfer_tier_hinted_blocks", "Blocks a hint placed now: retained (evicted last), "
                               "released (evicted first), prefetched (brought up, not read yet).",
                               labels=[*labels, "state"])
    by_reason = CounterMetricFamily("kvxfer_tier_evictions_by_reason", "Blocks evicted to make room, by where in "
                                    "the order they stood: released, lru, retained.", labels=[*labels, "reason"])
    wasted = CounterMetricFamily("kvxfer_tier_prefetch_wasted", "Prefetched blocks evicted before anyone read them.",
                                 labels=labels)
    groups = {s.manager.group.name: s.manager.group for s in served}
    for name, group in sorted(groups.items()):
        for action, n in group.hints.items():
            taken.add_metric([name, action.value], n)
        for tier, h in group.hint_stats():
            values = [name, tier.value]
            for state, n in (("retained", h.retained), ("released", h.released), ("prefetched", h.prefetched)):
                hinted.add_metric([*values, state], n)
            for reason, n in sorted(h.evicted.items()):
                by_reason.add_metric([*values, reason], n)
            wasted.add_metric(values, h.wasted)
    results = CounterMetricFamily("kvxfer_prefetch_keys", "Keys PREFETCH hints named, by result: done (brought up), "
                                  "present (in host memory already), absent (no tier held it), over_share (the "
                                  "tenant's hint share was full), cancelled.", labels=["result"])
    for result, n in prefetch.results.items():
        results.add_metric([result], n)
    queued = GaugeMetricFamily("kvxfer_prefetch_queued_keys", "Keys waiting in the prefetch queue.")
    queued.add_metric([], prefetch.queued_keys)
    yield from (taken, hinted, by_reason, wasted, results, queued)


def _envelopes(counts: EnvelopeCounts) -> Iterator[Metric]:
    """Routers' hint envelopes, and their actions by type and outcome."""
    envelopes, actions = counts.snapshot()
    taken = CounterMetricFamily("kvxfer_hint_envelopes", "Hint envelopes taken (Hint calls of action ENVELOPE).")
    taken.add_metric([], envelopes)
    by_outcome = CounterMetricFamily("kvxfer_hint_envelope_actions", "Hint envelopes' actions by type (kv.fetch, "
                                     "kv.prefetch, kv.retain, kv.release, other) and outcome: taken, or why it was "
                                     "set aside (unknown_type, unknown_version, malformed, oversized, unknown_peer, "
                                     "unresolved, refused).", labels=["action", "outcome"])
    for (action, outcome), n in sorted(actions.items()):
        by_outcome.add_metric([action, outcome], n)
    yield from (taken, by_outcome)


def _tenants(stats: list[PoolStats]) -> Iterator[Metric]:
    """Each configured tenant's part of each group's divided tiers, host and disk (labels: configured tenants
    and "other" only)."""
    labels = ["cache_group", "tier", "tenant"]
    blocks = GaugeMetricFamily("kvxfer_tenant_blocks", "Slots of the tier holding the tenant's blocks.", labels=labels)
    guaranteed = GaugeMetricFamily("kvxfer_tenant_guaranteed_blocks", "Blocks of the tier no other tenant's store "
                                   "may take below (its share).", labels=labels)
    evictions = CounterMetricFamily("kvxfer_tenant_evictions", "The tenant's blocks evicted from the tier.",
                                    labels=labels)
    hits = CounterMetricFamily("kvxfer_tenant_hits", "The tenant's blocks loaded from the tier.", labels=labels)
    seen = set()
    for s in stats:
        if s.cache_group in seen:
            continue
        seen.add(s.cache_group)
        for tier in s.tiers:
            for t in tier.tenants:
                values = [s.cache_group, tier.tier.value, t.name]
                blocks.add_metric(values, t.blocks)
                guaranteed.add_metric(values, t.guaranteed)
                evictions.add_metric(values, t.evictions)
                hits.add_metric(values, t.hits)
    yield from (blocks, guaranteed, evictions, hits)


def _jobs(stats: list[PoolStats]) -> Iterator[Metric]:
    gauges = {name: GaugeMetricFamily(f"kvxfer_jobs_{name}", text, labels=["pool"]) for name, text in (
        ("queued", "Asynchronous jobs waiting to run."), ("running", "Jobs running."),
        ("unclaimed", "Finished jobs not yet collected with WaitJobs."))}
    counters = {name: CounterMetricFamily(f"kvxfer_jobs_{name}", text, labels=["pool"]) for name, text in (
        ("completed", "Jobs that ran to the end."), ("cancelled", "Queued jobs cancelled (lease out, pool gone)."),
        ("leases_expired", "Jobs or results dropped because their client's lease ran out."))}
    for s in stats:
        j = s.jobs
        for name, value in (("queued", j.queued), ("running", j.running), ("unclaimed", j.unclaimed)):
            gauges[name].add_metric([s.pool_id], value)
        for name, value in (("completed", j.completed), ("cancelled", j.cancelled), ("leases_expired", j.expired)):
            counters[name].add_metric([s.pool_id], value)
    yield from (*gauges.values(), *counters.values())


class GrpcMetrics(grpc.aio.ServerInterceptor):
    """``grpc_server_*`` for every unary RPC the daemon serves (unknown methods are not counted)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter("grpc_server_started", "RPCs started on the server.", labels, registry=registry)
        self.handled = Counter("grpc_server_handled", "RPCs completed on the server, by status code.",
                               [*labels, "grpc_code"], registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds", "Seconds from an RPC's start to its status.",
                                 labels, buckets=SECONDS_BUCKETS, registry=registry)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        service, _, method = details.method.lstrip("/").partition("/")
        labels = ("unary", service, method)
        inner = handler.unary_unary

        async def observed(request, context):
            self.started.labels(*labels).inc()
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await inner(request, context)
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                self.handled.labels(*labels, code.name).inc()
                self.seconds.labels(*labels).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(observed, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class LaneMetrics:
    """The local lane's calls (``service.lane_server``), as ``grpc_server_*`` counts gRPC's: by method and status
    code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter("kvxfer_lane_handled", "Calls completed on the local lane, by status code.",
                               ["method", "code"], registry=registry)
        self.seconds = Histogram("kvxfer_lane_handling_seconds", "Seconds from a local-lane call's arrival to "
                                 "its answer.", ["method"], buckets=SECONDS_BUCKETS, registry=registry)
        self.connections = Gauge("kvxfer_lane_connections", "Connections open on the local lane.",
                                 registry=registry)
        self._children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}  # labels() costs 10% of a call

    def __call__(self, method: str, code: str, seconds: float) -> None:
        child = self._children.get((method, code))
        if child is None:  # a few methods and codes: bounded
            child = self._children[method, code] = (self.handled.labels(method, code), self.seconds.labels(method))
        child[0].inc()
        child[1].observe(seconds)


class Metrics:
    """What ``/metrics`` serves: the daemon's figures (once ``watch`` names its pools), the gRPC
    and per-transfer figures, build information and the process's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.transfers = TransferObserver(self.registry)
        self.grpc = GrpcMetrics(self.registry)
        self.lane = LaneMetrics(self.registry)
        self.serving = Gauge("kvxfer_serving", "1 while the daemon serves (health SERVING), 0 once it is shutting "
                             "down.", registry=self.registry)
        build = InfoMetricFamily("kvxfer_build", "The running build.", labels=[])
        build.add_metric([], {"version": metadata.version("kvxfer"), "python": platform.python_version(),
                              "torch": torch.__version__, "grpc": grpc.__version__})
        self.registry.register(_Static([build]))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def watch(self, pools: PoolRegistry, hints: Hints, peering: Peering | None = None) -> None:
        self.registry.register(DaemonCollector(pools, hints, peering))

    def serve(self, listen: str) -> metrics_http.MetricsServer:
        """Serve ``/metrics`` on ``HOST:PORT`` in a thread, its connections bounded; returns the server
        (``shutdown()`` it)."""
        return metrics_http.serve(self.registry, listen)


class _Static(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics
