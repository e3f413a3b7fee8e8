"""How a batch of blocks moves between a GPU pool and the host tier, chosen per batch.

Three methods: one batched driver call for the plan's descriptors (cuMemcpyBatchAsync),
a driver call per descriptor (cuMemcpyAsync), or, for layouts of short runs, a kernel
that gathers (scatters) each block through a staging buffer and one descriptor a block.
The choice is the cheapest estimate from a cost table measured by the device check
(``kvxfer devcheck`` fits one from its bandwidth stage; the repository keeps the last,
``costs.json``):

    seconds = descriptors x (the method's time per descriptor beyond the link's rate)
              + bytes / the link's rate + staging rounds x a kernel launch

A method the table has no figure for is never preferred over one it has, except staging
where the layout is known to need it (runs under ``STAGING_RUN_BYTES``). Copy attributes
are not among the choices: offload reads the pool in stream order (STREAM), restore with
ANY, and never PREFER_OVERLAP_WITH_COMPUTE, which with SRC_ACCESS_ORDER_DURING_API_CALL
was found to read the source after the call returned (a driver defect TensorRT-LLM hit).
"""

from __future__ import annotations

import enum
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from kvxfer.geometry.layout import PoolLayout
from kvxfer.transfer.copy_engine import Direction
from kvxfer.transfer.staging import wants_staging

COSTS = Path(__file__).with_name("costs.json")
#: The key of each direction in the table and in the device check's rows.
SIDE = {Direction.TO_HOST: "d2h", Direction.TO_POOL: "h2d"}


class Method(enum.Enum):
    BATCHED = "batched"  # the plan's descriptors in batched driver calls
    LOOPED = "looped"  # a driver call per descriptor
    STAGED = "staged"  # gathered/scattered through staging, one descriptor a block


@dataclass(frozen=True)
class CostTable:
    """Measured costs of one machine (the device check's ``cost_table``)."""

    link_gbps: dict[str, float]  # "d2h"/"h2d": one contiguous pinned copy's rate
    descriptor_us: dict[Method, dict[str, float]]  # per method and direction, beyond the link's rate
    round_us: float = 30.0  # a staging round's kernel launch (host side), until one is measured
    source: str = "unmeasured"
    extra: dict = field(default_factory=dict, compare=False)

    def seconds(self, method: Method, direction: Direction, descriptors: int, nbytes: int,
                rounds: int = 0) -> float | None:
        """The estimated time of a batch, or None where the table has no figure for ``method``."""
        side = SIDE[direction]
        per = self.descriptor_us.get(method, {}).get(side)
        if per is None:
            return None
        return descriptors * per * 1e-6 + nbytes / (self.link_gbps[side] * 1e9) + rounds * self.round_us * 1e-6

    @classmethod
    def only(cls, method: Method) -> CostTable:
        """A table in which ``method`` alone has a figure: the planner takes it whenever it is there
        (the device check measures each method so)."""
        return cls({"d2h": 1.0, "h2d": 1.0}, {method: {"d2h": 0.0, "h2d": 0.0}}, source=f"{method.value} only")

    @classmethod
    def load(cls, path: Path = COSTS) -> CostTable:
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        return cls(link_gbps={k: float(v) for k, v in data["link_gbps"].items()},
                   descriptor_us={Method(m): {k: float(v) for k, v in sides.items()}
                                  for m, sides in data["descriptor_us"].items()},
                   round_us=float(data.get("round_us", 30.0)), source=str(data.get("source", "")),
                   extra={k: v for k, v in data.items() if k not in ("link_gbps", "descriptor_us", "round_us",
                                                                       "source")})

    def to_dict(self) -> dict:
        return {"source": self.source, "link_gbps": self.link_gbps,
                "descriptor_us": {m.value: sides for m, sides in self.descriptor_us.items()},
                "round_us": self.round_us, **self.extra}


def fit(rows: list[dict], source: str) -> CostTable:
    """A cost table from the device check's bandwidth rows: for each method and direction, the
    median over scattered rows of (the row's time - the same bytes at the baseline's rate) per
    descriptor; the link's rate is the median baseline."""
    per: dict[Method, dict[str, list[float]]] = {}
    links: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for row in rows:
        if row.get("placement") != "scattered" or "submission" not in row:
            continue
        nbytes, descriptors = row["blocks"] * row["span_kib"] * 1024, row["descriptors_per_job"]
        for side in ("d2h", "h2d"):
            base = row[f"baseline_{side}_gbps"]
            links[side].append(base)
            excess = nbytes / (row[f"{side}_gbps"] * 1e9) - nbytes / (base * 1e9)
            per.setdefault(Method(row["submission"]), {}).setdefault(side, []).append(
                max(excess, 0.0) / descriptors * 1e6)
    if not links["d2h"]:
        raise ValueError("no scattered bandwidth rows to fit a cost table from")
    return CostTable(link_gbps={side: round(statistics.median(v), 2) for side, v in links.items()},
                     descriptor_us={m: {side: round(statistics.median(v), 3) for side, v in sides.items()}
                                    for m, sides in per.items()}, source=source)


class Planner:
    """Chooses the method for each batch of one pool's engine."""

    def __init__(self, layout: PoolLayout, table: CostTable, batched: bool, staging_rows: int = 0) -> None:
        """``batched``: the driver has cuMemcpyBatchAsync; ``staging_rows``: blocks a staging buffer
        holds (0: this pool has no staging)."""
        self.layout, self.table, self.staging_rows = layout, table, staging_rows
        self.methods = [m for m in Method if (m is not Method.BATCHED or batched)
                        and (m is not Method.STAGED or staging_rows > 0)]

    def estimates(self, direction: Direction, blocks: int) -> dict[Method, float | None]:
        """Each available method's estimated seconds for ``blocks`` blocks (None: no figure)."""
        layout, nbytes = self.layout, blocks * self.layout.block_bytes
        out: dict[Method, float | None] = {}
        for method in self.methods:
            if method is Method.STAGED:
                rounds = math.ceil(blocks / self.staging_rows)
                out[method] = self.table.seconds(method, direction, blocks, nbytes, rounds)
            else:
                out[method] = self.table.seconds(method, direction, blocks * layout.runs_per_block, nbytes)
        return out

    def choose(self, direction: Direction, blocks: int) -> Method:
        estimates = self.estimates(direction, blocks)
        if Method.STAGED in estimates and estimates[Method.STAGED] is None and wants_staging(self.layout):
            return Method.STAGED  # not measured yet: the layout's short runs are known to need it
        costed = {m: s for m, s in estimates.items() if s is not None}
        if costed:
            return min(costed, key=costed.__getitem__)
        return Method.BATCHED if Method.BATCHED in estimates else Method.LOOPED


def main(argv: list[str] | None = None) -> int:
    """``python -m kvxfer.transfer.planner RUN.json``: fit the table from a device check's JSON (its
    bandwidth stage) and write it to ``costs.json``, which the engines load."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvxfer.transfer.planner docs/benchmarks/devcheck/RUN.json", file=sys.stderr)
        return 2
    run = json.loads(Path(args[0]).read_text())
    rows = next(s for s in run["stages"] if s["stage"] == "bandwidth")["result"]["rows"]
    env = next((s.get("result") or {} for s in run["stages"] if s["stage"] == "environment"), {})
    table = fit(rows, f"{args[0]}: {env.get('device', 'unknown device')}, driver {env.get('driver_version', '?')}")
    COSTS.write_text(json.dumps(table.to_dict(), indent=2) + "\n")
    print(json.dumps(table.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
