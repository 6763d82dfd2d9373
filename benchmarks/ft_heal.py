"""Healing a big state: gang.ft's chunked transfer against a raw gloo broadcast of the same bytes.

``python -m benchmarks.ft_heal [--quick] [--out results.json] [--mib 1024] [--repeat 3]``
(``nox -s bench`` runs it). Two fresh processes on this machine meet on a gloo group over
loopback; each measurement starts new processes, so that the peak memory is its own:

- ``raw``: rank 0 broadcasts one ``uint8`` tensor of the state's size to rank 1 (the floor:
  what moving those bytes costs with no structure at all);
- ``heal``: rank 0 sends a state dict (four ``float32`` tensors making up the size, one
  ``bfloat16`` tensor and a non-tensor leaf) with :func:`gang.ft.heal.send_state`, rank 1, which
  holds a state of the same shapes (a replica that is behind), receives it with
  :func:`gang.ft.heal.receive_state`: what a ``ReplicaGang`` does when it heals.

Each repetition is timed from a barrier to the receiver's end (the best of ``--repeat`` is
reported), and each process reports its peak resident memory (``VmHWM``) minus the state it
holds, i.e. what the transfer itself cost in memory. Writes ``<out stem>_ft_heal.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gang._torch_groups import TCPStore
from gang.ft.heal import CHUNK_BYTES, receive_state, send_state
from gang.testing import free_port

MIB = 2**20


def _peak_mib() -> float:
    """This process's peak resident memory (``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _state(mib: int, fill: float) -> dict[str, Any]:
    quarter = mib * MIB // 16  # four float32 tensors of a quarter each
    return {
        "layers": [torch.full((quarter,), fill) for _ in range(4)],
        "norm": torch.full((1000,), fill, dtype=torch.bfloat16),
        "meta": {"step": 7, "name": "big"},
    }


def worker(rank: int, port: int, mode: str, mib: int, repeat: int) -> None:
    """One side of one measurement; prints a JSON line with the times and the peak memory."""
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    pg: Any = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=300))  # torch's stubs omit its collectives
    cpu = torch.device("cpu")
    if mode == "raw":
        state: dict[str, Any] = {"blob": torch.full((mib * MIB,), rank, dtype=torch.uint8)}
    else:
        state = _state(mib, float(rank + 1))
    held = _peak_mib()
    times = []
    for _ in range(repeat):
        pg.barrier().wait()
        start = time.perf_counter()
        if mode == "raw":
            pg.broadcast([state["blob"]]).wait()
        elif rank == 0:
            send_state(pg, 1, state, 5, cpu, lambda work: work.wait())
        else:
            _, got, _ = receive_state(pg, 0, state, cpu, lambda work: work.wait())
            received: Any = got
            assert received["layers"][0] is state["layers"][0]  # in place
            assert float(received["layers"][3][-1]) == 1.0 and received["meta"] == {"step": 7, "name": "big"}
        times.append(time.perf_counter() - start)
        pg.barrier().wait()
    print(json.dumps({"rank": rank, "times": times, "held_mib": held, "peak_mib": _peak_mib()}), flush=True)


def measure(mode: str, mib: int, repeat: int) -> dict[str, Any]:
    """Run one measurement in two fresh processes; return the receiver's best time and both peaks."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "benchmarks.ft_heal", "--worker", mode, str(port), str(mib), str(repeat)]
    procs = [subprocess.Popen([*args, str(rank)], stdout=subprocess.PIPE, env=env, text=True) for rank in (0, 1)]
    lines = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"the {mode} worker failed ({proc.returncode})")
        lines.append(json.loads(out.strip().splitlines()[-1]))
    sender, receiver = lines
    return {
        "mode": mode,
        "mib": mib,
        "seconds": min(receiver["times"]),
        "extra_mib_sender": sender["peak_mib"] - sender["held_mib"],
        "extra_mib_receiver": receiver["peak_mib"] - receiver["held_mib"],
    }


def main() -> None:
    """Measure both modes and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, one repetition")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker is not None:
        mode, port, mib, repeat, rank = args.worker
        worker(int(rank), int(port), mode, int(mib), int(repeat))
        return
    mib, repeat = (64, 1) if args.quick else (args.mib, args.repeat)
    rows = [measure(mode, mib, repeat) for mode in ("raw", "heal")]
    raw, heal = rows
    print(f"# healing a {mib} MiB state (chunks of {CHUNK_BYTES // MIB} MiB), best of {repeat}")
    for row in rows:
        print(
            f"{row['mode']:>5}: {row['seconds']:.3f} s, peak memory beyond the state: "
            f"sender {row['extra_mib_sender']:.0f} MiB, receiver {row['extra_mib_receiver']:.0f} MiB"
        )
    print(f"heal / raw broadcast: {heal['seconds'] / raw['seconds']:.2f}x (target <= 2x)")
    if args.out is not None:
        path = args.out.with_name(f"{args.out.stem}_ft_heal.json")
        path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
