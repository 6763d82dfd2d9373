"""The environment helpers, the default gang, the layouts and JaxGang under the real launchers.

A one-node SLURM cluster on localhost with two ``slurmd`` as two nodes (``srun`` with and
without ``--ntasks-per-node``, an ``sbatch`` job running two concurrent ``srun --exact`` steps),
Open MPI's ``mpirun``, and two torchrun agents as two nodes (c10d rendezvous). Every process runs
``launch_worker.py``; the checks here look at all processes' results together. A ``salloc`` shell
and a heterogeneous step are checked with the launcher model alone (no torch to import).

Skipped (one line) when the programs are missing, unless ``GANG_REQUIRE_LAUNCHERS=1`` (set by
``nox -s launchers`` on CI), where missing programs fail the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from launcher_workers import SlurmCluster, missing_programs, which

from gang.testing import free_port

WORKER = str(Path(__file__).with_name("launch_worker.py"))
MISSING = missing_programs()
if MISSING and os.environ.get("GANG_REQUIRE_LAUNCHERS") != "1":
    pytest.skip(
        f"launchers missing ({', '.join(MISSING)}): run `nox -s launchers -- --install` (or set CI=true) "
        "to apt-get install slurm-wlm munge openmpi-bin",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(600)
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    cluster = SlurmCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


def worker(out: Path, tag: str, *args: str) -> list[str]:
    return [sys.executable, WORKER, str(out), tag, *args]


def results(out: Path, tag: str) -> list[dict[str, Any]]:
    """Every process's result of one launch, in rank order."""
    found = [json.loads(p.read_text()) for p in out.glob(f"{tag}-*.json")]
    return sorted(found, key=lambda r: r["helpers"][0])


def launched(proc: subprocess.CompletedProcess[str], log: Path | None = None) -> None:
    """Assert that the launcher succeeded, showing its output (and the job's log) if not."""
    job_log = log.read_text()[-6000:] if log is not None and log.exists() else ""
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}{job_log}"


def check(found: list[dict[str, Any]], *, launcher: str, world: int, nodes: int, tp: int = 1) -> None:
    """What must hold across the processes of one launch."""
    assert len(found) == world, f"{len(found)} results for a world of {world}"
    node_of = {r["helpers"][0]: r["node"] for r in found}
    assert sorted(node_of) == list(range(world))
    assert len(set(node_of.values())) == nodes
    everyone = [[rank, node_of[rank]] for rank in range(world)]
    for r in found:
        rank, size, _, local_size = r["helpers"]
        assert (r["launcher"], size) == (launcher, world)
        same_node = [q for q in found if q["node"] == r["node"]]
        # Local ranks are 0..n-1 on each node, and the local size is the number of processes there.
        assert local_size == len(same_node)
        assert sorted(q["helpers"][2] for q in same_node) == list(range(local_size))
        assert r["device"] == "cpu"
        assert r["root_rank"] == [rank, world]
        assert r["root_members"] == everyone
        assert r["again"] == {"members": everyone, "sum": float(world)}
        assert r["jax"] == {"rank": rank, "size": world, "members": everyone}
        for name in ("root", "dp", "rdp", "sdp", "tp", "pp"):
            g = r[name]
            assert g["sum"] == g["size"] == len(g["members"]), (name, g)
            assert [rank, r["node"]] in g["members"], (name, g)
            # Every member of the gang sees the same members.
            for member_rank, _ in g["members"]:
                assert found[member_rank][name]["members"] == g["members"]
        # The HSDP recipe: tp and sdp inside a node, rdp across nodes.
        assert r["tp"]["size"] == tp and len({n for _, n in r["tp"]["members"]}) == 1
        assert r["sdp"]["size"] == local_size // tp
        assert len({n for _, n in r["sdp"]["members"]}) == 1
        assert r["rdp"]["size"] == nodes
        assert len({n for _, n in r["rdp"]["members"]}) == nodes
    assert len({tuple(r["address"]) for r in found}) == 1


def test_srun_without_ntasks_per_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The usual case: SLURM sets no SLURM_NTASKS_PER_NODE, only the tasks-per-node lists."""
    command = ["srun", "-n", "4", "-t", "5", *worker(tmp_path, "srun", "--node-var", "SLURM_NODEID")]
    launched(slurm.run(command, check=False))
    found = results(tmp_path, "srun")
    check(found, launcher="slurm", world=4, nodes=2)
    assert "SLURM_NTASKS_PER_NODE" not in found[0]["env"]
    assert found[0]["env"]["SLURM_STEP_TASKS_PER_NODE"] == "2(x2)"


def test_srun_with_ntasks_per_node_and_tp(slurm: SlurmCluster, tmp_path: Path) -> None:
    command = ["srun", "-N", "2", "--ntasks-per-node", "2", "-t", "5"]
    launched(slurm.run([*command, *worker(tmp_path, "srun", "--tp", "2", "--node-var", "SLURM_NODEID")], check=False))
    found = results(tmp_path, "srun")
    check(found, launcher="slurm", world=4, nodes=2, tp=2)
    assert found[0]["env"]["SLURM_NTASKS_PER_NODE"] == "2"


def test_sbatch_job_with_two_concurrent_steps(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Two ``srun --exact`` steps of one job rendezvous at the same time, each in its own world."""
    meet = ["--meet", str(tmp_path / "meet"), "4", "--node-var", "SLURM_NODEID"]
    step = "srun --exact -N 1 -n 2 -t 5"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"{step} {' '.join(worker(tmp_path, 'stepA', *meet))} &\nA=$!\n"
        f"{step} {' '.join(worker(tmp_path, 'stepB', *meet))} &\nB=$!\n"
        "wait $A && wait $B\n"
    )
    log = tmp_path / "job.log"
    proc = slurm.run(["sbatch", "-N", "2", "-n", "4", "-t", "5", "--wait", "-o", str(log), str(script)], check=False)
    launched(proc, log)
    steps = [results(tmp_path, tag) for tag in ("stepA", "stepB")]
    for found in steps:
        check(found, launcher="slurm", world=2, nodes=1)
    # Same job, different steps: different ports, although both rendezvous on 127.0.0.1.
    ids = [found[0]["env"]["SLURM_STEP_ID"] for found in steps]
    assert ids[0] != ids[1]
    assert steps[0][0]["env"]["SLURM_JOB_ID"] == steps[1][0]["env"]["SLURM_JOB_ID"]
    assert steps[0][0]["address"] != steps[1][0]["address"]


# What `gang.env` reads, without importing torch: the launcher model alone (gang.launchers is stdlib only).
LAUNCHERS = str(Path(__file__).parents[2] / "packages" / "gang" / "src" / "gang" / "launchers.py")
PROBE = f"""
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("launchers", {LAUNCHERS!r})
launchers = sys.modules["launchers"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launchers)
model = launchers.detect_launcher(os.environ)
print(json.dumps([model.name, model.rank, model.world_size, model.local_rank, model.local_world_size]))
"""


def probe(slurm: SlurmCluster, *command: str) -> list[list[object]]:
    """What the launcher model reads in each process ``command`` starts, sorted by rank."""
    proc = slurm.run([*command, sys.executable, "-c", PROBE], check=False, timeout=LAUNCH_TIMEOUT_S)
    launched(proc)
    return sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")), key=str)


def test_salloc_shell_and_heterogeneous_step(slurm: SlurmCluster) -> None:
    """The shell of ``salloc -n 3`` is one process (not rank 0 of 3); a heterogeneous step is one world."""
    assert probe(slurm, "salloc", "-n", "3", "-t", "5") == [["none", 0, 1, 0, 1]]
    het = probe(slurm, "srun", "-n", "1", "-w", "n1", "-t", "5", ":", "-n", "2", "-w", "n2", "-t", "5")
    assert het == [["slurm", 0, 3, 0, 1], ["slurm", 1, 3, 0, 2], ["slurm", 2, 3, 1, 2]]


def test_mpirun(tmp_path: Path) -> None:
    mpirun = which("mpirun")
    assert mpirun is not None
    command = [mpirun, "-n", "4", "--oversubscribe", "--allow-run-as-root", "--mca", "oob_tcp_if_include", "lo"]
    proc = subprocess.run(
        [*command, *worker(tmp_path, "mpi")], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False
    )
    launched(proc)
    found = results(tmp_path, "mpi")
    check(found, launcher="openmpi", world=4, nodes=1)
    assert "MASTER_ADDR" not in os.environ and found[0]["address"][0] == "127.0.0.1"


def test_torchrun_two_nodes(tmp_path: Path) -> None:
    """Two torchrun agents as two nodes of two processes, meeting through the c10d rendezvous."""
    torchrun = which("torchrun")
    assert torchrun is not None
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "gangtest"]
    # Both "nodes" are this machine: the first agent publishes 127.0.0.1 as MASTER_ADDR (without
    # --local-addr, its host name, which a job spanning two nodes cannot take for loopback).
    rendezvous += ["--local-addr", "127.0.0.1"]
    command = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", *rendezvous, "--max-restarts", "0"]
    script = [WORKER, str(tmp_path), "torchrun", "--node-var", "GROUP_RANK"]
    agents = [
        subprocess.Popen(
            [*command, "--node-rank", str(node), *script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=LAUNCH_TIMEOUT_S) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()  # the agent stops its workers
                try:
                    agent.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
    for agent, (out, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, f"exit status {agent.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    check(results(tmp_path, "torchrun"), launcher="torchrun", world=4, nodes=2)
