"""Reading the launcher's environment: torchrun, SLURM and Open MPI.

Each helper reads the first variable that is set, in the order torchrun, SLURM, Open MPI, and
falls back to a world of one process when none is set. A malformed value is a ``ValueError`` that
names the variable and the value.
"""

from __future__ import annotations

import os
import re

import torch

_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
_WORLD_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _read_int(names: tuple[str, ...], default: int, *, minimum: int) -> tuple[int, str | None]:
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            continue
        text = raw.strip()
        if name == "SLURM_NTASKS_PER_NODE":
            # SLURM writes e.g. "4(x2)" for 2 nodes with 4 tasks each; the count is what we need.
            match = re.fullmatch(r"(\d+)(\(x\d+\))?(,.*)?", text)
            text = match.group(1) if match else text
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"The environment variable `{name}` must be an integer, but is {raw!r} instead.") from None
        if value < minimum:
            raise ValueError(f"The environment variable `{name}` must be at least {minimum}, but is {value} instead.")
        return value, name
    return default, None


def _read_rank(names: tuple[str, ...], size: int, what: str) -> int:
    rank, name = _read_int(names, 0, minimum=0)
    if rank >= size:
        raise ValueError(
            f"The environment variable `{name}` must be less than the {what} ({size}), but is {rank} instead."
        )
    return rank


def get_rank() -> int:
    """Return this process's global rank (``RANK``, ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``; else 0).

    :raises ValueError: If the variable is malformed or not smaller than the world size.
    """
    return _read_rank(_RANK_VARS, get_world_size(), "world size")


def get_world_size() -> int:
    """Return the number of processes (``WORLD_SIZE``, ``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``; else 1).

    :raises ValueError: If the variable is malformed or not positive.
    """
    return _read_int(_WORLD_SIZE_VARS, 1, minimum=1)[0]


def get_local_rank() -> int:
    """Return this process's rank on its node (``LOCAL_RANK``, ``SLURM_LOCALID``, ...; else 0).

    :raises ValueError: If the variable is malformed or not smaller than the local world size.
    """
    return _read_rank(_LOCAL_RANK_VARS, get_local_world_size(), "local world size")


def get_local_world_size() -> int:
    """Return the number of processes on this node (``LOCAL_WORLD_SIZE``, ...; else 1).

    :raises ValueError: If the variable is malformed or not positive.
    """
    return _read_int(_LOCAL_WORLD_SIZE_VARS, 1, minimum=1)[0]


def get_default_device() -> torch.device:
    """Return ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def get_master_address() -> tuple[str, int]:
    """Return the rendezvous host and port.

    ``MASTER_ADDR`` / ``MASTER_PORT`` (torchrun) win; under SLURM the launch node's address and a
    port derived from the job id are used when they are missing.

    :raises ValueError: If no address can be found, or ``MASTER_PORT`` is not a valid port.
    """
    host = os.environ.get("MASTER_ADDR") or os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if not host:
        if get_world_size() == 1:
            host = "127.0.0.1"
        else:
            raise ValueError(
                "The environment variable `MASTER_ADDR` must be set for a multi-process run, but is not set."
            )
    raw_port = os.environ.get("MASTER_PORT")
    if raw_port:
        try:
            port = int(raw_port)
        except ValueError:
            raise ValueError(
                f"The environment variable `MASTER_PORT` must be an integer, but is {raw_port!r} instead."
            ) from None
        if not 0 < port < 65536:
            raise ValueError(
                f"The environment variable `MASTER_PORT` must be in the range [1, 65535], but is {port} instead."
            )
        return host, port
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id and job_id.isdigit():
        return host, 20000 + int(job_id) % 20000
    if get_world_size() == 1:
        return host, 0
    raise ValueError("The environment variable `MASTER_PORT` must be set for a multi-process run, but is not set.")
