"""The device check's bandwidth as a picture: each case against the plain pinned copy.

``python -m kvxfer.devcheck.plot DIR/devcheck.json OUT.png`` (``kvxfer devcheck``
writes ``devcheck.png`` beside its JSON itself where matplotlib is installed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Bars per (layout, span): unchecked cases by placement and submission, then the checked default.
CASES = [("consecutive", "batched"), ("scattered", "batched"), ("scattered", "looped")]


def bandwidth_rows(report: dict) -> list[dict]:
    """The bandwidth stage's rows of a devcheck.json report ([] when the stage did not run)."""
    for stage in report.get("stages", []):
        if stage["stage"] == "bandwidth" and stage["ok"]:
            return stage["result"]["rows"]
    return []


def _checked_default(rows: list[dict], layout: str, span: int) -> dict | None:
    return next((r for r in rows if r.get("checksums") and r["layout"] == layout and r["span_kib"] == span), None)


def plot(report: dict, path: str) -> bool:
    """Write the PNG; False when the report has no bandwidth rows."""
    rows = bandwidth_rows(report)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["layout"], r["span_kib"]) for r in rows}, key=lambda g: (g[0], g[1]))
    labels = [f"{layout}\n{span} KiB" for layout, span in groups]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    width = 0.2
    for ax, (moved, checked) in zip(axes, (("d2h", "offload"), ("h2d", "restore"))):
        for k, (placement, submission) in enumerate(CASES):
            values = [next((r[f"{moved}_vs_baseline"] for r in rows if not r.get("checksums")
                            and (r["layout"], r["span_kib"], r["placement"], r["submission"])
                            == (layout, span, placement, submission)), 0.0) for layout, span in groups]
            ax.bar([g + (k - 1.5) * width for g in range(len(groups))], values, width,
                   label=f"{placement}, {submission}")
        values = [(_checked_default(rows, layout, span) or {}).get(f"{checked}_vs_baseline", 0.0)
                  for layout, span in groups]
        ax.bar([g + 1.5 * width for g in range(len(groups))], values, width, label="scattered, with checksums")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(groups)), labels, fontsize=8)
        ax.set_title(f"{checked} ({moved}): GB/s / one contiguous pinned copy")
        ax.grid(axis="y", alpha=0.3)
    env = next((s["result"] for s in report["stages"] if s["stage"] == "environment" and s["ok"]), {})
    fig.suptitle(f"kvxfer devcheck, {env.get('device', '?')}, {report.get('started', '')}", fontsize=10)
    axes[0].set_ylabel("fraction of the plain copy")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvxfer.devcheck.plot DEVCHECK_JSON OUT_PNG")
        return 2
    if not plot(json.loads(Path(args[0]).read_text()), args[1]):
        print(f"{args[0]}: no bandwidth rows to plot")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
