"""Pure arithmetic of :mod:`gang.bench`: bandwidths, medians, result rows, the tables and the summary.

Bandwidths follow the usual conventions of collective benchmarks: the *algorithm bandwidth* is
the size of the full buffer divided by the time, and the *bus bandwidth* scales it by a factor
that depends on the collective, so that it can be compared with the peak bandwidth of a link
whatever the number of ranks. ``bytes`` is always the full buffer: the buffer that is reduced
(``all_reduce``), the gathered output (``all_gather``), the input that is reduced and scattered
(``reduce_scatter``), the whole send buffer (``all_to_all``) and the broadcast buffer.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
"""The collectives that are timed, in the order they are reported."""

TRAFFIC_OPS = ("send", "send_recv_ring", "all_to_all_uneven", "exchange_rows", "overlap")
"""The point-to-point, uneven and overlapped operations :mod:`gang.bench.traffic` times (``--traffic``).

``bytes`` is the message of ``send`` and ``send_recv_ring``, each rank's send buffer of
``all_to_all_uneven`` and ``exchange_rows``, and all the buckets of ``overlap`` (all-reduced).
"""

PAIRS = (
    ("gang", "torch"),
    ("gang-jax", "jax-from-torch"),
    ("gang-jax-functional", "jax"),
    ("gang-jax", "jax"),
    ("gang-jax-functional", "jax-lane"),
    ("jax-lane", "jax"),
    ("gang", "gang-untraced"),
    ("gang-jax", "gang-jax-untraced"),
)
"""(ours, the baseline) pairs whose time ratio is the overhead of our API over the raw one, then the cost of the
flight recorder (``-untraced``: the same gang with it off, see ``--recorder``). ``JaxGang`` on torch tensors is
paired with raw JAX fed from torch tensors (``jax-from-torch``), then with raw JAX on resident arrays (``jax``),
which copies nothing; ``gang_jax.functional`` on resident arrays with raw JAX on them, then with the raw program
run on the gang's worker thread (``jax-lane``, a control), which is itself paired with raw JAX: the thread
hand-off's share."""

ROW_KEYS = ("impl", "op", "bytes", "world_size", "time_us", "algbw_gbps", "busbw_gbps")
"""The keys every JSON row has (extra keys may follow)."""

Row = dict[str, Any]


def bus_factor(op: str, world_size: int) -> float:
    """Return the factor that turns the algorithm bandwidth of ``op`` on ``world_size`` ranks into the bus bandwidth.

    The traffic operations (:data:`TRAFFIC_OPS`) take the factor of the collective they resemble:
    ``send`` and ``send_recv_ring`` 1 (each rank moves its buffer once, as ``broadcast``), the
    uneven exchanges that of ``all_to_all`` (exact for even splits; the skewed splits the benchmark
    sends keep more on rank 0), ``overlap`` that of ``all_reduce``.

    :raises ValueError: If ``op`` is not a known operation or ``world_size`` is not positive.
    """
    if world_size <= 0:
        raise ValueError(f"`world_size` must be positive, but is {world_size} instead.")
    n = world_size
    if op in ("all_reduce", "overlap"):
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "exchange_rows"):
        return (n - 1) / n
    if op in ("broadcast", "send", "send_recv_ring"):
        return 1.0
    raise ValueError(f"`op` must be one of {OPS + TRAFFIC_OPS}, but is {op!r} instead.")


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Return the algorithm bandwidth in GB/s (10**9 bytes per second) of moving ``nbytes`` in ``seconds``.

    :raises ValueError: If ``seconds`` is not positive or ``nbytes`` is negative.
    """
    if seconds <= 0:
        raise ValueError(f"`seconds` must be positive, but is {seconds} instead.")
    if nbytes < 0:
        raise ValueError(f"`nbytes` must not be negative, but is {nbytes} instead.")
    return nbytes / seconds / 1e9


def busbw_gbps(op: str, nbytes: int, seconds: float, world_size: int) -> float:
    """Return the bus bandwidth in GB/s: the algorithm bandwidth times :func:`bus_factor`."""
    return algbw_gbps(nbytes, seconds) * bus_factor(op, world_size)


def _non_empty(values: Iterable[float]) -> list[float]:
    data = list(values)
    if not data:
        raise ValueError("`values` must not be empty.")
    return data


def median(values: Iterable[float]) -> float:
    """Return the median of ``values`` (the mean of the two middle values for an even count).

    :raises ValueError: If ``values`` is empty.
    """
    return float(statistics.median(_non_empty(values)))


def mean(values: Iterable[float]) -> float:
    """Return the arithmetic mean of ``values``.

    :raises ValueError: If ``values`` is empty.
    """
    return float(statistics.fmean(_non_empty(values)))


def percentile(values: Iterable[float], q: float) -> float:
    """Return the ``q``-th percentile of ``values``, interpolating linearly between the two nearest ranks.

    The 50th percentile is the :func:`median`; this is NumPy's default ("linear") method.

    :raises ValueError: If ``values`` is empty or ``q`` is outside ``[0, 100]``.
    """
    data = sorted(_non_empty(values))
    if not 0 <= q <= 100:
        raise ValueError(f"`q` must be in [0, 100], but is {q} instead.")
    position = (len(data) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(data) - 1)
    return float(data[low] + (data[high] - data[low]) * (position - low))


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Return, for each iteration, the largest time over the ranks.

    This is what the MAX all-reduce of the per-rank times computes on the cluster.

    :param per_rank: ``per_rank[r][i]`` is rank ``r``'s time of iteration ``i``.
    :raises ValueError: If there are no ranks or the ranks ran different numbers of iterations.
    """
    if not per_rank:
        raise ValueError("`per_rank` must hold at least one rank.")
    counts = {len(times) for times in per_rank}
    if len(counts) != 1:
        raise ValueError(f"every rank must have the same number of iterations, but the counts are {sorted(counts)}.")
    return [max(column) for column in zip(*per_rank, strict=False)]


def paired_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """Return the median over iterations of ``ours[i] / baseline[i]``.

    The two calls of one iteration ran back to back, so they saw the same load on the machine;
    the median of these per-iteration ratios is much steadier than the ratio of two medians on a
    busy machine.

    :raises ValueError: If the sequences are empty or of different lengths.
    """
    if len(ours) != len(baseline) or not ours:
        raise ValueError(
            f"`ours` and `baseline` must be non-empty and of one length, not {len(ours)} and {len(baseline)}."
        )
    return median(a / b for a, b in zip(ours, baseline, strict=True))


def make_row(
    impl: str, op: str, nbytes: int, world_size: int, seconds: float, *, bandwidth: bool = True, **extra: Any
) -> Row:
    """Return one JSON row of a measurement.

    :param impl: ``torch``, ``gang``, ``jax``, ``gang-jax`` or the name of another measurement.
    :param op: The operation measured.
    :param nbytes: The full buffer size in bytes (0 where there is no buffer).
    :param world_size: The number of ranks (1 for single-process measurements).
    :param seconds: The median time of one operation.
    :param bandwidth: Whether bandwidths make sense; if not, they are ``None``.
    :param extra: More keys (the iteration count, say), appended after the standard ones.
    """
    row: Row = {
        "impl": impl,
        "op": op,
        "bytes": int(nbytes),
        "world_size": int(world_size),
        "time_us": seconds * 1e6,
        "algbw_gbps": None,
        "busbw_gbps": None,
    }
    if bandwidth and op in OPS + TRAFFIC_OPS and nbytes > 0:
        row["algbw_gbps"] = algbw_gbps(nbytes, seconds)
        row["busbw_gbps"] = busbw_gbps(op, nbytes, seconds, world_size)
    row.update(extra)
    return row


def ratio_table(rows: Iterable[Mapping[str, Any]], ours: str, baseline: str) -> dict[tuple[str, int, int], float]:
    """Return the time ratio of ``ours`` to ``baseline`` keyed by ``(op, world_size, bytes)`` where both were measured.

    The ratio is the row's ``paired_ratio`` (see :func:`paired_ratio`) when it has one, else the
    ratio of the two median times.
    """
    rows = list(rows)
    times: dict[tuple[str, str, int, int], float] = {}
    for row in rows:
        times[(str(row["impl"]), str(row["op"]), int(row["world_size"]), int(row["bytes"]))] = float(row["time_us"])
    out: dict[tuple[str, int, int], float] = {}
    for row in rows:
        if row["impl"] != ours:
            continue
        op, world, nbytes = str(row["op"]), int(row["world_size"]), int(row["bytes"])
        base = times.get((baseline, op, world, nbytes))
        if base is None or base <= 0:
            continue
        paired = _paired(row, baseline)
        out[(op, world, nbytes)] = float(paired) if paired is not None else float(row["time_us"]) / base
    return out


def format_size(nbytes: int) -> str:
    """Return ``nbytes`` in binary units (``4 B``, ``64 KiB``, ``16 MiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """Return the byte count of ``text``: a number with an optional unit ``K``/``M``/``G`` (binary, ``KiB`` too).

    :raises ValueError: If ``text`` is not such a size or is not positive.
    """
    units = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in ("K", "M", "G") else ""
    try:
        value = int(raw[: len(raw) - len(unit)]) * units[unit]
    except ValueError:
        raise ValueError(f"a size must be a number of bytes such as 4, 64K or 16M, but is {text!r} instead.") from None
    if value <= 0:
        raise ValueError(f"a size must be positive, but is {text!r} instead.")
    return value


def pair_ratio(rows: Mapping[str, Mapping[str, Any]], ours: str, baseline: str) -> float | None:
    """Return the ratio ``ours / baseline`` of one (op, size) from its rows keyed by implementation.

    The paired ratio (see :func:`paired_ratio`) when ``ours`` has one, else the ratio of the median
    times; ``None`` when either was not measured.
    """
    if ours not in rows or baseline not in rows:
        return None
    paired = _paired(rows[ours], baseline)
    return float(paired) if paired is not None else float(rows[ours]["time_us"]) / float(rows[baseline]["time_us"])


def _paired(row: Mapping[str, Any], baseline: str) -> Any:
    """A row's paired ratio to ``baseline`` (``paired_ratios``; a row without them has one, ``paired_ratio``)."""
    ratios = row.get("paired_ratios")
    return row.get("paired_ratio") if ratios is None else ratios.get(baseline)


TIME_COLUMNS = ("mean(us)", "p50(us)", "p95(us)", "algbw", "busbw", "#wrong")
"""The columns of each implementation in a table; the bandwidths are of the median (p50) time."""


def table_header(op: str, world_size: int, impls: Sequence[str], backend: str, gang: str = "root") -> str:
    """Return the header of the nccl-tests-style table of one collective: a title line and the column names.

    Columns: ``size`` (bytes of the full buffer), ``count`` (elements), ``type``, then per
    implementation the mean, median (p50) and 95th percentile time (microseconds), ``algbw`` and
    ``busbw`` (GB/s, of the median) and ``#wrong`` (result elements that differ from the expected
    values, summed over the ranks), then each available ratio.

    :param gang: The gang timed: ``root``, or a role such as ``tp`` (every gang of the role at once).
    """
    where = f"{world_size} ranks" if gang == "root" else f"{gang} gangs of {world_size} ranks"
    title = f"# {op} on {where} ({backend}); time: mean, median (p50) and p95 over the iterations of the slowest rank"
    width = sum(_WIDTHS) + len(_WIDTHS)
    names = f"#{'':>11} {'':>10} {'':>8} "
    cols = f"#{'size':>11} {'count':>10} {'type':>8} "
    for impl in impls:
        names += f" {impl:>{width - 1}}"
        cols += "".join(f" {name:>{w}}" for name, w in zip(TIME_COLUMNS, _WIDTHS, strict=True))
    for ours, base in PAIRS:
        if ours in impls and base in impls:
            label = f"{ours}/{base}"
            names += f" {'':>{max(len(label), 8)}}"
            cols += f" {label:>{max(len(label), 8)}}"
    return f"{title}\n{names.rstrip()}\n{cols}"


_WIDTHS = (10, 10, 10, 8, 8, 6)


def table_line(nbytes: int, rows: Mapping[str, Mapping[str, Any]], impls: Sequence[str], dtype: str = "float") -> str:
    """Return one line of the table of one collective from the rows of one size, keyed by implementation."""
    count = int(next(iter(rows.values())).get("count", nbytes // 4)) if rows else nbytes // 4
    line = f"{nbytes:>12} {count:>10} {dtype:>8} "
    for impl in impls:
        row = rows.get(impl)
        if row is None:
            line += "".join(f" {'-':>{w}}" for w in _WIDTHS)
            continue
        p50 = float(row["time_us"])
        wrong = row.get("wrong")
        line += f" {float(row.get('mean_us', p50)):10.1f} {p50:10.1f} {float(row.get('p95_us', p50)):10.1f}"
        line += f" {row['algbw_gbps'] or 0.0:8.4f} {row['busbw_gbps'] or 0.0:8.4f}"
        line += f" {'-' if wrong is None else int(wrong):>6}"
    for ours, base in PAIRS:
        if ours in impls and base in impls:
            width = max(len(ours) + len(base) + 1, 8)
            ratio = pair_ratio(rows, ours, base)
            line += f" {ratio:>{width}.3f}" if ratio is not None else f" {'-':>{width}}"
    return line


def total_wrong(rows: Iterable[Mapping[str, Any]]) -> int:
    """Return the number of wrong result elements over every row (rows without a check count none)."""
    return sum(int(row.get("wrong") or 0) for row in rows)


def summary(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Return the summary lines of collective rows: per (ours, raw) pair and world size, the median
    ratio below and from 64 KiB, the worst ratio, and each collective's ratio at its smallest size
    (one float32 per rank: the cost of the gang's own work on the smallest message).
    """
    rows = list(rows)
    lines = []
    for ours, base in PAIRS:
        table = {k: v for k, v in ratio_table(rows, ours, base).items() if k[0] in OPS}
        for world in sorted({w for (_, w, _) in table}):
            mine = {(o, b): v for (o, w, b), v in table.items() if w == world}
            small = [v for (_, b), v in mine.items() if b < 64 << 10]
            large = [v for (_, b), v in mine.items() if b >= 64 << 10]
            text = f"{ours}/{base} on {world} ranks:"
            if small:
                text += f" median < 64 KiB {median(small):.3f}"
            if large:
                text += f", >= 64 KiB {median(large):.3f}"
            (w_op, w_bytes), worst = max(mine.items(), key=lambda kv: kv[1])
            text += f", worst {worst:.3f} ({w_op} {format_size(w_bytes)})"
            lines.append(text)
            smallest = {op: min(b for (o, b) in mine if o == op) for op in OPS if any(o == op for (o, _) in mine)}
            tiny = [f"{op} {mine[(op, b)]:.3f} ({format_size(b)})" for op, b in smallest.items()]
            lines.append(f"{'':>4}smallest message: " + ", ".join(tiny))
    return lines + traffic_summary(rows)


OVERLAP_PAIRS = (("gang-sequential", "gang"), ("torch-sequential", "torch"))
"""(sequential, overlapped) implementations of ``overlap``: their time ratio is the overlap's gain."""


def traffic_summary(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Return the summary lines of the traffic rows: per world size and operation of :data:`TRAFFIC_OPS`,
    the ``gang/torch`` ratio (median over the sizes, and the worst), and the overlap's gain over
    sequential calls (the time of the sequential calls over the overlapped ones) through each API.
    """
    rows = list(rows)
    ratios = {k: v for k, v in ratio_table(rows, "gang", "torch").items() if k[0] in TRAFFIC_OPS}
    lines = []
    for world in sorted({w for (_, w, _) in ratios}):
        parts = []
        for op in TRAFFIC_OPS:
            mine = {b: v for (o, w, b), v in ratios.items() if o == op and w == world}
            if mine:
                worst = max(mine, key=lambda b: mine[b])
                parts.append(f"{op} {median(mine.values()):.3f} (worst {mine[worst]:.3f} at {format_size(worst)})")
        lines.append(f"gang/torch traffic on {world} ranks: " + ", ".join(parts))
        for sequential, overlapped in OVERLAP_PAIRS:
            gains = [
                v for (o, w, _), v in ratio_table(rows, sequential, overlapped).items() if o == "overlap" and w == world
            ]
            if gains:
                lines.append(
                    f"{'':>4}overlap gain through {overlapped} (sequential / overlapped): median {median(gains):.3f}, "
                    f"from {min(gains):.3f} to {max(gains):.3f}"
                )
    return lines
