"""Environment helpers for torchrun, SLURM and Open MPI."""

from __future__ import annotations

import pytest
import torch

import gang
from gang.env import get_master_address

VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_LAUNCH_NODE_IPADDR",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in VARS:
        monkeypatch.delenv(var, raising=False)


def test_single_process_defaults() -> None:
    assert (gang.get_rank(), gang.get_world_size(), gang.get_local_rank(), gang.get_local_world_size()) == (0, 1, 0, 1)
    assert gang.get_default_device() == torch.device("cpu")
    assert isinstance(gang.create_default_gang(), gang.FakeGang)


def test_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    assert (gang.get_rank(), gang.get_world_size(), gang.get_local_rank(), gang.get_local_world_size()) == (5, 8, 1, 4)


def test_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "12345",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (gang.get_rank(), gang.get_world_size(), gang.get_local_rank(), gang.get_local_world_size()) == (6, 8, 2, 4)
    assert get_master_address() == ("10.1.2.3", 20000 + 12345 % 20000)


def test_open_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (gang.get_rank(), gang.get_world_size(), gang.get_local_rank(), gang.get_local_world_size()) == (3, 4, 1, 2)


def test_torchrun_wins_over_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert (gang.get_rank(), gang.get_world_size()) == (1, 2)


@pytest.mark.parametrize(
    ("env", "call", "text"),
    [
        ({"WORLD_SIZE": "two"}, gang.get_world_size, "`WORLD_SIZE` must be an integer, but is 'two'"),
        ({"WORLD_SIZE": "0"}, gang.get_world_size, "`WORLD_SIZE` must be at least 1"),
        ({"RANK": "-1"}, gang.get_rank, "`RANK` must be at least 0"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, gang.get_rank, "`RANK` must be less than the world size (4)"),
        ({"LOCAL_RANK": "x"}, gang.get_local_rank, "`LOCAL_RANK` must be an integer"),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, gang.get_local_rank, "`LOCAL_RANK` must be less"),
        ({"SLURM_NTASKS": "1.5"}, gang.get_world_size, "`SLURM_NTASKS` must be an integer"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h"}, get_master_address, "`MASTER_PORT` must be set"),
        ({"WORLD_SIZE": "2"}, get_master_address, "`MASTER_ADDR` must be set"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "99999"}, get_master_address, "`MASTER_PORT` must be in the range"),
    ],
)
def test_malformed_values(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], call: object, text: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as info:
        call()  # type: ignore[operator]
    assert text in str(info.value)
