"""Write the tables of ``docs/performance.rst`` from the JSON the benchmarks wrote.

``python -m benchmarks.docs_tables [--data docs/_static/perf] [--out docs/_generated]`` reads the
committed results in ``--data`` (each the ``--out`` JSON of one benchmark, listed in
:data:`SOURCES`) and writes one reStructuredText file per table into ``--out``, which the page
includes. The Sphinx build (``docs/conf.py``) runs it first, so re-running a benchmark with its
``--out`` pointed into ``docs/_static/perf`` (the commands are in ``runs.json`` beside the
results) updates the page. ``runs.json`` says, per result file, the command that wrote it and the
machine and load it ran on; ``recorded.json`` holds figures this machine cannot reproduce
(torchft is not installed here), each with the command that produces it.

Only the standard library is used, so the docs build does not import torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "_static" / "perf"
OUT = ROOT / "docs" / "_generated"

Row = Mapping[str, Any]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
TRAFFIC = ("send", "send_recv_ring", "all_to_all_uneven", "exchange_rows", "overlap")
SMALL = 64 << 10
"""Sizes below this count as small messages in the summaries."""


class Data:
    """The result files of ``folder``: their rows (:meth:`rows`) and how each was made (:meth:`run`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runs: dict[str, dict[str, Any]] = json.loads((folder / "runs.json").read_text())
        self.recorded: list[dict[str, Any]] = json.loads((folder / "recorded.json").read_text())

    def rows(self, name: str) -> list[Row]:
        """The rows of result file ``name`` (a list of rows, or ``gang.bench``'s object holding one)."""
        found = json.loads((self.folder / name).read_text())
        return list(found["rows"] if isinstance(found, dict) else found)

    def run(self, name: str) -> str:
        """One line saying how result file ``name`` was made: its command, the machine and the load."""
        run = self.runs[name]
        return f"``{name}``: ``{run['command']}``; {run['machine']}; load average {run['load']}."


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for a table cell (``-`` for none)."""
    return "\\-" if value is None else f"{value:.{digits}f}"


def size(nbytes: int) -> str:
    """``4 B``, ``64 KiB``, ``4 MiB``."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(title: str, header: Sequence[str], body: Iterable[Sequence[str]], source: str) -> str:
    """A ``list-table`` with ``title``, followed by the line naming its ``source``."""
    lines = [f".. list-table:: {title}", "   :header-rows: 1", ""]
    for cells in [list(header), *body]:
        lines += [f"   {'*' if i == 0 else ' '} - {cell}".rstrip() for i, cell in enumerate(cells)]
    return "\n".join([*lines, "", source, ""])


def by(rows: Iterable[Row], *keys: str) -> dict[tuple[Any, ...], Row]:
    """``rows`` keyed by the values of ``keys``."""
    return {tuple(row[k] for k in keys): row for row in rows}


def paired(row: Row, base: str | None = None) -> float | None:
    """The paired ratio of ``row`` to the implementation ``base`` (``None``: to its first baseline)."""
    if base is not None and base in row.get("paired_ratios", {}):
        return float(row["paired_ratios"][base])
    if base is not None and "paired_ratios" in row:
        return None
    return row.get("paired_ratio")


def ratios(
    rows: Sequence[Row], ours: str, ops: Sequence[str], world: int, base: str | None = None
) -> dict[tuple[str, int], float]:
    """The paired ratio of ``ours`` to ``base`` (default: its first baseline) per (op, bytes) on ``world`` ranks."""
    found = {
        (r["op"], r["bytes"]): paired(r, base)
        for r in rows
        if r["impl"] == ours and r["op"] in ops and r["world_size"] == world
    }
    return {k: v for k, v in found.items() if v is not None}


def split_summary(found: Mapping[tuple[str, int], float]) -> tuple[float, float, tuple[str, int], float]:
    """Median of the ratios below and from 64 KiB, and the worst (op, bytes) with its ratio."""
    below = [v for (_, b), v in found.items() if b < SMALL]
    above = [v for (_, b), v in found.items() if b >= SMALL]
    worst = max(found, key=lambda k: found[k])
    return statistics.median(below), statistics.median(above), worst, found[worst]


# --------------------------------------------------------------------------------------------------
# One function per table: (data) -> reStructuredText
# --------------------------------------------------------------------------------------------------

QUICK = "quick.json"


def collectives(data: Data) -> str:
    """Median times and paired ratios of the collectives at their smallest size, 64 KiB and 4 MiB."""
    rows = data.rows(QUICK)
    index = by(rows, "impl", "op", "bytes", "world_size")

    def cell(impl: str, op: str, nbytes: int, world: int, key: str = "time_us") -> str:
        row = index.get((impl, op, nbytes, world))
        if row is not None and key == "paired_ratio":
            value = paired(row, "jax" if impl == "gang-jax" else "torch")
            return "\\-" if value is None else fmt(value, 2)
        return "\\-" if row is None or key not in row else fmt(row[key], 0 if key == "time_us" else 2)

    body = []
    for world in sorted({r["world_size"] for r in rows if r["op"] in COLLECTIVES}):
        for op in COLLECTIVES:
            measured = sorted({r["bytes"] for r in rows if r["op"] == op and r["world_size"] == world})
            for nbytes in sorted({measured[0], SMALL, measured[-1]} & set(measured)):
                at = (op, nbytes, world)
                body.append(
                    [str(world), op, size(nbytes)]
                    + [cell(impl, *at) for impl in ("torch", "gang")]
                    + [cell("gang", *at, key="paired_ratio")]
                    + [cell(impl, *at) for impl in ("jax", "gang-jax")]
                    + [cell("gang-jax", *at, key="paired_ratio")]
                )
    header = ["ranks", "op", "size", "torch", "gang", "gang/torch", "jax", "gang-jax", "gang-jax/jax"]
    title = "Median time (us) of the slowest rank and paired ratios, ``--quick``"
    return table(title, header, body, data.run(QUICK))


def collectives_summary(data: Data) -> str:
    """Per world size and pair, the median paired ratio below and from 64 KiB, and the worst size."""
    rows = data.rows(QUICK)
    body = []
    for ours, base in (("gang", "torch"), ("gang-jax", "jax")):
        for world in sorted({r["world_size"] for r in rows if r["op"] in COLLECTIVES}):
            found = ratios(rows, ours, COLLECTIVES, world, base)
            if found:
                below, above, (op, nbytes), worst = split_summary(found)
                body.append(
                    [f"{ours}/{base}", str(world), fmt(below), fmt(above), f"{fmt(worst)} ({op} {size(nbytes)})"]
                )
    header = ["pair", "ranks", "below 64 KiB", "from 64 KiB", "worst size"]
    title = "Median over sizes of the paired ratio, every size from 4 B to 4 MiB"
    return table(title, header, body, data.run(QUICK))


def setup(data: Data) -> str:
    """Gang creation, ``to_device_mesh``, the FSDP2 step and ``FakeGang`` against what they replace."""
    rows = data.rows(QUICK)
    index = by(rows, "impl", "op")
    body = []
    groups_gang, groups_torch = index[("gang", "create_groups")], index[("torch", "create_groups")]
    body.append(
        [
            "``create_parallel_gangs`` + ``create_fsdp_gangs`` / ``init_device_mesh`` (pp=2, dp=2, tp=2, 8 ranks)",
            f"{groups_gang['time_us'] / 1e3:.1f} ms / {groups_torch['time_us'] / 1e3:.1f} ms",
            fmt(groups_gang["time_us"] / groups_torch["time_us"]),
        ]
    )
    body.append(
        ["``to_device_mesh`` of those gangs", f"{index[('gang', 'to_device_mesh')]['time_us'] / 1e3:.1f} ms", ""]
    )
    ours, native = index[("gang-mesh", "fsdp_step")], index[("native-mesh", "fsdp_step")]
    body.append(
        [
            "FSDP2 + tensor parallel step: mesh from gangs / native mesh",
            f"{ours['time_us'] / 1e3:.1f} ms / {native['time_us'] / 1e3:.1f} ms",
            f"{fmt(ours['paired_ratio'])} (paired)",
        ]
    )
    median, worst, where = fake(rows)
    body.append(
        [
            "``FakeGang`` / the plain tensor operation (broadcast, a no-op, left out)",
            "",
            f"{fmt(median)} (worst {fmt(worst)}, {where})",
        ]
    )
    for world in sorted({r["world_size"] for r in rows if r["op"] == "dry_run_setup"}):
        gang, torch_ = index_dry(rows, world)
        body.append(
            [
                f"dry run, one rank of {world:,}: gangs and mesh / ``init_device_mesh``",
                f"{gang['time_us'] / 1e6:.3f} s, {gang['peak_mib']:.1f} MiB / "
                f"{torch_['time_us'] / 1e6:.3f} s, {torch_['peak_mib']:.1f} MiB",
                fmt(gang["time_us"] / torch_["time_us"]),
            ]
        )
    return table("Set-up and simulation", ["measurement", "time", "ratio"], body, data.run(QUICK))


def fake(rows: Sequence[Row]) -> tuple[float, float, str]:
    """``FakeGang``'s median and worst time ratio to the plain operation, and where the worst is."""
    index = by(rows, "impl", "op", "bytes")
    found = {
        (op, nbytes): index[("fake", op, nbytes)]["time_us"] / row["time_us"]
        for (impl, op, nbytes), row in index.items()
        if impl == "plain" and op != "broadcast" and ("fake", op, nbytes) in index
    }
    (op, nbytes) = max(found, key=lambda k: found[k])
    return statistics.median(found.values()), found[(op, nbytes)], f"{op} {size(nbytes)}"


def index_dry(rows: Sequence[Row], world: int) -> tuple[Row, Row]:
    """The gang and torch dry-run rows at ``world`` ranks."""
    index = by((r for r in rows if r["op"] == "dry_run_setup"), "impl", "world_size")
    return index[("gang", world)], index[("torch", world)]


TRAFFIC_FILE = "traffic.json"


def traffic(data: Data) -> str:
    """Per traffic operation, the median over sizes of gang / raw torch and the worst size; the overlap's gain."""
    rows = data.rows(TRAFFIC_FILE)
    world = rows[0]["world_size"]
    found = ratios(rows, "gang", TRAFFIC, world)
    body = []
    for op in TRAFFIC:
        mine = {k: v for k, v in found.items() if k[0] == op}
        (_, nbytes) = max(mine, key=lambda k: mine[k])
        body.append(
            [f"``{op}``", fmt(statistics.median(mine.values())), f"{fmt(mine[(op, nbytes)])} at {size(nbytes)}"]
        )
    for impl in ("gang", "torch"):
        gains = [r["overlap_gain"] for r in rows if r["impl"] == impl and r["op"] == "overlap"]
        what = f"the overlap's gain over sequential calls through {impl} (paired)"
        body.append([what, fmt(statistics.median(gains), 2), ""])
    title = f"gang / raw torch on {world} ranks: median over sizes of the paired ratio, and the worst size"
    return table(title, ["operation", "median", "worst size"], body, data.run(TRAFFIC_FILE))


SMALL_FILE = "small_messages.json"


def small_messages(data: Data) -> str:
    """Per collective at 4 bytes: median times, the calling thread's CPU time and the paired ratio."""
    rows = data.rows(SMALL_FILE)
    index = by(rows, "impl", "op")
    body = []
    for op in dict.fromkeys(r["op"] for r in rows):
        torch_, gang = index[("torch", op)], index[("gang", op)]
        body.append(
            [
                f"``{op}``",
                fmt(torch_["time_us"], 1),
                fmt(gang["time_us"], 1),
                fmt(torch_["cpu_us"], 1),
                fmt(gang["cpu_us"], 1),
                f"{fmt(gang['paired_ratio'])} [{fmt(gang['q1'], 2)}, {fmt(gang['q3'], 2)}]",
            ]
        )
    world = rows[0]["world_size"]
    header = ["collective", "torch us", "gang us", "cpu torch us", "cpu gang us", "gang / torch [quartiles]"]
    return table(f"4-byte collectives on {world} ranks", header, body, data.run(SMALL_FILE))


JAX_P2P = "jax_send_recv.json"


def jax_send_recv(data: Data) -> str:
    """Per size, the ``send_recv`` ring through ``JaxGang`` against the raw ``ppermute`` program."""
    rows = data.rows(JAX_P2P)
    index = by(rows, "impl", "bytes")
    body = [
        [
            size(nbytes),
            fmt(raw["time_us"], 0),
            fmt(index[("gang-jax", nbytes)]["time_us"], 0),
            fmt(index[("gang-jax", nbytes)]["paired_ratio"]),
        ]
        for (impl, nbytes), raw in sorted(index.items(), key=lambda kv: kv[0][1])
        if impl == "jax"
    ]
    header = ["size per rank", "raw JAX us", "JaxGang us", "JaxGang / raw JAX (paired)"]
    return table("A ``send_recv`` ring on 2 processes", header, body, data.run(JAX_P2P))


JAX_COST = "jax_cost.json"
JAX_PAIRS = (("gang-jax-functional", "jax"), ("gang-jax", "jax-from-torch"))
"""Each JAX API and its yardstick: ``gang_jax.functional`` on resident ``jax.Array`` s against the raw program
on them, ``JaxGang`` on torch tensors against raw JAX fed from torch tensors."""
JAX_CONTROL = "jax-lane"
"""The control of ``jax_cost.json``: the raw program run on the gang's worker thread (the thread hand-off alone)."""


def jax_cost(data: Data) -> str:
    """Per collective and size, each JAX API against its own raw-JAX yardstick (see :data:`JAX_PAIRS`)."""
    rows = data.rows(JAX_COST)
    index = by(rows, "impl", "op", "bytes")
    body = []
    for op in COLLECTIVES:
        for nbytes in sorted({r["bytes"] for r in rows if r["op"] == op}):
            cells = [f"``{op}``", size(nbytes)]
            for ours, base in JAX_PAIRS:
                mine, theirs = index.get((ours, op, nbytes)), index.get((base, op, nbytes))
                ratio = None if mine is None else paired(mine, base)
                cells += [
                    "\\-" if theirs is None else fmt(theirs["time_us"], 0),
                    "\\-" if mine is None else fmt(mine["time_us"], 0),
                    fmt(ratio),
                ]
            control = index.get((JAX_CONTROL, op, nbytes))
            if control is not None:
                functional_row = index.get(("gang-jax-functional", op, nbytes))
                cells += [
                    fmt(paired(control, "jax")),
                    "\\-" if functional_row is None else fmt(paired(functional_row, JAX_CONTROL)),
                ]
            body.append(cells)
    world = rows[0]["world_size"]
    header = [
        "collective",
        "size",
        "raw JAX, resident us",
        "functional us",
        "functional / raw",
        "raw JAX from torch us",
        "JaxGang us",
        "JaxGang / raw from torch",
    ]
    if any(r["impl"] == JAX_CONTROL for r in rows):
        header += ["raw on the worker thread / raw (hand-off)", "functional / raw on the worker thread"]
    return table(f"Each JAX API against its yardstick on {world} processes", header, body, data.run(JAX_COST))


FT = "quick_ft.json"


def ft(data: Data) -> str:
    """gang.ft's per-step cost and recovery times on 3 one-process replicas."""
    rows = data.rows(FT)
    index = by(rows, "impl", "op")
    body = []
    for step in ("50ms", "10ms"):
        plain, ours = index.get(("plain", f"ft_step_{step}")), index.get(("gang.ft", f"ft_step_{step}"))
        if plain and ours:
            body.append(
                [
                    f"per step, {step[:-2]} ms step ({ours['micro_batches']} micro-batches): plain / gang.ft",
                    f"{plain['time_us'] / 1e3:.1f} / {ours['time_us'] / 1e3:.1f} ms",
                    f"{fmt(ours['ratio'])} (paired {fmt(ours['paired_ratio'])})",
                ]
            )
    for impl, what in (("gang.ft", "1 s timeout"), ("gang.ft@60s", "60 s timeout")):
        kill, restart = index.get((impl, "ft_kill_to_commit")), index.get((impl, "ft_restart_to_commit"))
        if kill:
            body.append([f"SIGKILL → survivors' next commit, {what}", f"{kill['time_us'] / 1e6:.2f} s", cycles(kill)])
        if restart:
            body.append(
                [
                    f"launch → restarted replica's first commit, {what}",
                    f"{restart['time_us'] / 1e6:.2f} s",
                    f"{cycles(restart)}; torch imported {restart['imported_s']:.2f} s, model and optimizer built "
                    f"{restart['built_s']:.2f} s, joined {restart['joined_s']:.2f} s",
                ]
            )
    return table("gang.ft on 3 replicas of 1 process", ["measurement", "median", "detail"], body, data.run(FT))


def cycles(row: Row) -> str:
    """The samples of a recovery row, in seconds."""
    return "cycles " + ", ".join(f"{s:.2f}" for s in row["samples"])


HSDP = "quick_ft_hsdp.json"


def hsdp(data: Data) -> str:
    """HSDP across fault-tolerant replicas: per-step cost against a static mesh, and recovery."""
    rows = data.rows(HSDP)
    index = by(rows, "impl", "op")
    body = []
    for step, label in (("50ms", "50 ms step"), ("10ms", "shortest step")):
        static, ours = index.get(("static", f"hsdp_step_{step}")), index.get(("gang.ft", f"hsdp_step_{step}"))
        if static and ours:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in ours["phases_ms"].items() if v >= 0.05)
            body.append(
                [
                    f"per step, {label}: static / gang.ft",
                    f"{static['time_us'] / 1e3:.1f} / {ours['time_us'] / 1e3:.1f} ms",
                    f"{fmt(ours['ratio'])} (paired {fmt(ours['paired_ratio'])}); gang.ft's phases (ms): {phases}",
                ]
            )
    for op, what in (
        ("hsdp_kill_to_commit", "SIGKILL of one process → the other replica's next commit"),
        ("hsdp_restart_to_commit", "relaunch → first commit after healing"),
    ):
        row = index.get(("gang.ft", op))
        if row:
            body.append([what, f"{row['time_us'] / 1e6:.2f} s", cycles(row)])
    title = "HSDP: 2 replicas of 2 processes against FSDP2's own HSDP"
    return table(title, ["measurement", "median", "detail"], body, data.run(HSDP))


def recorded(data: Data) -> str:
    """The figures this machine cannot reproduce (against torchft), each with its command."""
    body = [
        [r["measurement"], r["gang.ft"], r["torchft"], f"``{r['command']}``; {r['conditions']}"] for r in data.recorded
    ]
    source = (
        "``recorded.json``: figures of runs with torchft 0.2.0 installed in a separate environment; "
        "re-run the command with ``--torchft-python`` to replace them."
    )
    return table(
        "Against torchft 0.2.0 (recorded)", ["measurement", "gang.ft", "torchft", "command; conditions"], body, source
    )


RECORDER = "quick_recorder_cost.json"


def recorder_cost(data: Data) -> str:
    """What recording one operation costs, gang's flight recorder and torch's own, per round and their medians."""
    rows = data.rows(RECORDER)
    body = [
        [
            str(number),
            f"{row['torch_off_us']:.2f} / {row['torch_on_us']:.2f}",
            f"{row['torch_recorder_us']:.2f}",
            f"{row['gang_recorder_us']:.2f}",
        ]
        for number, row in enumerate(rows, 1)
    ]
    median = statistics.median
    body.append(
        [
            "median",
            "\\-",
            f"{median(r['torch_recorder_us'] for r in rows):.2f}",
            f"{median(r['gang_recorder_us'] for r in rows):.2f}",
        ]
    )
    header = ["round", "torch all_reduce, us: recorder off / on", "torch's recorder, us", "gang's recorder, us"]
    return table("Recording one operation (a gloo group of one process)", header, body, data.run(RECORDER))


# --------------------------------------------------------------------------------------------------
# The targets, each checked against the results
# --------------------------------------------------------------------------------------------------


DILOCO_JAX = "quick_ft_diloco_jax.json"


def diloco_jax(data: Data) -> str:
    """DiLoCo for JAX models against DiLoCo for torch modules, on the same model in the same processes."""
    index = by(data.rows(DILOCO_JAX), "impl")
    body = []
    for impl, what in (
        ("gang.ft", "torch module (``gang.ft.DiLoCo``)"),
        ("gang_jax.ft", "JAX pytree (``gang_jax.ft.DiLoCo``)"),
    ):
        row = index[(impl,)]
        body.append(
            [
                what,
                f"{row['time_us'] / 1e3:.1f} ms",
                f"{row['inner_ms']:.1f} ms",
                f"{row['sync_ms']:.1f} ms",
                f"{fmt(row['sync_ratio'])} / {fmt(row['ratio'])}" if "sync_ratio" in row else "\\-",
            ]
        )
    header = ["DiLoCo over", "outer step", "inner steps", "sync", "JAX / torch: sync / outer step"]
    return table("DiLoCo, JAX and torch, 3 replicas of 1 process", header, body, data.run(DILOCO_JAX))


DILOCO_RATE = "hosts_diloco_rate.json"


def diloco_rate(data: Data) -> str:
    """Streaming DiLoCo on test hosts with one replica's link rate-limited, against the unlimited link."""
    index = by(data.rows(DILOCO_RATE), "link")
    unlimited = index[("unlimited",)]
    body = []
    for link, what in (("unlimited", "as it is (veth pair)"), ("limited", "limited by ``tbf``")):
        row = index[(link,)]
        rate = row["rate_bits_per_second"]
        body.append(
            [
                what if rate is None else f"{what} to {rate / 1e6:g} Mbit/s",
                f"{row['bytes_per_exchange'] / 1e6:.2f} MB",
                f"{row['outer_step_s']:.3f} s",
                f"{row['outer_step_s'] / unlimited['outer_step_s']:.1f}x",
                "\\-" if rate is None else f"{row['bytes_per_exchange'] * 8 / rate:.3f} s",
                str(row["syncs"]),
            ]
        )
    header = ["replica 2's link", "sent per exchange", "outer step (median)", "against unlimited", "bytes / rate"]
    header.append("exchanges")
    return table("Streaming DiLoCo, 3 replicas on test hosts, 2 fragments", header, body, data.run(DILOCO_RATE))


DILOCO = "quick_ft_diloco.json"
DILOCO_CONFIGS = {
    "localsgd": "LocalSGD",
    "localsgd_int8": "LocalSGD, ``int8``",
    "diloco": "DiLoCo",
    "diloco_int8": "DiLoCo, ``int8``",
    "diloco_float8": "DiLoCo, ``float8``",
    "streaming": "Streaming, 2 fragments, delay 1",
    "streaming_int8": "Streaming, delay 1, ``int8``",
    "streaming_d2": "Streaming, 2 fragments, delay 2",
}
"""The configurations of ``benchmarks.ft_diloco``, in the order of its table (its ``CONFIGS``)."""


def _pair(ours: Row, theirs: Row, key: str, digits: int = 0) -> str:
    """``key`` of gang.ft's row and of torchft's: ``"79 / 97"``."""
    return f"{ours[key]:.{digits}f} / {theirs[key]:.{digits}f}"


def diloco(data: Data) -> str:
    """gang.ft's LocalSGD and DiLoCo against torchft 0.2's, paired: per outer step, its sync's parts, the bytes."""
    rows = data.rows(DILOCO)
    index = by(rows, "impl", "op")
    body = []
    for config, what in DILOCO_CONFIGS.items():
        ours, theirs = (
            index.get(("gang.ft", f"diloco_{config}_outer_step")),
            index.get(("torchft", f"diloco_{config}_outer_step")),
        )
        sent = index.get(("gang.ft", f"diloco_{config}_bytes")), index.get(("torchft", f"diloco_{config}_bytes"))
        if ours is None or theirs is None or None in sent:
            continue

        body.append(
            [
                what,
                f"{ours['time_us'] / 1e3:.0f} / {theirs['time_us'] / 1e3:.0f}",
                f"{fmt(ours['ratio'], 2)} ({fmt(ours['paired_ratio'], 2)})",
                _pair(ours, theirs, "sync_ms"),
                _pair(ours, theirs, "quorum_ms"),
                _pair(ours, theirs, "vote_ms", 1),
                f"{ours['pack_ms']:.1f} / {ours['update_ms']:.1f}",
                " / ".join(f"{row['bytes_sent'] / 1e6:.2f}" for row in sent if row is not None),
            ]
        )
    header = [
        "configuration",
        "outer step, ms",
        "ratio (paired)",
        "syncs, ms",
        "of which quorum",
        "vote",
        "gang.ft pack / update",
        "MB sent",
    ]
    text = table("Per outer step, gang.ft / torchft 0.2 (medians; 3 replicas)", header, body, data.run(DILOCO))
    overlap = index.get(("gang.ft", "diloco_overlap"))
    if overlap is not None:
        delays = sorted(int(k.removeprefix("outer_ms_delay")) for k in overlap if k.startswith("outer_ms_delay"))
        cells = [
            [
                str(d),
                f"{overlap[f'outer_ms_delay{d}']:.0f}",
                f"{overlap[f'sync_ms_delay{d}']:.0f}",
                f"{overlap[f'waited_ms_delay{d}']:.1f}",
                fmt(overlap.get(f"hidden_delay{d}"), 2) if d else "\\-",
            ]
            for d in delays
        ]
        title = f"Streaming DiLoCo's overlap (gang.ft; one fragment's exchange alone: {overlap['exchange_ms']:.1f} ms)"
        header = ["``fragment_sync_delay``", "outer step, ms", "syncs, ms", "waited at the vote, ms", "share hidden"]
        text += "\n" + table(title, header, cells, data.run(DILOCO))
    recovery = []
    for key, what in (
        ("kill_to_sync", "``SIGKILL`` to the survivors' next sync"),
        ("restart_to_sync", "restart (launch) to taking part in a sync"),
    ):
        found = [index.get((impl, f"diloco_{key}")) for impl in ("gang.ft", "torchft")]
        if None in found:
            continue
        recovery.append(
            [what]
            + [
                f"{row['time_us'] / 1e6:.2f} s ({', '.join(f'{s:.2f}' for s in row['samples'])})"
                for row in found
                if row is not None
            ]
        )
    if recovery:
        title = "Recovery, DiLoCo, 1 s timeouts (medians; every cycle in brackets)"
        text += "\n" + table(title, ["figure", "gang.ft", "torchft 0.2"], recovery, data.run(DILOCO))
    return text


def targets(data: Data) -> str:
    """Each target, what the committed results measure, and whether that meets it."""
    quick, traffic_rows = data.rows(QUICK), data.rows(TRAFFIC_FILE)
    body: list[list[str]] = []
    quiet = {r["target"]: r for r in data.recorded if "target" in r}

    def also(*tags: str) -> str:
        """The recorded quiet-machine figures of gang.ft for ``tags`` (see `recorded`), if any."""
        found = [quiet[t]["gang.ft"] for t in tags if t in quiet]
        return f"; on a quiet machine (recorded): {' and '.join(found)}" if found else ""

    def add(target: str, measured: str, met: bool, source: str) -> None:
        body.append([target, measured, "met" if met else "not met", f"``{source}``"])

    for limit, small in ((1.05, True), (1.02, False)):
        per_world = {}
        for world in (2, 4):
            below, above, _, _ = split_summary(ratios(quick, "gang", COLLECTIVES, world))
            per_world[world] = below if small else above
        where = "below 64 KiB" if small else "from 64 KiB"
        measured = ", ".join(f"{fmt(v)} ({w} ranks)" for w, v in per_world.items())
        add(
            f"``ProcessGroupGang`` / raw torch <= {limit} {where} (median over sizes)",
            measured,
            max(per_world.values()) <= limit,
            QUICK,
        )
    cost = data.rows(JAX_COST)
    for (ours, base), limit, what in zip(
        JAX_PAIRS,
        (1.05, 1.10),
        (
            "``gang_jax.functional`` on ``jax.Array`` s / the raw JAX program on resident arrays",
            "``JaxGang`` on torch tensors / raw JAX fed from torch tensors (tensor handed to JAX, program, result "
            "copied back)",
        ),
        strict=True,
    ):
        found = ratios(cost, ours, COLLECTIVES, cost[0]["world_size"], base)
        (op, nbytes), worst = max(found.items(), key=lambda kv: kv[1])
        over = sum(v > limit for v in found.values())
        add(
            f"{what} <= {limit:.2f} at every size",
            f"worst {fmt(worst)} ({op} {size(nbytes)}), median {fmt(statistics.median(found.values()))}; "
            f"{over} of {len(found)} sizes over",
            worst <= limit,
            JAX_COST,
        )
    functional = ratios(cost, "gang-jax-functional", COLLECTIVES, cost[0]["world_size"], "jax")
    large = {k: v for k, v in functional.items() if k[1] >= SMALL}
    (op, nbytes), worst = max(large.items(), key=lambda kv: kv[1])
    control = ratios(cost, "gang-jax-functional", COLLECTIVES, cost[0]["world_size"], JAX_CONTROL)
    hand_off = ratios(cost, JAX_CONTROL, COLLECTIVES, cost[0]["world_size"], "jax")
    split = ""
    if control:
        large_control = {k: v for k, v in control.items() if k[1] >= SMALL}
        (c_op, c_bytes), c_worst = max(large_control.items(), key=lambda kv: kv[1])
        large_hand_off = [v for k, v in hand_off.items() if k[1] >= SMALL]
        split = (
            f"; without the thread hand-off (paired with the raw program run on the gang's worker thread) worst "
            f"{fmt(c_worst)} ({c_op} {size(c_bytes)}), median {fmt(statistics.median(large_control.values()))}; "
            f"the hand-off alone median {fmt(statistics.median(large_hand_off))}, worst {fmt(max(large_hand_off))}"
        )
    add(
        "``gang_jax.functional`` / the raw JAX program on resident arrays <= 1.05 from 64 KiB",
        f"worst {fmt(worst)} ({op} {size(nbytes)}), median {fmt(statistics.median(large.values()))}{split}",
        worst <= 1.05,
        JAX_COST,
    )
    small_rows = [r for r in data.rows(SMALL_FILE) if r["impl"] == "gang"]
    worst_small = max(small_rows, key=lambda r: r["paired_ratio"])
    add(
        "``ProcessGroupGang`` / raw torch <= 1.02 at 4 bytes on 2 ranks, every collective",
        f"worst {fmt(worst_small['paired_ratio'])} ({worst_small['op']}); "
        + ", ".join(f"{r['op']} {fmt(r['paired_ratio'])}" for r in small_rows if r is not worst_small),
        worst_small["paired_ratio"] <= 1.02,
        SMALL_FILE,
    )
    ft_index = by(data.rows(FT), "impl", "op")
    for name, prefix, what, file in (
        ("``gang.ft``", "ft_step", "10 ms step", FT),
        ("``gang.ft`` HSDP", "hsdp_step", "shortest step", HSDP),
    ):
        index = by(data.rows(file), "impl", "op")
        steps = {
            s: index[("gang.ft", f"{prefix}_{s}")]["ratio"]
            for s in ("50ms", "10ms")
            if ("gang.ft", f"{prefix}_{s}") in index
        }
        if len(steps) == 2:
            add(
                f"{name}: per step <= 1.05 (50 ms step), <= 1.25 ({what})"
                + (" of a static mesh" if prefix == "hsdp_step" else ""),
                f"{fmt(steps['50ms'])} and {fmt(steps['10ms'])}" + also(f"{prefix}_50ms", f"{prefix}_10ms"),
                steps["50ms"] <= 1.05 and steps["10ms"] <= 1.25,
                file,
            )
    kill = ft_index.get(("gang.ft", "ft_kill_to_commit"))
    if kill and "ft_kill" in quiet:
        seconds, theirs = kill["time_us"] / 1e6, quiet["ft_kill"]["torchft"]
        add(
            "``gang.ft``: SIGKILL → the survivors' next commit no slower than torchft",
            f"{seconds:.2f} s against torchft's {theirs} (recorded){also('ft_kill')}",
            seconds <= float(theirs.split()[0]),
            FT,
        )
    restart = ft_index.get(("gang.ft", "ft_restart_to_commit"))
    if restart:
        seconds = restart["time_us"] / 1e6
        add(
            "``gang.ft``: launch of a restarted replica → participating under 3 s",
            f"{seconds:.2f} s, of which torch's import {restart['imported_s']:.2f} s and the model and optimizer "
            f"until {restart['built_s']:.2f} s" + also("ft_restart"),
            seconds < 3,
            FT,
        )
    jax_sync = by(data.rows(DILOCO_JAX), "impl")[("gang_jax.ft",)]["sync_ratio"]
    add(
        "``gang_jax.ft.DiLoCo``'s sync <= 1.10 of ``gang.ft.DiLoCo``'s (same model, same processes)",
        fmt(jax_sync),
        jax_sync <= 1.10,
        DILOCO_JAX,
    )
    groups = by(quick, "impl", "op")
    ratio = groups[("gang", "create_groups")]["time_us"] / groups[("torch", "create_groups")]["time_us"]
    add(
        "gang creation no slower than ``init_device_mesh`` (pp=2, dp=2, tp=2 on 8 ranks)",
        fmt(ratio),
        ratio <= 1.0,
        QUICK,
    )
    median, worst, where = fake(quick)
    add(
        "``FakeGang`` within 2x of the plain operation",
        f"median {fmt(median, 2)}, worst {fmt(worst, 2)} ({where})",
        worst <= 2,
        QUICK,
    )
    biggest = max(r["world_size"] for r in quick if r["op"] == "dry_run_setup")
    gang, torch_ = index_dry(quick, biggest)
    add(
        f"dry run at {biggest:,} ranks: gangs <= 2 s and 512 MiB, no slower than ``init_device_mesh``",
        f"{gang['time_us'] / 1e6:.3f} s and {gang['peak_mib']:.1f} MiB against {torch_['time_us'] / 1e6:.3f} s",
        gang["time_us"] <= 2e6 and gang["peak_mib"] <= 512 and gang["time_us"] <= torch_["time_us"],
        QUICK,
    )
    fsdp = groups[("gang-mesh", "fsdp_step")]["paired_ratio"]
    add("FSDP2 step through our mesh 1.00 +- 0.02 of native", fmt(fsdp), abs(fsdp - 1) <= 0.02, QUICK)
    world = traffic_rows[0]["world_size"]
    found = ratios(traffic_rows, "gang", TRAFFIC, world)
    moved = {k: v for k, v in found.items() if k[0] != "exchange_rows"}
    (op, nbytes) = max(moved, key=lambda k: moved[k])
    add(
        "``send``/``recv``, ``send_recv`` ring, skewed ``all_to_all_uneven``, async ``all_reduce`` overlapped with "
        "compute: gang / raw torch <= 1.02 at every size",
        f"worst {fmt(moved[(op, nbytes)])} ({op} {size(nbytes)})",
        moved[(op, nbytes)] <= 1.02,
        TRAFFIC_FILE,
    )
    rows_ratio = {k: v for k, v in found.items() if k[0] == "exchange_rows"}
    worst_rows = max(rows_ratio.values())
    add(
        "``exchange_rows`` <= 1.10 of the two raw calls at every size",
        f"worst {fmt(worst_rows)}",
        worst_rows <= 1.10,
        TRAFFIC_FILE,
    )
    p2p = [r["paired_ratio"] for r in data.rows(JAX_P2P) if r["impl"] == "gang-jax"]
    add(
        "``JaxGang`` point to point (a ``send_recv`` ring) <= 1.10 of the raw JAX ``ppermute`` program",
        ", ".join(fmt(v, 2) for v in p2p),
        max(p2p) <= 1.10,
        JAX_P2P,
    )
    return table(
        "Targets, checked against the results on this page", ["target", "measured", "verdict", "from"], body, ""
    )


TABLES: dict[str, Callable[[Data], str]] = {
    "targets": targets,
    "collectives": collectives,
    "collectives_summary": collectives_summary,
    "setup": setup,
    "traffic": traffic,
    "small_messages": small_messages,
    "jax_send_recv": jax_send_recv,
    "jax_cost": jax_cost,
    "ft": ft,
    "hsdp": hsdp,
    "diloco": diloco,
    "diloco_jax": diloco_jax,
    "diloco_rate": diloco_rate,
    "recorded": recorded,
    "recorder_cost": recorder_cost,
}
"""Each table's file name (``perf_<name>.rst``) and the function that writes it."""


def write(data_folder: Path = DATA, out: Path = OUT) -> list[Path]:
    """Write every table of :data:`TABLES` from the results in ``data_folder`` into ``out``; return the files."""
    data = Data(data_folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in TABLES.items():
        path = out / f"perf_{name}.rst"
        text = make(data)
        if not path.exists() or path.read_text() != text:  # unchanged files keep Sphinx's cache valid
            path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data", type=Path, default=DATA, help="the folder of result files (default: docs/_static/perf)"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the tables (default: docs/_generated)")
    args = parser.parse_args(argv)
    for path in write(args.data, args.out):
        print(path)


if __name__ == "__main__":
    main()
