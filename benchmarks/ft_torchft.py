"""The torchft side of ``benchmarks/ft.py``: the same step through torchft 0.2's ``Manager`` and Lighthouse.

This module runs only under the interpreter given to ``python -m benchmarks.ft --torchft-python``
(a separate virtual environment with ``torch==2.13.0 torchft==0.2.0``): torchft is a reference to
compare with, never a dependency of gang, so it is imported by name at run time.

``python -m benchmarks.ft_torchft --port P --timeout T`` serves the Lighthouse (torchft's quorum
service; T is its join timeout, how long it waits for the previous quorum's members before forming
a smaller one, and its heartbeat timeout);
:class:`TorchftTrainer` is one replica's training step, as torchft's ``OptimizerWrapper`` runs it:
``start_quorum()``, the compute, ``allreduce(...).wait()``, ``should_commit()``, the update.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

from torch import Tensor
from torch._C._distributed_c10d import TCPStore

MANAGER_TIMEOUT_S = 5.0
"""The least timeout of the Manager (collectives, quorum request, connections)."""


class _StateOwner(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def make_manager(
    owner: _StateOwner,
    replica: int,
    min_replicas: int,
    lighthouse: str,
    timeout_s: float,
    *,
    use_async_quorum: bool = True,
) -> tuple[TCPStore, Any]:
    """Return the replica-group store and the torchft ``Manager`` of replica ``replica`` (1 process, gloo).

    The Manager advertises ``127.0.0.1`` to the Lighthouse (every process of the benchmark is on
    this machine); ``use_async_quorum=False`` is what torchft's ``DiLoCo`` requires.
    """
    torchft: Any = importlib.import_module("torchft")
    # The Lighthouse's join and heartbeat timeouts decide when a dead replica is left out; the
    # Manager's quorum request must outlast a slow step (1 s made it fail under load).
    timeout = timedelta(seconds=max(timeout_s, MANAGER_TIMEOUT_S))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=owner.load_state_dict,
        state_dict=owner.state_dict,
        min_replica_size=min_replicas,
        use_async_quorum=use_async_quorum,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench_{replica}",
        hostname="127.0.0.1",
    )
    return store, manager


class TorchftTrainer:
    """One replica of 1 process under a torchft ``Manager`` (its own replica-group store, gloo)."""

    def __init__(
        self,
        owner: _StateOwner,
        replica: int,
        min_replicas: int,
        lighthouse: str,
        timeout_s: float,
        parts: tuple[Callable[[int, int], Tensor], Callable[[Tensor], None]],
    ) -> None:
        self._store, self.manager = make_manager(owner, replica, min_replicas, lighthouse, timeout_s)
        self._compute, self._apply = parts

    @property
    def step_number(self) -> int:
        """The number of committed steps (torchft's ``current_step()``)."""
        return int(self.manager.current_step())

    @property
    def quorum_size(self) -> int:
        """The number of replicas that took part in the last quorum."""
        return int(self.manager.num_participants())

    def train_step(self, micro_batches: int) -> bool:
        """Run one step; return whether it was committed."""
        self.manager.start_quorum()
        flat = self._compute(self.step_number, micro_batches)
        self.manager.allreduce(flat).wait()
        committed = bool(self.manager.should_commit())
        if committed:
            self._apply(flat)
        return committed

    def close(self) -> None:
        """Shut the manager down."""
        self.manager.shutdown(wait=False)


def main() -> None:
    """Serve the Lighthouse until killed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1.0, help="join and heartbeat timeout (seconds)")
    args = parser.parse_args()
    coordination: Any = importlib.import_module("torchft.coordination")
    timeout_ms = round(args.timeout * 1000)
    server = coordination.LighthouseServer(
        bind=f"127.0.0.1:{args.port}",
        min_replicas=args.min_replicas,
        join_timeout_ms=timeout_ms,
        heartbeat_timeout_ms=timeout_ms,
    )
    print(f"lighthouse at {server.address()}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
