"""The command line of ``python -m gang.bench`` (see :mod:`gang.bench`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

import gang
from gang.bench import collectives, metrics
from gang.bench.metrics import OPS, TRAFFIC_OPS, Row
from gang.roles import ROLES, role

LAYOUT_SIZES: dict[str, int | None] = {
    name.removesuffix("_size"): parameter.default
    for name, parameter in inspect.signature(gang.create_parallel_gangs).parameters.items()
    if name.endswith("_size")
}
"""The roles whose sizes lay out ``--gang`` (``--tp``, ``--pp``, ...), with their defaults: the
``<role>_size`` arguments of :func:`gang.create_parallel_gangs`."""

CONTROLS = ("jax-lane",)
"""Implementations timed only when ``--impls`` names them: controls that split another's cost, such as
``jax-lane`` (the raw JAX program run on the JAX gang's worker thread: the thread hand-off alone)."""


def _size(text: str) -> int:
    try:
        return metrics.parse_size(text)
    except ValueError as ex:
        raise argparse.ArgumentTypeError(f"`--sizes`: {ex}") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m gang.bench",
        description="Time every collective through the gang and through raw torch.distributed (and JAX).",
        epilog="Launch it with torchrun, srun or mpirun, or pass --nproc N to start N local processes.",
    )
    parser.add_argument("--nproc", type=int, default=None, help="start this many local processes (torchrun)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 4 MiB and fewer iterations")
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=_size,
        default=None,
        metavar="SIZE",
        help="buffer sizes in bytes, such as 4 64K 16M (default: 4 B and every power of 4 up to 64 MiB)",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: by size)")
    parser.add_argument(
        "--ops", nargs="+", default=list(OPS), choices=OPS + TRAFFIC_OPS, help="the collectives to time (default: all)"
    )
    parser.add_argument(
        "--traffic",
        action="store_true",
        help="time the traffic operations too: send/recv, the send_recv ring, all_to_all_uneven with skewed "
        "splits, exchange_rows, and 8 async all-reduces overlapped with compute (torch and gang only)",
    )
    parser.add_argument(
        "--impls",
        nargs="+",
        default=None,
        metavar="IMPL",
        help="the implementations to time: torch, gang, and those installed packages add (jax, gang-jax)",
    )
    parser.add_argument("--no-jax", action="store_true", help="leave out raw JAX and JaxGang")
    parser.add_argument(
        "--recorder",
        action="store_true",
        help="also time the gangs with the flight recorder off (gang-untraced, gang-jax-untraced), paired: its cost",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=list(collectives.DTYPES), help="the element type (default: float32)"
    )
    parser.add_argument(
        "--gang",
        default="root",
        choices=ROLES,
        help="the gang to time: root (every process), or one gang of the layout --tp/--pp/--cp/--ep/--etp, "
        "each gang of that role at once (torch and gang only)",
    )
    for name, default in LAYOUT_SIZES.items():
        shown = default if default is not None else f"the {role(name).omitted} size"
        parser.add_argument(
            f"--{name}", type=int, default=default, help=f"{role(name).title} size of the layout (default: {shown})"
        )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda:LOCAL_RANK when available)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here, and PNG plots next to it")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")
    args = parser.parse_args(argv)
    if args.traffic:
        args.ops = [*args.ops, *(op for op in TRAFFIC_OPS if op not in args.ops)]
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"`--nproc` must be at least 1, but is {args.nproc} instead.")
    if args.iters is not None and args.iters < 1:
        parser.error(f"`--iters` must be at least 1, but is {args.iters} instead.")
    for name in LAYOUT_SIZES:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"`--{name}` must be at least 1, but is {value} instead.")
    if args.impls is not None:
        known = [*collectives.TorchImpls.names]
        if not set(args.impls) <= set(known):
            known += [name for make in collectives.providers().values() for name in make.names]
        unknown = [impl for impl in args.impls if impl not in known]
        if unknown:
            parser.error(f"`--impls` must name some of {', '.join(known)}, but names {', '.join(unknown)} too.")
    return args


def launch_local(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m gang.bench argv`` on ``nproc`` local processes with torchrun; return its exit code."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # The processes import gang from where this one did, installed or not.
    source = str(Path(gang.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run([*command, "-m", "gang.bench", *argv], env=env, check=False).returncode


def without_nproc(argv: Sequence[str]) -> list[str]:
    """Return the arguments without ``--nproc N`` (or ``--nproc=N``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


class Progress:
    """Progress on stderr (rank 0): one updating line on a terminal, one line per collective otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self.op = ""

    def __call__(self, op: str, nbytes: int, index: int, total: int) -> None:
        """Show that measurement ``index`` of ``total`` (``op`` at ``nbytes``) starts."""
        elapsed = time.perf_counter() - self.started
        text = f"[gang.bench] {index + 1}/{total} {op} {metrics.format_size(nbytes)} ({elapsed:.0f} s)"
        if self.tty:
            self.stream.write(f"\r\033[K{text}")
        elif op != self.op:
            self.stream.write(f"{text}\n")
        self.op = op
        self.stream.flush()

    def done(self) -> None:
        """Show the total time."""
        text = f"[gang.bench] done in {time.perf_counter() - self.started:.0f} s"
        self.stream.write(f"\r\033[K{text}\n" if self.tty else f"{text}\n")
        self.stream.flush()


def default_impls(args: argparse.Namespace, device: torch.device) -> tuple[list[str], list[collectives.Provider]]:
    """Return the implementations to time and the makers of those that installed packages add.

    torch and gang, plus those of every provider (:func:`gang.bench.collectives.providers`) that
    runs on ``device`` (raw JAX and JaxGang on the CPU when gang_jax is installed), unless
    ``--impls`` names some or ``--no-jax`` leaves out the ``jax`` provider. The ``-untraced``
    implementations (the flight recorder off) come only with ``--recorder`` or when ``--impls``
    names them, and the controls (:data:`CONTROLS`) only when ``--impls`` names them. Only the root
    gang (``--gang root``) is timed by providers, and only on the collectives (not on the traffic
    operations of ``--traffic``).
    """
    wanted = None if args.impls is None else set(args.impls)
    makers: list[collectives.Provider] = []
    names: list[str] = [*collectives.TorchImpls.names]
    collectives_timed = any(op in OPS for op in args.ops)
    if args.gang == "root" and collectives_timed and (wanted is None or not wanted <= set(names)):
        for key, make in collectives.providers().items():
            if (key == "jax" and args.no_jax) or device.type not in make.device_types:
                continue
            if wanted is None or wanted & set(make.names):
                makers.append(make)
                names += make.names
    chosen = [name for name in names if (name in wanted if wanted is not None else True)]
    if wanted is None and not args.recorder:  # the recorder's cost only when asked for
        chosen = [name for name in chosen if not name.endswith("-untraced")]
    if wanted is None:  # controls only when named
        chosen = [name for name in chosen if name not in CONTROLS]
    return chosen, makers


def layout_gang(root: gang.ProcessGroupGang, args: argparse.Namespace) -> gang.Gang:
    """Return the gang that ``--gang`` names: ``root``, or this rank's gang of that role in the layout."""
    if args.gang == "root":
        return root
    gangs = gang.create_parallel_gangs(root, **{f"{name}_size": getattr(args, name) for name in LAYOUT_SIZES})
    chosen: gang.Gang = getattr(gangs, args.gang)
    if chosen.size == 1:
        raise ValueError(
            f"`--gang` must name a gang of more than one rank, but `{args.gang}` has 1 rank in this layout "
            f"(world {root.size}, {_layout_text(args, ' ')}) instead."
        )
    return chosen


def environment(root: gang.ProcessGroupGang, impls: Sequence[str]) -> dict[str, Any]:
    """Return what the JSON records about the run."""
    info: dict[str, Any] = {
        "world_size": root.size,
        "backend": str(dist.get_backend()),
        "device": str(root.device),
        "impls": list(impls),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if root.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(root.device)
    if "jax" in impls or "gang-jax" in impls:
        info["jax"] = importlib.metadata.version("jax")
    return info


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank of a launched job; return 1 if a result was wrong, else 0.

    The root gang is closed however the run ends (a failed collective, an interrupt).
    """
    device = bench_device(args)
    with gang.create_default_gang(device, timeout=timedelta(minutes=10)) as root:
        if not isinstance(root, gang.ProcessGroupGang):
            raise RuntimeError(f"gang.bench needs a process group gang, but got {root!r}.")
        wrong = measure_and_report(root, args, device)
        root.barrier()
    return 1 if wrong else 0


def bench_device(args: argparse.Namespace) -> torch.device:
    """The device of ``--device``: ``cuda:LOCAL_RANK`` when CUDA is available and none (or ``cuda``) is given."""
    if args.device not in (None, "cuda"):
        return torch.device(args.device)
    device = gang.get_default_device()
    if args.device == "cuda" and device.type != "cuda":
        raise RuntimeError("`--device cuda` needs CUDA, but torch.cuda.is_available() is False.")
    return device


def measure_and_report(root: gang.ProcessGroupGang, args: argparse.Namespace, device: torch.device) -> int:
    """Time the collectives on the gang ``args`` asks for; rank 0 prints the tables and the summary
    and writes ``--out``. Return how many result elements were wrong."""
    timed = layout_gang(root, args)
    impls, makers = default_impls(args, device)
    type_name = collectives.TYPE_NAMES.get(args.dtype, args.dtype)
    max_bytes = collectives.QUICK_MAX_BYTES if args.quick else collectives.FULL_MAX_BYTES
    sizes = sorted(set(args.sizes)) if args.sizes else collectives.sizes(max_bytes)
    lead = root.rank == 0
    info = environment(root, impls)
    info.update(dtype=args.dtype, gang=args.gang, gang_size=timed.size)
    if lead:
        print_header(root, args, info, impls, timed.size)
    progress = Progress(sys.stderr) if lead else None
    current = [""]

    def on_row(op: str, nbytes: int, by_impl: dict[str, Row]) -> None:
        if not lead:
            return
        if op != current[0]:
            print("\n" + metrics.table_header(op, timed.size, impls, info["backend"], args.gang), flush=True)
            current[0] = op
        if progress is not None and progress.tty:
            sys.stderr.write("\r\033[K")
        print(metrics.table_line(nbytes, by_impl, impls, type_name), flush=True)

    try:
        rows = collectives.measure(
            timed,
            ops=args.ops,
            impls=impls,
            sizes=sizes,
            dtype=collectives.DTYPES[args.dtype],
            extra=makers,
            quick=args.quick,
            iters=args.iters,
            on_row=on_row,
            on_progress=progress,
        )
    finally:
        if progress is not None:
            progress.done()
    wrong = metrics.total_wrong(rows)
    if lead:
        lines = [*metrics.summary(rows), f"#wrong: {wrong} result elements differ from the expected values"]
        print("\n# summary (ratio: median over iterations of the paired per-iteration time ratio)")
        print("\n".join(lines), flush=True)
        if args.out is not None:
            write(args.out, {"environment": info, "rows": rows, "summary": lines}, plot=not args.no_plots)
    return wrong


def _layout_text(args: argparse.Namespace, between: str) -> str:
    """The layout's sizes given on the command line, such as ``tp=2, pp=1, cp=1, ep=1``."""
    given = {name: getattr(args, name) for name in LAYOUT_SIZES}
    return ", ".join(f"{name}{between}{value}" for name, value in given.items() if value is not None)


def print_header(
    root: gang.ProcessGroupGang, args: argparse.Namespace, info: dict[str, Any], impls: Sequence[str], size: int
) -> None:
    """Print the run's first line: ranks, backend, versions, implementations, dtype and layout."""
    grid = _layout_text(args, "=")
    layout = "" if args.gang == "root" else f"; {args.gang} gangs of {size} ({grid})"
    print(
        f"# gang.bench: {root.size} ranks, {info['backend']} on {info['device']}, torch {info['torch']}"
        + (f", jax {info['jax']}" if "jax" in info else "")
        + f"; {', '.join(impls)}; {args.dtype}{layout}; algbw and busbw in GB/s",
        flush=True,
    )


def write(out: Path, result: dict[str, Any], *, plot: bool = True) -> None:
    """Write the JSON and, with ``plot`` and when matplotlib is importable, the PNG plots next to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    written = [out]
    if not plot:
        pass
    elif importlib.util.find_spec("matplotlib") is not None:
        from gang.bench import plots

        written += plots.plot(result["rows"], out)
    else:
        print("(matplotlib is not installed: no plots)")
    print(f"\nwrote {', '.join(str(path) for path in written)}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m gang.bench``; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.nproc is not None:
        return launch_local(args.nproc, without_nproc(argv))
    if gang.get_world_size() == 1:
        print(
            "gang.bench: no launcher (torchrun, srun, mpirun) found; starting 2 local processes (use --nproc N).",
            file=sys.stderr,
        )
        return launch_local(2, argv)
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
