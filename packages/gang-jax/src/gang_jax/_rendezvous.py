"""Finding the JAX coordinator: explicit arguments, JAX's variables, the launcher, or a local one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from gang import rendezvous
from gang.address import free_port
from gang.env import get_launcher, get_master_address
from gang.extend import guard
from gang.launchers import Launcher


@dataclass(frozen=True)
class Rendezvous:
    """What :func:`jax.distributed.initialize` is given; ``None`` lets JAX detect it (Kubernetes, Cloud TPU, ...)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


def _coordinator_key(launcher: Launcher) -> str:
    """A fresh store key under which JAX's coordinator address is published.

    It holds the launcher's restart count and a per-process count of JAX rendezvous, so a second
    initialisation, in the same process or after an elastic restart, never reads a stale address.
    """
    return f"gang_jax/coordinator/{launcher.restart_count}/{rendezvous.next_call('gang_jax/coordinator')}"


def _beside(launcher: Launcher) -> str:
    """The launcher's rendezvous host, and the port after its rendezvous port.

    Ports derived by :mod:`gang.launchers` are even, so the next one belongs to the same job or
    step; an explicit ``MASTER_PORT`` must leave the next port free too.
    """
    host, port = launcher.master_address()
    return f"{host}:{port + 1 if port < 65535 else port - 1}"


def _publish_through_torch_store(launcher: Launcher, process_id: int, num_processes: int, timeout: timedelta) -> str:
    """Rank 0 binds a free port and publishes ``host:port`` in torch's store; every rank reads it.

    The port is chosen by the operating system, so it cannot be torch's store port (which is in
    use). The key carries the elastic restart count and a per-process generation, so a second
    initialisation never reads a stale address.
    """
    host, port = get_master_address()
    key = _coordinator_key(launcher)
    what = f"the JAX coordinator address could not be exchanged through torch's store at {host}:{port}"
    with guard("create_default", (process_id, num_processes), what):
        store = rendezvous.store(host, port, num_processes, is_master=False, timeout=timeout)
        if process_id == 0:
            address = f"{host}:{free_port(host)}"
            store.set(key, address)
        else:
            address = store.get(key).decode()
    return address


def resolve(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, timeout: timedelta
) -> Rendezvous:
    """Fill in what the caller did not give, in the order: arguments, JAX's variables, the launcher, one local process.

    Under torchrun, rank 0 picks a free port and shares it through the agent's store. Under the
    other launchers (SLURM, Open MPI, or ``env://`` without an agent) the coordinator is the
    launcher's rendezvous host, on the port after the rendezvous port.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    launcher = get_launcher()
    if launcher.name == "none":
        if coordinator_address is None and num_processes in (None, 1):
            # A single process without any launcher: a private coordinator on the loopback.
            return Rendezvous(f"127.0.0.1:{free_port('127.0.0.1')}", 1, 0)
        return Rendezvous(coordinator_address, num_processes, process_id)
    if num_processes is None:
        num_processes = launcher.world_size
    if process_id is None:
        process_id = launcher.rank
    if coordinator_address is None:
        if launcher.agent_store:
            coordinator_address = _publish_through_torch_store(launcher, process_id, num_processes, timeout)
        else:
            coordinator_address = _beside(launcher)
    return Rendezvous(coordinator_address, num_processes, process_id)
