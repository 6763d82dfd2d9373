"""Draw where the ranks of each role's gangs go, for the "Parallel layouts" guide (``docs/layouts.rst``).

Run ``python -m benchmarks.layout_pictures`` to write ``docs/_static/layouts.png``. The groups come
from :class:`gang.topology.Layout`, the arithmetic :func:`gang.create_parallel_gangs` and
:func:`gang.create_fsdp_gangs` use, so the picture is what the factories build: 32 ranks with
``pp=2``, ``rdp=2``, ``sdp=2``, ``cp=2``, ``tp=2`` and ``ep=4``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from gang.roles import ROLE_TABLE
from gang.topology import Layout

SHAPE = (2, 2, 2, 2, 2)
"""Sizes of ``pp, rdp, sdp, cp, tp`` (:data:`gang.roles.GRID_AXES`)."""
EP = 4
COLUMNS = 8
OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "_static" / "layouts.png"


def draw(output: Path) -> None:
    """Draw one panel per role of the table: the ranks in rows of 8, each gang in its own colour."""
    plt.switch_backend("Agg")
    layout = Layout(SHAPE, EP)
    rows = layout.size // COLUMNS
    fig, axes = plt.subplots(2, (len(ROLE_TABLE) + 1) // 2, figsize=(4 * ((len(ROLE_TABLE) + 1) // 2), 5.0))
    colours = plt.get_cmap("tab20")
    for ax in axes.flat[len(ROLE_TABLE) :]:
        ax.set_axis_off()
    for ax, row in zip(axes.flat, ROLE_TABLE, strict=False):
        groups = layout.groups(row.name)
        owner = np.empty(layout.size, dtype=int)
        for index, group in enumerate(groups):
            owner[group] = index
        ax.imshow(owner.reshape(rows, COLUMNS) % 20, cmap=colours, vmin=0, vmax=19)
        for rank in range(layout.size):
            ax.text(rank % COLUMNS, rank // COLUMNS, str(rank), ha="center", va="center", fontsize=9)
        ax.set_title(f"{row.name} ({row.title}): {len(groups)} x {groups.shape[1]}", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    sizes = ", ".join(f"{name}={size}" for name, size in layout.sizes.items())
    fig.suptitle(f"32 ranks, {sizes}: one colour per gang", fontsize=12)
    save(fig, output)


def save(fig: Figure, output: Path) -> None:
    """Lay ``fig`` out, write it to ``output`` as a PNG (making its folder) and close it."""
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=80)
    plt.close(fig)


def output_path(doc: str, default: Path) -> Path:
    """The ``--output`` of a picture script (``doc``: its module docstring), ``default`` when not given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--output", type=Path, default=default, help="where to write the PNG")
    output: Path = parser.parse_args().output
    return output


def main() -> None:
    """Parse ``--output`` and draw."""
    draw(output_path(__doc__ or "", OUTPUT))


if __name__ == "__main__":
    main()
