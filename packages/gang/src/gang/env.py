"""Reading the launcher's environment: torchrun, SLURM and Open MPI.

Every helper reads one launcher's variables as a whole (see :mod:`gang.launchers` for how the
launcher is found and which wins when several are present), and falls back to a world of one
process when there is none. A malformed value is a ``ValueError`` that names the variable and
the value.
"""

from __future__ import annotations

import os

import torch

from gang.launchers import Launcher, detect_launcher

__all__ = [
    "get_default_device",
    "get_launcher",
    "get_local_rank",
    "get_local_world_size",
    "get_master_address",
    "get_rank",
    "get_world_size",
]


def get_launcher() -> Launcher:
    """Return the launcher of this process, read from ``os.environ`` now.

    :raises ValueError: If a variable of the detected launcher is missing or malformed.
    """
    return detect_launcher(os.environ)


def get_rank() -> int:
    """Return this process's global rank (``RANK``, ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``; else 0).

    :raises ValueError: If a variable of the launcher is malformed, or the rank is not smaller
        than the world size.
    """
    return get_launcher().rank


def get_world_size() -> int:
    """Return the number of processes (``WORLD_SIZE``, ``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``; else 1).

    :raises ValueError: If a variable of the launcher is malformed.
    """
    return get_launcher().world_size


def get_local_rank() -> int:
    """Return this process's rank on its node (``LOCAL_RANK``, ``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``; else 0).

    :raises ValueError: If a variable of the launcher is malformed, or the local rank is not
        smaller than the local world size.
    """
    return get_launcher().local_rank


def get_local_world_size() -> int:
    """Return the number of processes on this node (``LOCAL_WORLD_SIZE``; under SLURM this
    node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``), indexed by
    ``SLURM_NODEID``; ``OMPI_COMM_WORLD_LOCAL_SIZE``; else 1).

    :raises ValueError: If a variable of the launcher is malformed.
    """
    return get_launcher().local_world_size


def get_default_device() -> torch.device:
    """Return ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``.

    When the launcher shows each process fewer GPUs than there are local ranks (for example
    ``srun --gpus-per-task=1``), the index is the local rank modulo the visible device count.

    :raises ValueError: If CUDA is available and a variable of the launcher is malformed.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def get_master_address() -> tuple[str, int]:
    """Return the rendezvous host and port (see :meth:`gang.launchers.Launcher.master_address`).

    ``MASTER_ADDR`` / ``MASTER_PORT`` win; under SLURM the first node of the step and a port
    derived from the job and step ids, under Open MPI ``mpirun``'s host and a port derived from
    its job id are used when they are missing.

    :raises ValueError: If no address can be found (the message names the launcher and the fix),
        or a variable is malformed.
    """
    return get_launcher().master_address()
