"""One rank's cost of setting up a layout at cluster scale, in a dry run, beside ``init_device_mesh``.

``python -m benchmarks.dry_run [--quick] [--out rows.json]`` pretends (with
:func:`gang.testing.dry_run`, torch's ``fake`` backend) to be one rank of 1,024 to 131,072
processes and measures, for the layout tp=8, pp=8, cp=2, ep=8 with hybrid sharding over 8 ranks:

* ``create_parallel_gangs`` + ``create_fsdp_gangs`` + ``gang_mesh.to_device_mesh`` of
  ``("pp", "rdp", ("sdp", "cp"), "tp")`` (impl ``gang``; a dimension of size 1, such as ``rdp`` at
  1,024 ranks, is left out of the mesh);
* ``init_device_mesh`` of the same shape ``(pp, rdp, sdp, cp, tp)`` (impl ``torch``).

Time is the median wall time of a few repetitions (each in a fresh dry run); memory is the peak
of Python allocations (``tracemalloc``) in a separate repetition, so tracing does not slow the
timed ones. The SPEC's targets: at most 2 s and 512 MiB at 131,072 ranks, and never slower than
``init_device_mesh``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh

from gang import NotSupportedError, ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs
from gang.bench.metrics import Row, make_row
from gang.testing import dry_run
from gang_mesh import to_device_mesh
from gang_mesh.to_mesh import Dim

SIZES = {"tp_size": 8, "pp_size": 8, "cp_size": 2, "ep_size": 8}
INTRA_NODE = 8
WORLDS = (1024, 4096, 16384, 65536, 131072)


def gangs_setup(root: ProcessGroupGang) -> bool:
    """The gangs' set-up, ``to_device_mesh`` included (a size-1 dimension is left out of the mesh:
    it has no process group); returns whether the mesh was built."""
    gangs = create_fsdp_gangs(create_parallel_gangs(root, **SIZES), INTRA_NODE)
    dims: list[Dim] = [
        dim
        for dim, size in (
            ("pp", gangs.pp.size),
            ("rdp", gangs.rdp.size),
            (("sdp", "cp"), gangs.sdp.size * gangs.cp.size),
            ("tp", gangs.tp.size),
        )
        if size > 1
    ]
    try:
        to_device_mesh(gangs, dims)
    except NotSupportedError:  # a gang without a layout would need communication
        return False
    return True


def torch_setup(root: ProcessGroupGang) -> bool:
    """``init_device_mesh`` of the same grid."""
    world = root.size
    tp, pp, cp = SIZES["tp_size"], SIZES["pp_size"], SIZES["cp_size"]
    dp = world // (tp * pp * cp)
    shape = (pp, dp // INTRA_NODE, INTRA_NODE, cp, tp)
    init_device_mesh("cpu", shape, mesh_dim_names=("pp", "rdp", "sdp", "cp", "tp"))
    return True


def measure(world: int, rank: int, setup: Callable[[ProcessGroupGang], bool], repeats: int) -> tuple[float, int, bool]:
    """Median seconds, peak traced bytes and ``setup``'s flag, each repetition in a fresh dry run."""
    times = []
    complete = True
    for _ in range(repeats):
        with dry_run(world, rank=rank) as root:
            start = time.perf_counter()
            complete = setup(root)
            times.append(time.perf_counter() - start)
    with dry_run(world, rank=rank) as root:
        tracemalloc.start()
        try:
            setup(root)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return statistics.median(times), peak, complete


def run(quick: bool, echo: Callable[[str], None]) -> list[Row]:
    """Measure every world size of :data:`WORLDS` (two with ``quick``) and return the rows."""
    worlds = WORLDS[:1] + WORLDS[-1:] if quick else WORLDS
    repeats = 2 if quick else 3
    rows: list[Row] = []
    echo(f"{'ranks':>8} {'gang s':>8} {'gang MiB':>9} {'torch s':>8} {'torch MiB':>9} {'ratio':>6}  note")
    for world in worlds:
        rank = world // 2 + 3  # a rank in the middle of the world, not rank 0
        ours, our_peak, complete = measure(world, rank, gangs_setup, repeats)
        base, base_peak, _ = measure(world, rank, torch_setup, repeats)
        note = "" if complete else "without to_device_mesh (the gangs have no layout)"
        rows.append(
            make_row(
                "gang",
                "dry_run_setup",
                0,
                world,
                ours,
                bandwidth=False,
                peak_mib=our_peak / 2**20,
                rank=rank,
                note=note,
            )
        )
        rows.append(
            make_row("torch", "dry_run_setup", 0, world, base, bandwidth=False, peak_mib=base_peak / 2**20, rank=rank)
        )
        echo(
            f"{world:>8} {ours:>8.3f} {our_peak / 2**20:>9.1f} {base:>8.3f} {base_peak / 2**20:>9.1f} "
            f"{ours / base:>6.3f}  {note}"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run, print the table and write the rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only 1,024 and 131,072 ranks, fewer repetitions")
    parser.add_argument("--out", default=None, help="write the JSON rows here")
    args = parser.parse_args(argv)
    rows = run(args.quick, lambda line: print(line, flush=True))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
