"""Draw a 1F1B schedule's traffic between pipeline stages, for the "Pipelines and experts" guide.

Run ``python -m benchmarks.pipeline_picture`` to write ``docs/_static/pipeline-1f1b.png``. The order
of each stage's actions is :func:`schedule` of ``examples/pipeline_send_recv.py``, the example the
guide shows, and the timing follows its calls: between two actions a stage makes one ``send_recv``
call, which ends once every peer it sends to or receives from has made the matching call. A forward
takes one unit of time and a backward two (it computes two gradients); the calls take none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from pipeline_send_recv import schedule  # noqa: E402  (the example, imported by name)

STAGES = 4
MICROBATCHES = 8
DURATION = {"F": 1.0, "B": 2.0}
OUTPUT = ROOT / "docs" / "_static" / "pipeline-1f1b.png"

Action = tuple[str, int]


def _peer_of(kind: str, stage: int, receives: bool) -> int:
    """The stage an action's input comes from (``receives``), or its output goes to."""
    forward = kind == "F"
    return stage + (-1 if forward else 1) * (1 if receives else -1)


def timeline(stages: int, microbatches: int) -> dict[tuple[int, Action], tuple[float, float]]:
    """The (start, end) of every stage's every action, the calls between them as the example makes them.

    Stage ``s``'s call before its ``k``-th action sends what action ``k - 1`` produced and receives
    what action ``k`` needs; the call ends when every peer has posted its matching call.
    """
    orders = {s: schedule(s, stages, microbatches) for s in range(stages)}
    done: dict[tuple[int, Action], tuple[float, float]] = {}
    calls: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (stage, call) -> the peers' matching calls
    index = {(s, action): k for s, order in orders.items() for k, action in enumerate(order)}
    for s, order in orders.items():
        for k, (kind, m) in enumerate(order):
            peers = []
            needs_input = (kind == "F" and s > 0) or (kind == "B" and s < stages - 1)
            if needs_input:  # received in call k; the producer sent it in the call after producing it
                source = _peer_of(kind, s, receives=True)
                peers.append((source, index[(source, (kind, m))] + 1))
            if k > 0:
                prev_kind, prev_m = order[k - 1]
                sends = (prev_kind == "F" and s < stages - 1) or (prev_kind == "B" and s > 0)
                if sends:  # the consumer receives it in the call before its own action
                    target = _peer_of(prev_kind, s, receives=False)
                    peers.append((target, index[(target, (prev_kind, prev_m))]))
            calls[(s, k)] = peers

    def posted(s: int, k: int) -> float | None:
        """When stage ``s`` posts its call before action ``k`` (``k == len``: the call after its last action)."""
        if k == 0:
            return 0.0
        previous = done.get((s, orders[s][k - 1]))
        return None if previous is None else previous[1]

    # Relax until every action has a time: an action starts when its call and the peers' matching calls are posted.
    pending = sorted((s, k) for s, order in orders.items() for k in range(len(order)))
    while pending:
        left = []
        for s, k in pending:
            times = [posted(s, k), *(posted(*peer) for peer in calls[(s, k)])]
            known = [t for t in times if t is not None]
            if len(known) < len(times):
                left.append((s, k))
                continue
            kind, m = orders[s][k]
            start = max(known)
            done[(s, (kind, m))] = (start, start + DURATION[kind])
        if len(left) == len(pending):
            raise RuntimeError("the schedule deadlocks")
        pending = left
    return done


def draw(output: Path, stages: int = STAGES, microbatches: int = MICROBATCHES) -> None:
    """Draw the timeline: stages top to bottom, forwards and backwards as boxes, the traffic as arrows."""
    plt.switch_backend("Agg")
    times = timeline(stages, microbatches)
    fig, ax = plt.subplots(figsize=(12, 0.9 * stages + 1.2))
    colours = {"F": "#8fb8de", "B": "#f2b880"}
    for (s, (kind, m)), (start, end) in times.items():
        ax.add_patch(Rectangle((start, s - 0.35), end - start, 0.7, facecolor=colours[kind], edgecolor="black"))
        ax.text((start + end) / 2, s, f"{kind}{m}", ha="center", va="center", fontsize=8)
    for (s, (kind, m)), (_, end) in times.items():
        target = s + 1 if kind == "F" else s - 1
        if 0 <= target < stages:
            start = times[(target, (kind, m))][0]
            colour = "#1f5a96" if kind == "F" else "#b35900"
            ax.annotate(
                "",
                xy=(start, target + (-0.35 if kind == "F" else 0.35)),
                xytext=(end, s + (0.35 if kind == "F" else -0.35)),
                arrowprops={"arrowstyle": "->", "color": colour, "lw": 0.8},
            )
    end = max(e for _, e in times.values())
    ax.set_xlim(0, end)
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("time (a forward takes 1, a backward 2)")
    ax.set_title(
        f"1F1B, {stages} stages, {microbatches} microbatches: activations go down (blue arrows), "
        "gradients up (orange); each arrow is one send_recv pair",
        fontsize=10,
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main() -> None:
    """Parse ``--output`` and draw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write the PNG")
    draw(parser.parse_args().output)


if __name__ == "__main__":
    main()
