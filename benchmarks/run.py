"""Run every benchmark and write the JSON rows and the plots (what ``nox -s bench`` calls).

``python -m benchmarks.run [--quick] [--out results.json] [--worlds 2 4]`` runs the collective
benchmark that ships in the package (``python -m gang.bench --nproc N``) for each world size,
then the repository-only benchmarks: the 8-rank set-up benchmark (gangs against
``init_device_mesh``, ``to_device_mesh``, one FSDP2 step), the FakeGang collectives in this
process, and one rank's set-up at 1,024 to 131,072 ranks in a dry run (``benchmarks.dry_run``).
It prints the tables as it goes and a summary at the end, and writes ``--out`` (a list of rows)
with ``gang.bench``'s plots next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import dry_run, fake
from gang.bench import plots
from gang.bench.metrics import Row, format_size, median, ratio_table, summary

ROOT = Path(__file__).resolve().parent.parent


def run_module(module: str, args: list[str], nproc: int | None = None) -> None:
    """Run ``python -m module args`` from the repository root (under torchrun on ``nproc`` local ranks if given)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    subprocess.run([*cmd, "-m", module, *args], check=True, cwd=ROOT, env=env)


def report(rows: list[Row]) -> str:
    """Return the summary: gang.bench's ratios per world size, then the repository-only benchmarks."""
    lines = ["", "# overhead (median of the paired per-iteration time ratios)", *summary(rows)]
    extra = {(r["op"], r["impl"]): float(r["time_us"]) for r in rows if r["world_size"] != 0}
    paired = {(r["op"], r["impl"]): r.get("paired_ratio") for r in rows if r["world_size"] != 0}
    for op, ours, base in (
        ("create_groups", "gang", "torch"),
        ("fsdp_step", "gang-mesh", "native-mesh"),
    ):
        if (op, ours) in extra and (op, base) in extra:
            a, b = extra[(op, ours)], extra[(op, base)]
            ratio = paired.get((op, ours)) or a / b
            lines.append(f"{op:>14}: {ours} {a / 1e3:.2f} ms, {base} {b / 1e3:.2f} ms, ratio {ratio:.3f}")
    if ("to_device_mesh", "gang") in extra:
        lines.append(f"{'to_device_mesh':>14}: {extra[('to_device_mesh', 'gang')] / 1e3:.2f} ms")
    dry: dict[tuple[str, int], Row] = {(r["impl"], r["world_size"]): r for r in rows if r["op"] == "dry_run_setup"}
    for (impl, world), mine in sorted(dry.items(), key=lambda kv: kv[0]):
        if impl == "gang" and ("torch", world) in dry:
            theirs = dry[("torch", world)]
            lines.append(
                f"{'dry run':>14}: {world} ranks, gangs {mine['time_us'] / 1e6:.3f} s {mine['peak_mib']:.1f} MiB, "
                f"init_device_mesh {theirs['time_us'] / 1e6:.3f} s {theirs['peak_mib']:.1f} MiB {mine['note']}"
            )
    fake_rows = [r for r in rows if r["impl"] in ("fake", "plain")]
    if fake_rows:
        table = ratio_table(fake_rows, "fake", "plain")
        useful = {k: v for k, v in table.items() if k[0] != "broadcast"}
        if useful:
            (w_op, _, w_bytes), w_ratio = max(useful.items(), key=lambda kv: kv[1])
            lines.append(
                f"{'FakeGang':>14}: median ratio to the plain op {median(useful.values()):.2f}, worst "
                f"{w_ratio:.2f} ({w_op} {format_size(w_bytes)}); broadcast is a no-op"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and run the benchmarks."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 4 MiB, fewer iterations (about 2 minutes)")
    parser.add_argument("--out", default="results.json", help="the JSON file of rows; the PNGs go next to it")
    parser.add_argument("--worlds", nargs="*", type=int, default=[2, 4], help="ranks of the collective benchmark")
    parser.add_argument("--skip", nargs="*", default=[], choices=["collectives", "fake", "meshes", "dry_run"])
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[Row] = []
    flag = ["--quick"] if args.quick else []
    with tempfile.TemporaryDirectory() as tmp:
        if "collectives" not in args.skip:
            for world in args.worlds:
                part = Path(tmp) / f"collectives-{world}.json"
                run_module("gang.bench", ["--nproc", str(world), *flag, "--no-plots", "--out", str(part)])
                rows += json.loads(part.read_text())["rows"]
        if "meshes" not in args.skip:
            part = Path(tmp) / "meshes.json"
            print("\n# set-up on 8 ranks: pp=2, dp=2, tp=2", flush=True)
            run_module("benchmarks.meshes", [*flag, "--out", str(part)], nproc=8)
            rows += json.loads(part.read_text())
    if "fake" not in args.skip:
        print("\n# FakeGang (size 4) against the plain tensor op it simulates", flush=True)
        rows += fake.run((4 << 20) if args.quick else (64 << 20), args.quick, lambda s: print(s, flush=True))
    if "dry_run" not in args.skip:
        print("\n# one rank's set-up in a dry run (torch's fake backend) against init_device_mesh", flush=True)
        rows += dry_run.run(args.quick, lambda s: print(s, flush=True))
    out.write_text(json.dumps(rows, indent=1) + "\n")
    written = plots.plot(rows, out)
    print(report(rows))
    print(f"\nwrote {out} ({len(rows)} rows) and {', '.join(p.name for p in written)}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
