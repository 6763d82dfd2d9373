"""Helpers of the tests on test hosts: the environment their processes get, and waiting for output.

``torchrun_worker`` (run as a script under torchrun on each host) is in this folder too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gang.testing import HostProcess, TestHosts

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
# The folders the processes import from: the packages (where they are not installed) and the test
# helpers (`launch_worker`, `parity_workers`, the fault-tolerance workers).
PATHS = [
    *(ROOT / "packages" / name / "src" for name in ("gang", "gang-mesh", "gang-jax")),
    ROOT / "tests",
    ROOT / "tests" / "launchers",
    ROOT / "tests" / "ft",
    ROOT / "tests" / "hosts",
]
WAIT_S = 300.0


def env(**extra: str) -> dict[str, str]:
    """The environment of a process on a test host: the caller's, with the test folders on the
    path, one thread, and no variable that names gloo's interface (gang must find it)."""
    found = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    path = os.pathsep.join([*map(str, PATHS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**found, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def finish(processes: list[HostProcess], timeout: float = WAIT_S) -> None:
    """Wait for every process; fail with the logs of those that failed or did not end in time."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # reported below, with the logs
            process.kill()
            process.wait()
    failed = [p for p in processes if p.returncode != 0]
    assert not failed, "\n\n".join(f"{p.host.name}: exit {p.returncode}\n{p.output()[-5000:]}" for p in failed)


def results(folder: Path, pattern: str) -> list[dict[str, Any]]:
    """The JSON files ``pattern`` matches in ``folder``, read."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob(pattern))]


def assert_contained(hosts: TestHosts) -> None:
    """Nothing of the test reaches beyond loopback and the test subnet."""
    leaks = hosts.leaks()
    assert leaks == [], leaks
