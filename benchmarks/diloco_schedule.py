"""Draw streaming DiLoCo's fragment schedule, for the "Training across data centres" guide (``docs/diloco.rst``).

Run ``python -m benchmarks.diloco_schedule`` to write ``docs/_static/diloco-schedule.png``. The
steps come from :func:`gang.ft.diloco.prepare_offsets`, the formula :class:`gang.ft.DiLoCo` runs:
``sync_every=12``, ``fragments=3``, ``fragment_sync_delay=2``, over 24 local steps. Each row is a
fragment; a circle marks the local step after which its pseudo-gradient is taken and exchanged,
a square the step after which the new global values are applied, and the bar between them the
local steps that go on meanwhile.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt

from gang.ft.diloco import prepare_offsets

SYNC_EVERY, FRAGMENTS, DELAY, STEPS = 12, 3, 2, 24
OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "_static" / "diloco-schedule.png"


def draw(output: Path) -> None:
    """One row per fragment: exchanges (circles), applications (squares) and the delay between them."""
    plt.switch_backend("Agg")
    fig, ax = plt.subplots(figsize=(10, 2.6))
    colours = plt.get_cmap("tab10")
    for k, offset in enumerate(prepare_offsets(SYNC_EVERY, FRAGMENTS)):
        for t in range(offset, STEPS, SYNC_EVERY):
            ax.plot([t, t + DELAY], [k, k], color=colours(k), linewidth=6, alpha=0.35, solid_capstyle="butt")
            ax.plot(t, k, "o", color=colours(k), markersize=10)
            ax.plot(t + DELAY, k, "s", color=colours(k), markersize=9)
            ax.annotate(f"t={t}", (t, k), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8)
    ax.set_yticks(range(FRAGMENTS), [f"fragment {k}" for k in range(FRAGMENTS)])
    ax.set_xticks(range(0, STEPS + DELAY + 1, 2))
    ax.set_xlim(-1, STEPS + DELAY)
    ax.set_ylim(FRAGMENTS - 0.4, -0.6)
    ax.set_xlabel("local step t (counted from 0)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(
        f"sync_every={SYNC_EVERY}, fragments={FRAGMENTS}, fragment_sync_delay={DELAY}: "
        "o = exchanged after step t, ■ = applied after step t + delay",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    draw(parser.parse_args().output)


if __name__ == "__main__":
    main()
