"""Fault-tolerant training across replicas: survivors go on when a replica dies.

A *replica* is one process or a group of processes (one torchrun) that fails and restarts
together. Replicas train data-parallel through a :class:`ReplicaGang`, whose membership changes
at runtime: ``with gang.step():`` forms the quorum of live replicas, rebuilds the process group
when membership changed and heals a replica that is behind; a failed collective inside a step is
recorded instead of raised, and :meth:`ReplicaGang.should_commit` tells every member whether the
step counts. Who is live and who takes part is decided by one :class:`Policy` (``join(policy=...)``;
:class:`SparesPolicy` keeps a fixed number of replicas stepping and the others as spares).
Replicas meet through ``python -m gang.ft.store`` (see :mod:`gang.ft.store`). Replicas that
synchronise every few hundred steps instead of every step use :class:`LocalSGD` or
:class:`DiLoCo` (:mod:`gang.ft.diloco`) over the same gang.
"""

from __future__ import annotations

from gang.ft.diloco import DiLoCo, LocalSGD
from gang.ft.policy import Policy, SparesPolicy
from gang.ft.replica import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_REPLICA_TIMEOUT, ReplicaGang, ReplicaStatus

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_REPLICA_TIMEOUT",
    "DiLoCo",
    "LocalSGD",
    "Policy",
    "ReplicaGang",
    "ReplicaStatus",
    "SparesPolicy",
]
