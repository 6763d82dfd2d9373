"""Environment helpers for torchrun, SLURM and Open MPI, from the variables each launcher really sets.

The variable sets below are those that slurm-wlm 22.05 (`srun`, `sbatch`), Open MPI 4.1
(`mpirun`) and torchrun set (see tests/launchers for the same paths under the real programs).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

import pytest
import torch

import gang
from gang import launchers
from gang.env import get_launcher, get_master_address
from gang.launchers import Launcher, expand_hostlist, expand_tasks_per_node

PREFIXES = ("SLURM_", "OMPI_", "PMIX_")
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(PREFIXES) or var in TORCHRUN:
            monkeypatch.delenv(var)


def setenv(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def helpers() -> tuple[int, int, int, int]:
    return gang.get_rank(), gang.get_world_size(), gang.get_local_rank(), gang.get_local_world_size()


def slurm_task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """What `srun -n 7` (no --ntasks-per-node) sets on a job of nodes gpu[01-02,07]: tasks 3,3,1."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOBID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": "7",
        "SLURM_NPROCS": "7",
        "SLURM_TASKS_PER_NODE": "3(x2),1",
        "SLURM_STEP_TASKS_PER_NODE": "3(x2),1",
        "SLURM_JOB_NODELIST": "gpu[01-02,07]",
        "SLURM_STEP_NODELIST": "gpu[01-02,07]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9",
    }
    env.update(extra)
    return env


def test_single_process_defaults() -> None:
    assert helpers() == (0, 1, 0, 1)
    assert gang.get_default_device() == torch.device("cpu")
    assert get_launcher().name == "none"
    assert isinstance(gang.create_default_gang(), gang.FakeGang)


def test_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    setenv(monkeypatch, {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "GROUP_RANK": "1"})
    assert helpers() == (5, 8, 1, 4)
    assert get_master_address() == ("node0", 29500)


@pytest.mark.parametrize(("procid", "localid", "nodeid", "local_size"), [(0, 0, 0, 3), (4, 1, 1, 3), (6, 0, 2, 1)])
def test_slurm_without_ntasks_per_node(
    monkeypatch: pytest.MonkeyPatch, procid: int, localid: int, nodeid: int, local_size: int
) -> None:
    """The usual case: SLURM sets no SLURM_NTASKS_PER_NODE; the local size is this node's entry."""
    setenv(monkeypatch, slurm_task(procid, localid, nodeid))
    assert helpers() == (procid, 7, localid, local_size)


def test_slurm_step_list_wins_over_job_list(monkeypatch: pytest.MonkeyPatch) -> None:
    # A step of 2 tasks on one node of a job of 4 tasks per node.
    setenv(
        monkeypatch, slurm_task(1, 1, 0, SLURM_TASKS_PER_NODE="4(x2)", SLURM_STEP_TASKS_PER_NODE="2", SLURM_NTASKS="2")
    )
    assert helpers() == (1, 2, 1, 2)


def test_slurm_address_is_first_node_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the launch node (under `salloc`, the login node): the first node of the step."""
    setenv(monkeypatch, slurm_task(0, 0, 0, SLURM_STEP_NODELIST="localhost,gpu[01-02]"))
    host, port = get_master_address()
    assert host == "localhost"
    assert 20000 <= port < 32000 and port % 2 == 0


def test_slurm_concurrent_steps_get_different_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = set()
    for step in range(64):
        setenv(monkeypatch, slurm_task(0, 0, 0, SLURM_STEP_NODELIST="localhost", SLURM_STEP_ID=str(step)))
        ports.add(get_master_address()[1])
    assert len(ports) == 64


def test_slurm_master_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, slurm_task(0, 0, 0, MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"))
    assert get_master_address() == ("10.0.0.1", 1234)


def test_slurm_unresolvable_node(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, slurm_task(0, 0, 0, SLURM_STEP_NODELIST="no-such-node-gang[1-2]"))
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol to ask
    with pytest.raises(ValueError, match=r"first node `no-such-node-gang1` of `SLURM_STEP_NODELIST`.*MASTER_ADDR"):
        get_master_address()


def test_sbatch_script_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch script has SLURM_PROCID=0 and the job's SLURM_NTASKS, but is not a step."""
    env = slurm_task(0, 0, 0)
    del env["SLURM_STEP_ID"], env["SLURM_STEPID"], env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_STEP_NODELIST"]
    setenv(monkeypatch, env)
    assert helpers() == (0, 1, 0, 1)
    assert get_launcher().name == "none"


def test_salloc_shell_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shell (or command) of `salloc -n 3` is not a step: what slurm-wlm 22.05 sets there."""
    setenv(monkeypatch, {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "3"})
    setenv(monkeypatch, {"SLURM_TASKS_PER_NODE": "2,1", "SLURM_NNODES": "2"})
    assert helpers() == (0, 1, 0, 1)
    assert get_launcher().name == "none"
    assert get_master_address() == ("127.0.0.1", 0)


def het_task(procid: int, localid: int, nodeid: int) -> dict[str, str]:
    """What `srun -n 1 -w n1 : -n 2 -w n2` (a heterogeneous step, slurm-wlm 22.05) sets."""
    return {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_ID_PACK_GROUP_0": "1",
        "SLURM_JOB_ID_PACK_GROUP_1": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NODELIST_PACK_GROUP_0": "n1",
        "SLURM_JOB_NODELIST_PACK_GROUP_1": "n2",
        "SLURM_STEP_NODELIST": "localhost,n2",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": "3",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_TASKS_PER_NODE": "1,2",
        "SLURM_TASKS_PER_NODE": "1,2",
    }


@pytest.mark.parametrize(("procid", "localid", "nodeid", "local_size"), [(0, 0, 0, 1), (1, 0, 1, 2), (2, 1, 1, 2)])
def test_slurm_heterogeneous_step_is_one_world(
    monkeypatch: pytest.MonkeyPatch, procid: int, localid: int, nodeid: int, local_size: int
) -> None:
    """A step over both components of a heterogeneous job: SLURM numbers its tasks as one world."""
    setenv(monkeypatch, het_task(procid, localid, nodeid))
    assert helpers() == (procid, 3, localid, local_size)
    assert get_master_address()[0] == "localhost"


def test_slurm_blank_step_lists_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blank variable is unset, as for every integer variable: the job's lists are read."""
    setenv(monkeypatch, slurm_task(4, 1, 1, SLURM_STEP_TASKS_PER_NODE=" ", SLURM_STEP_NODELIST=" "))
    setenv(monkeypatch, {"SLURM_JOB_NODELIST": "localhost,gpu[01-02]"})
    assert helpers() == (4, 7, 1, 3)
    assert get_master_address()[0] == "localhost"


def open_mpi(rank: int, local_rank: int, **extra: str) -> dict[str, str]:
    """What `mpirun -n 4` (Open MPI 4.1) sets, on two nodes of two ranks each."""
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank),
        "OMPI_MCA_orte_hnp_uri": "1042350080.0;tcp://10.96.0.1,10.148.0.1:43199",
        "PMIX_RANK": str(rank),
    }
    env.update(extra)
    return env


def test_open_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, open_mpi(3, 1))
    assert helpers() == (3, 4, 1, 2)
    # The host is mpirun's (as JAX finds its coordinator), the port derived from Open MPI's job id.
    assert get_master_address() == ("10.96.0.1", 20000 + 2 * ((1042350080 // 4096) % 6000))


def test_open_mpi_ipv6(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, open_mpi(0, 0, OMPI_MCA_orte_hnp_uri="1314521088.0;tcp6://[fe80::b9b,2620:10d::2]:43370"))
    assert get_master_address()[0] == "fe80::b9b"


def test_open_mpi_without_address(monkeypatch: pytest.MonkeyPatch) -> None:
    env = open_mpi(0, 0)
    del env["OMPI_MCA_orte_hnp_uri"]  # Open MPI 5 (PRRTE) no longer sets it
    setenv(monkeypatch, env)
    with pytest.raises(ValueError, match=r"Open MPI's mpirun.*`mpirun -x MASTER_ADDR=.* -x MASTER_PORT="):
        get_master_address()


def test_open_mpi_blank_uri_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, open_mpi(0, 0, OMPI_MCA_orte_hnp_uri=" "))
    with pytest.raises(ValueError, match=r"Open MPI's mpirun.*`mpirun -x MASTER_ADDR=.* -x MASTER_PORT="):
        get_master_address()


def test_torchrun_wins_over_slurm_as_a_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun inside an srun step: nothing of SLURM's (local size, host) leaks in."""
    setenv(monkeypatch, slurm_task(4, 1, 1))
    setenv(monkeypatch, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    setenv(monkeypatch, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
    assert helpers() == (1, 2, 1, 2)
    assert get_launcher().name == "torchrun"
    assert get_master_address() == ("127.0.0.1", 29400)


def test_hand_made_env_inside_srun_is_plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS` in an srun step: plain env://, local rank 0 of 1 (documented)."""
    setenv(monkeypatch, slurm_task(4, 1, 1, RANK="4", WORLD_SIZE="7", MASTER_ADDR="gpu01", MASTER_PORT="29500"))
    assert helpers() == (4, 7, 0, 1)
    assert get_launcher().name == "torchrun"


def test_local_rank_never_mixed_with_other_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LOCAL_RANK` alone (without torchrun's sizes) is not read together with SLURM's sizes."""
    setenv(monkeypatch, slurm_task(6, 0, 2, LOCAL_RANK="3"))
    assert helpers() == (6, 7, 0, 1)


def test_open_mpi_inside_a_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpirun inside sbatch: its ranks inherit the job's (and orted's step's) SLURM variables."""
    setenv(monkeypatch, slurm_task(0, 0, 0, SLURM_NTASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    setenv(monkeypatch, open_mpi(3, 1))
    assert helpers() == (3, 4, 1, 2)
    assert get_launcher().name == "openmpi"


def test_default_device_uses_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, slurm_task(4, 1, 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert gang.get_default_device() == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node-3.example.org", ["node-3.example.org"]),
        ("node-[1-3]", ["node-1", "node-2", "node-3"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        (" a , b[1-2 ,4] ", ["a", "b1", "b2", "b4"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-", "gpu[3-1]", "a,,b", "a, ,b", "gpu[a-b]", "gpu]1[", "a[]", ""])
def test_expand_hostlist_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="SLURM host list"):
        expand_hostlist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), (" 2(x3), 1 ", [2, 2, 2, 1]), ("0,2", [0, 2])],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x", "2(x3)1", "2(x0)", "x", "2,,1", "-1"])
def test_expand_tasks_per_node_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="SLURM tasks-per-node list"):
        expand_tasks_per_node(text)


ALL_SLURM = slurm_task(0, 0, 0)


@pytest.mark.parametrize(
    ("env", "call", "text"),
    [
        ({"WORLD_SIZE": "two", "RANK": "0"}, gang.get_world_size, "`WORLD_SIZE` must be an integer, but is 'two'"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, gang.get_world_size, "`WORLD_SIZE` must be at least 1, but is '0'"),
        ({"WORLD_SIZE": "2"}, gang.get_rank, "`RANK` must be set"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, gang.get_rank, "`RANK` must be at least 0"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, gang.get_rank, "`RANK` must be less than the world size (4), but is '4'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, gang.get_local_rank,
         "`LOCAL_RANK` must be an integer, but is 'x'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, gang.get_local_rank,
         "`LOCAL_RANK` must be less than the local world size (2)"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, gang.get_local_rank, "`LOCAL_WORLD_SIZE` must be set"),
        ({**ALL_SLURM, "SLURM_NTASKS": "1.5"}, gang.get_world_size, "`SLURM_NTASKS` must be an integer, but is '1.5'"),
        ({**ALL_SLURM, "SLURM_NTASKS": "1_0"}, gang.get_world_size, "`SLURM_NTASKS` must be an integer, but is '1_0'"),
        ({"RANK": "\u0663", "WORLD_SIZE": "4"}, gang.get_rank, "`RANK` must be an integer, but is '\u0663'"),
        ({**ALL_SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x"}, gang.get_local_world_size,
         "`SLURM_STEP_TASKS_PER_NODE` must be a SLURM tasks-per-node list such as `2(x3),1`, but is '2(x'"),
        ({**ALL_SLURM, "SLURM_NODEID": "3"}, gang.get_local_world_size,
         "`SLURM_NODEID` must be less than the number of nodes in `SLURM_STEP_TASKS_PER_NODE`='3(x2),1'"),
        ({**ALL_SLURM, "SLURM_LOCALID": "3"}, gang.get_local_rank, "`SLURM_LOCALID` must be less than the local world"),
        ({**ALL_SLURM, "SLURM_STEP_NODELIST": "gpu[1-"}, get_master_address,
         "`SLURM_STEP_NODELIST` must be a SLURM host list"),
        ({**ALL_SLURM, "SLURM_JOB_ID": "abc", "SLURM_STEP_NODELIST": "localhost"}, get_master_address,
         "`SLURM_JOB_ID` must be an integer, but is 'abc'"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, gang.get_local_rank,
         "`OMPI_COMM_WORLD_LOCAL_SIZE` must be set"),
        ({**open_mpi(0, 0), "OMPI_MCA_orte_hnp_uri": "garbage"}, get_master_address,
         "`OMPI_MCA_orte_hnp_uri` must be Open MPI's"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, get_master_address,
         "`MASTER_PORT` must be set for a multi-process run launched by torchrun"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, get_master_address, "`MASTER_ADDR` must be set"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "99999"}, get_master_address,
         "`MASTER_PORT` must be a port in the range [1, 65535], but is '99999'"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "x"}, get_master_address, "`MASTER_PORT` must be an integer, but is 'x'"),
    ],
)  # fmt: skip
def test_malformed_values(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], call: Callable[[], object], text: str
) -> None:
    setenv(monkeypatch, env)
    with pytest.raises(ValueError, match=re.escape(text)):
        call()


class _Pbs(Launcher):
    """A launcher the package does not know, as a user would add one."""

    name = "pbs"

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        return "PBS_NP" in env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launcher:
        return cls(int(env["PBS_VNODENUM"]), int(env["PBS_NP"]), 0, 1, env)


def test_a_new_launcher_is_one_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launchers, "LAUNCHERS", list(launchers.LAUNCHERS))  # the registry, restored after
    assert launchers.register_launcher(_Pbs) is _Pbs
    assert [cls.name for cls in launchers.LAUNCHERS] == ["torchrun", "openmpi", "slurm", "pbs", "none"]
    found = launchers.detect_launcher({"PBS_NP": "4", "PBS_VNODENUM": "3"})
    assert type(found) is _Pbs and (found.name, found.rank, found.world_size) == ("pbs", 3, 4)
    with pytest.raises(ValueError, match="`MASTER_ADDR` must be set for a multi-process run launched by pbs"):
        found.master_address()
    # Launchers registered before it still win, as a whole.
    assert launchers.detect_launcher({"PBS_NP": "4", "RANK": "1", "WORLD_SIZE": "2"}).name == "torchrun"


def test_a_launcher_can_be_put_ahead_of_a_registered_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launchers, "LAUNCHERS", list(launchers.LAUNCHERS))  # the registry, restored after
    with pytest.raises(ValueError, match=re.escape("`before` must be the name of a registered launcher [")):
        launchers.register_launcher(_Pbs, before="pbs")
    assert launchers.register_launcher(before="torchrun")(_Pbs) is _Pbs  # as a class decorator
    assert [cls.name for cls in launchers.LAUNCHERS] == ["pbs", "torchrun", "openmpi", "slurm", "none"]
    # Now the PBS variables win over torchrun's, as a whole.
    found = launchers.detect_launcher({"PBS_NP": "4", "PBS_VNODENUM": "3", "RANK": "1", "WORLD_SIZE": "2"})
    assert type(found) is _Pbs and (found.rank, found.world_size) == (3, 4)


def test_the_launcher_says_whether_its_agent_serves_the_store_and_how_often_it_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the process group and the JAX rendezvous ask the launcher, instead of reading its variables."""
    setenv(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
    assert (get_launcher().agent_store, get_launcher().restart_count) == (False, 0)
    setenv(monkeypatch, {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert (get_launcher().agent_store, get_launcher().restart_count) == (True, 3)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    with pytest.raises(ValueError, match="`TORCHELASTIC_RESTART_COUNT` must be"):
        _ = get_launcher().restart_count
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name)
    setenv(monkeypatch, slurm_task(0, 0, 0, SLURM_RESTART_COUNT="2"))
    assert (get_launcher().name, get_launcher().agent_store, get_launcher().restart_count) == ("slurm", False, 2)
