"""``kvxfer status``'s tables from given Stats: what an operator reads at a glance (issue 50: drops shown)."""

from kvxfer.cli.status_cmd import render
from kvxfer.core.records import PoolStats, TierKind, TierStats, TransferStats


def test_blocks_dropped_on_their_way_down_are_shown_per_lower_tier():
    tiers = [TierStats(TierKind.HOST, 100, 100, 100, 0, 7000, 4096),
             TierStats(TierKind.DISK, 1000, 900, 900, 0, 0, 4096,
                       events={"demoted": 2626, "demotions_dropped": 7060, "demotions_dropped_loading": 3}),
             TierStats(TierKind.OBJECT, 0, 0, 0, 0, 0, 4096, True, {"stored": 5, "stores_dropped": 11})]
    stats = [PoolStats("rank0", 1, "g", tiers, TransferStats(), TransferStats())]
    text = render(stats, stats, 1.0)
    header = next(line for line in text.splitlines() if "evictions" in line)
    assert header.split("|")[-2].strip() == "dropped"
    rows = {cells[2]: cells for cells in ([c.strip() for c in line.split("|")] for line in text.splitlines())
            if len(cells) > 3}
    assert rows["disk"][-2] == "7063" and rows["object (degraded)"][-2] == "11" and rows["host"][-2] == "-"


def test_a_host_tier_still_faulting_its_memory_in_is_shown_warming():
    tiers = [TierStats(TierKind.HOST, 100, 0, 0, 0, 0, 4096, warming=True)]
    stats = [PoolStats("rank0", 1, "g", tiers, TransferStats(), TransferStats())]
    rows = [[c.strip() for c in line.split("|")] for line in render(stats, stats, 1.0).splitlines()]
    assert any(cells[2:3] == ["host (warming)"] for cells in rows)
    tiers[0] = TierStats(TierKind.HOST, 100, 0, 0, 0, 0, 4096)
    assert "warming" not in render(stats, stats, 1.0)
