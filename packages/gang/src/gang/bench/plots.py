"""PNG plots of :mod:`gang.bench` rows: one readable plot per figure.

For each world size: ``<stem>_busbw_<n>ranks.png`` (bus bandwidth against size, one colour per
collective, solid through the gang and dashed through raw torch.distributed) and
``<stem>_ratio_<n>ranks.png`` (the gang/torch time ratio against size, one line per collective),
plus ``<stem>_ratio-jax_<n>ranks.png`` when JaxGang was measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gang.bench.metrics import OPS, Row, format_size, ratio_table


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    # 4 B, 64 B, 1 KiB, ... (every power of 16) within the measured range.
    ticks = [4 << (4 * k) for k in range(16) if min(sizes) <= 4 << (4 * k) <= max(sizes)] or sorted(set(sizes))
    ax.set_xticks(ticks)
    ax.set_xticklabels([format_size(t) for t in ticks], rotation=30, ha="right")
    ax.set_xlabel("buffer size")
    ax.grid(True, which="major", alpha=0.3)


def plot(rows: Sequence[Row], out: Path) -> list[Path]:
    """Write the plots of ``rows`` next to ``out`` (named after its stem); return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {op: f"C{i}" for i, op in enumerate(OPS)}
    worlds = sorted({int(r["world_size"]) for r in rows if r["op"] in OPS and r["impl"] in ("torch", "gang")})
    paths = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out.with_name(f"{out.stem}_{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for world in worlds:
        mine = [r for r in rows if int(r["world_size"]) == world and r["op"] in OPS]
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for op in OPS:
            for impl, style in (("gang", "-"), ("torch", "--")):
                pts = sorted(
                    (int(r["bytes"]), float(r["busbw_gbps"])) for r in mine if r["impl"] == impl and r["op"] == op
                )
                if pts:
                    label = op if impl == "gang" else None
                    ax.plot(*zip(*pts, strict=True), style, marker="o", markersize=3, color=colours[op], label=label)
        ax.set_yscale("log")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"Bus bandwidth on {world} ranks (solid: gang, dashed: torch.distributed)", fontsize=10)
        _size_axis(ax, [int(r["bytes"]) for r in mine])
        ax.legend(fontsize=8)
        save(fig, f"busbw_{world}ranks")
        for ours, base, name in (("gang", "torch", "ratio"), ("gang-jax", "jax", "ratio-jax")):
            table = {k: v for k, v in ratio_table(mine, ours, base).items() if k[1] == world}
            if not table:
                continue
            fig, ax = plt.subplots(figsize=(7.5, 4.5))
            for op in OPS:
                pts = sorted((b, v) for (o, _, b), v in table.items() if o == op)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, color=colours[op], label=op)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_ylabel(f"time {ours} / {base}")
            ax.set_title(f"{ours} / {base} on {world} ranks (median of paired per-iteration ratios)", fontsize=10)
            _size_axis(ax, [b for (_, _, b) in table])
            ax.legend(fontsize=8)
            save(fig, f"{name}_{world}ranks")
    return paths
