"""Finding the JAX coordinator: explicit arguments, JAX's variables, torchrun's variables, or a local one."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from gang.env import get_master_address, get_rank, get_world_size
from gang.extend import operation_error

_KEY_PREFIX = "gang_jax/coordinator"
_generation = 0


@dataclass(frozen=True)
class Rendezvous:
    """What :func:`jax.distributed.initialize` is given; ``None`` lets JAX detect it (SLURM, Open MPI, ...)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


def free_port(host: str) -> int:
    """Return a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost", "") else "127.0.0.1", 0))
        return int(s.getsockname()[1])


def _under_torchrun() -> bool:
    return all(os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _publish_through_torch_store(process_id: int, num_processes: int, timeout: timedelta) -> str:
    """Rank 0 binds a free port and publishes ``host:port`` in torch's store; every rank reads it.

    The port is chosen by the operating system, so it cannot be torch's store port (which is in
    use). The key carries the elastic restart count and a per-process generation, so a second
    initialisation never reads a stale address.
    """
    global _generation
    _generation += 1
    host, port = get_master_address()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"{_KEY_PREFIX}/{restart}/{_generation}"
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, num_processes, is_master=False, timeout=timeout, wait_for_workers=False
        )
        if process_id == 0:
            address = f"{host}:{free_port(host)}"
            store.set(key, address)
        else:
            address = store.get(key).decode()
    except (RuntimeError, OSError, ValueError) as ex:
        raise operation_error(
            "create_default",
            (process_id, num_processes),
            f"the JAX coordinator address could not be exchanged through torch's store at {host}:{port}: {ex}",
        ) from ex
    return address


def resolve(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, timeout: timedelta
) -> Rendezvous:
    """Fill in what the caller did not give, in the order: arguments, JAX's variables, torchrun, one local process."""
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if _under_torchrun():
        if num_processes is None:
            num_processes = get_world_size()
        if process_id is None:
            process_id = get_rank()
        if coordinator_address is None:
            coordinator_address = _publish_through_torch_store(process_id, num_processes, timeout)
        return Rendezvous(coordinator_address, num_processes, process_id)
    if coordinator_address is None and num_processes in (None, 1) and get_world_size() == 1:
        # A single process without any launcher: a private coordinator on the loopback.
        return Rendezvous(f"127.0.0.1:{free_port('127.0.0.1')}", 1, 0)
    return Rendezvous(coordinator_address, num_processes, process_id)
