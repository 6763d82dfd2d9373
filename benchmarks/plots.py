"""PNG plots of benchmark rows: bus bandwidth and overhead ratio against buffer size."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks.benchmath import IMPLS, OPS, PAIRS, Row, ratio_table


def plot(rows: Sequence[Row], out: Path) -> list[Path]:
    """Write ``<stem>_busbw.png`` and ``<stem>_ratio.png`` next to ``out``; return their paths.

    One panel per (world size, collective); busbw has one line per implementation, the ratio plot
    one line per (ours / raw) pair.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({int(r["world_size"]) for r in rows if r["op"] in OPS and r["impl"] in IMPLS})
    if not worlds:
        return []
    paths = []
    for kind in ("busbw", "ratio"):
        fig, axes = plt.subplots(
            len(worlds), len(OPS), figsize=(4 * len(OPS), 3.2 * len(worlds)), squeeze=False, sharex=True
        )
        for i, world in enumerate(worlds):
            for j, op in enumerate(OPS):
                ax = axes[i][j]
                if kind == "busbw":
                    for impl in IMPLS:
                        pts = sorted(
                            (int(r["bytes"]), float(r["busbw_gbps"]))
                            for r in rows
                            if r["impl"] == impl and r["op"] == op and r["world_size"] == world and r["busbw_gbps"]
                        )
                        if pts:
                            ax.plot(*zip(*pts, strict=False), marker="o", markersize=3, label=impl)
                    ax.set_yscale("log")
                    ax.set_ylabel("busbw (GB/s)")
                else:
                    for ours, base in PAIRS:
                        table = ratio_table(rows, ours, base)
                        pts = sorted((b, v) for (o, w, b), v in table.items() if o == op and w == world)
                        if pts:
                            ax.plot(*zip(*pts, strict=False), marker="o", markersize=3, label=f"{ours} / {base}")
                    ax.axhline(1.0, color="grey", linewidth=0.8)
                    ax.set_ylabel("time ratio")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{op}, {world} ranks", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
                if i == len(worlds) - 1:
                    ax.set_xlabel("bytes")
                if i == 0 and j == 0:
                    ax.legend(fontsize=8)
        fig.tight_layout()
        path = out.with_name(f"{out.stem}_{kind}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths
