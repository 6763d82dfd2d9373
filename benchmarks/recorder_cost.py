"""What recording one operation costs: gang's flight recorder against torch's own, per call.

``python -m benchmarks.recorder_cost [--quick] [--rounds 8] [--blocks 40] [--calls 1000] [--out results.json]``

Both recorders are timed on a gloo group of one process over loopback, where an operation is
CPU work only, so that the recording is the only difference between the two sides:

- ``torch``: a tight loop of ``dist.all_reduce`` on a one-element tensor, in a process started
  with ``TORCH_FR_BUFFER_SIZE=0`` (torch's recorder off) and in one started with ``2000`` (on;
  torch reads the variable once per process, so the two sides cannot share one). Each round
  starts one process of each; the cost is the difference of their medians over ``--blocks``
  blocks of ``--calls`` calls. Two processes of the same program differ by up to about 2 us
  per call here (where their memory landed), so this side needs many rounds and is rough.
- ``gang``: ``all_reduce`` of the same tensor through the root :class:`gang.ProcessGroupGang` of
  that process, blocks with gang's recorder on and off alternating in one process (the
  difference of the two sides' medians).

Prints both per-call costs in microseconds (medians over the rounds) and writes
``<out stem>_recorder_cost.json``. ``python -m gang.bench --recorder`` times what gang's recorder
costs a real 2-rank collective.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gang.testing import free_port


def _blocks(call: Callable[[], None], blocks: int, calls: int) -> list[float]:
    """Microseconds per call of each of ``blocks`` blocks of ``calls`` calls."""
    out = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        out.append((time.perf_counter() - start) / calls * 1e6)
    return out


def child(blocks: int, calls: int) -> dict[str, Any]:
    """One process: torch's all_reduce per call, and (with torch's recorder off) gang's recorder on and off."""
    port = free_port()
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import gang
    from gang.trace._recorder import STATE

    dist.init_process_group("gloo")
    root = gang.create_default_gang()  # adopts the group
    tensor = torch.ones(1)

    def torch_call() -> None:
        dist.all_reduce(tensor)

    for _ in range(3000):
        torch_call()
    result: dict[str, Any] = {
        "torch_fr_buffer_size": int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0),
        "torch_us": statistics.median(_blocks(torch_call, blocks, calls)),
    }
    if not result["torch_fr_buffer_size"]:

        def gang_call() -> None:
            root.all_reduce(tensor, gang.ReduceOperation.SUM)

        was = STATE.on
        on: list[float] = []
        off: list[float] = []
        for _ in range(blocks):
            STATE.on = True
            on += _blocks(gang_call, 1, calls)
            STATE.on = False
            off += _blocks(gang_call, 1, calls)
        STATE.on = was
        result["gang_recorder_us"] = statistics.median(on) - statistics.median(off)
    root.close()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> None:
    """Run ``--rounds`` rounds of a process with torch's recorder off and one with it on; print, write the costs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="4 rounds (unless --rounds says otherwise)")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and "--rounds" not in (argv if argv is not None else sys.argv):
        args.rounds = 4
    if args.child:
        print(json.dumps(child(args.blocks, args.calls)))
        return
    rows = []
    for _ in range(args.rounds):
        row = {}
        for size in (0, 2000):
            env = {**os.environ, "TORCH_FR_BUFFER_SIZE": str(size), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "benchmarks.recorder_cost", "--child"]
            command += ["--blocks", str(args.blocks), "--calls", str(args.calls)]
            done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            row[size] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "torch_off_us": row[0]["torch_us"],
                "torch_on_us": row[2000]["torch_us"],
                "torch_recorder_us": row[2000]["torch_us"] - row[0]["torch_us"],
                "gang_recorder_us": row[0]["gang_recorder_us"],
            }
        )
    summary = {
        "torch": torch.__version__,
        "rows": rows,
        "torch_recorder_us": statistics.median(r["torch_recorder_us"] for r in rows),
        "gang_recorder_us": statistics.median(r["gang_recorder_us"] for r in rows),
    }
    print(
        f"recording one operation: torch's flight recorder {summary['torch_recorder_us']:.2f} us, "
        f"gang's {summary['gang_recorder_us']:.2f} us (medians of {args.rounds} rounds; torch {torch.__version__})"
    )
    for r in rows:
        print(
            f"  torch all_reduce {r['torch_off_us']:.2f} us off, {r['torch_on_us']:.2f} us on; "
            f"gang's recorder {r['gang_recorder_us']:.2f} us"
        )
    if args.out is not None:
        path = args.out.with_name(f"{args.out.stem}_recorder_cost.json")
        path.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
