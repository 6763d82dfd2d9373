"""Start, use and exit gangs many times under each launcher path; count the jobs that abort at exit.

Each run is one job of ``--world`` processes on 127.0.0.1 that creates the default gang, makes a
collective and a sub-gang, and exits without closing anything, rank 0 right after starting an
all-reduce it polls once and never waits for (its handle's thread is still inside torch's
``wait()`` when the process exits) while the other ranks join that all-reduce ``--late`` seconds
later. A rank that exits with status 134 (or by SIGABRT), or prints "terminate called", is an
abort; any other non-zero status a failure. The paths: ``torchrun`` (``--standalone``, the agent
serves the store), ``env`` (processes started with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``, rank 0 serving the store) and ``mpirun`` (Open MPI without ``MASTER_ADDR``; only
where ``mpirun`` is installed). ``--load N`` keeps N busy processes running meanwhile.

``python tests/reliability/exit_stress.py --runs 50 --load 2`` prints one JSON line per path and
exits with status 1 if a job aborted or failed. ``nox -s exit_stress`` runs the long version;
``test_exit.py`` a short one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from gang.address import free_port

WORKER = """
import os, sys, time, torch, gang
from gang import ReduceOperation
g = gang.create_default_gang(torch.device("cpu"))
t = torch.ones(4)
g.all_reduce(t, ReduceOperation.SUM)
sub = g.create_gang([0, 1])
if sub is not None:
    sub.all_reduce(torch.ones(2), ReduceOperation.SUM)
if g.rank == 0:
    work = g.all_reduce(torch.ones(1 << 12), ReduceOperation.SUM, async_op=True)
    work.is_completed()
    print("rank", g.rank, "result", t.tolist(), flush=True)
    sys.exit(0)
time.sleep(float(os.environ["GANG_EXIT_LATE"]))
g.all_reduce(torch.ones(1 << 12), ReduceOperation.SUM)
print("rank", g.rank, "result", t.tolist(), flush=True)
"""

ABORTED = (134, -signal.SIGABRT)
ABORT_STATUS = re.compile(r"exitcode\s*:\s*-6\b|signal 6\b")


def paths() -> list[str]:
    """The launcher paths this machine has: ``torchrun``, ``env`` and, where installed, ``mpirun``."""
    found = ["torchrun", "env"]
    if shutil.which("mpirun"):
        found.append("mpirun")
    return found


def _env(late: float) -> dict[str, str]:
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("MASTER_", "RANK", "WORLD_", "LOCAL_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "GANG_EXIT_LATE": str(late)}


def run_job(path: str, world: int, late: float, timeout: float) -> tuple[list[int], str]:
    """Run one job on ``path``; return each rank's exit status (``-9`` for one killed at ``timeout``)
    and the job's output."""
    worker = [sys.executable, "-c", WORKER]
    env = _env(late)
    if path == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        commands = [[*torchrun, "--no-python", *worker]]
        envs = [env]
    elif path == "mpirun":
        mpirun = ["mpirun", "-n", str(world), "--oversubscribe", "--bind-to", "none"]
        commands = [[*mpirun, *(["--allow-run-as-root"] if os.geteuid() == 0 else []), *worker]]
        envs = [env]
    else:
        port = free_port()
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        commands = [worker] * world
        local = {"LOCAL_WORLD_SIZE": str(world)}
        envs = [{**env, **rendezvous, **local, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world)]
    # Each in a session of its own: a launcher killed at the timeout takes its ranks along (they hold
    # its output pipe open and would otherwise wait on its store until their own timeout).
    procs = [
        subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        for cmd, e in zip(commands, envs, strict=True)
    ]
    deadline = time.monotonic() + timeout
    output, codes = "", []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        output += out.decode(errors="replace")
        codes.append(proc.returncode)
    return codes, output


def stress(path: str, runs: int, world: int, late: float, timeout: float) -> dict[str, Any]:
    """Run ``runs`` jobs on ``path``; count those that aborted and those that failed otherwise."""
    aborts, failures, example = 0, 0, ""
    started = time.monotonic()
    for _ in range(runs):
        codes, output = run_job(path, world, late, timeout)
        # A launcher exits with 1 when a rank aborted; it prints the rank's status (torchrun: "exitcode: -6").
        if "terminate called" in output or ABORT_STATUS.search(output) or any(code in ABORTED for code in codes):
            aborts += 1
            example = example or output[-2000:]
        elif any(code != 0 for code in codes):
            failures += 1
            example = example or output[-2000:]
    result = {"path": path, "runs": runs, "world": world, "aborts": aborts, "failures": failures}
    result["seconds"] = round(time.monotonic() - started, 1)
    if example:
        result["example"] = example
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="jobs per path")
    parser.add_argument("--world", type=int, default=2, help="processes per job (at least 2)")
    parser.add_argument("--late", type=float, default=0.2, help="seconds the other ranks join rank 0's all-reduce late")
    parser.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    parser.add_argument("--path", action="append", choices=["torchrun", "env", "mpirun"], help="default: all here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    args = parser.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        results = [stress(path, args.runs, args.world, args.late, args.timeout) for path in args.path or paths()]
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(r["aborts"] == 0 and r["failures"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
