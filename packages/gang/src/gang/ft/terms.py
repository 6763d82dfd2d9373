"""The terms a process joins its replicas on: :meth:`gang.ft.ReplicaGang.join`'s policy arguments
and bounds reconciled into one :class:`Terms`.

A pure function beside :mod:`gang.ft.policy`, whose :class:`~gang.ft.policy.Policy` it builds or
takes: it reads only its arguments (no store, no clock, no environment). ``join`` checks the
identity arguments, which may come from the environment, in :mod:`gang.ft.identity`.

Internal to :mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from gang.extend import check_int, check_timeout
from gang.ft.policy import Policy

DEFAULT_REPLICA_TIMEOUT = timedelta(seconds=60)
"""The ``timeout`` of :meth:`gang.ft.ReplicaGang.join` when none is given: the bound on one of the
replicas' collectives, on a heal and on the commit vote."""

DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=2)
"""The ``heartbeat_timeout`` of :meth:`gang.ft.ReplicaGang.join` when none is given."""

_POLICY_DEFAULTS = {"min_replicas": 1, "quorum_timeout": None, "heartbeat_timeout": None, "init_sync": True}
"""``join``'s arguments that a policy carries, with their defaults (what "left out" means)."""


@dataclass(frozen=True)
class Terms:
    """What :func:`reconcile` settles.

    :ivar policy: Every liveness and quorum decision.
    :ivar timeout: The bound on a collective, a heal and the commit vote.
    :ivar max_retries: The consecutive steps not committed after which the gang gives up (``None``: never).
    """

    policy: Policy
    timeout: timedelta
    max_retries: int | None


def reconcile(
    *,
    min_replicas: object,
    timeout: object,
    quorum_timeout: object,
    heartbeat_timeout: object,
    init_sync: object,
    policy: object,
    max_retries: object,
) -> Terms:
    """Check ``join``'s arguments of these names (see :meth:`gang.ft.ReplicaGang.join`) and settle them.

    Without ``policy``: a :class:`~gang.ft.policy.Policy` of ``min_replicas``, ``quorum_timeout``
    (default ``timeout``), ``heartbeat_timeout`` (default :data:`DEFAULT_HEARTBEAT_TIMEOUT`) and
    ``init_sync``. With one: those four must be left out (the policy carries them).

    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If an argument has a bad value, or one the policy carries is given with it.
    """
    min_replicas = check_int("min_replicas", min_replicas, minimum=1)
    timeout = check_timeout(timeout, default=DEFAULT_REPLICA_TIMEOUT)
    if not isinstance(init_sync, bool):
        raise TypeError(f"`init_sync` must be a `bool`, but is {init_sync!r} instead.")
    if policy is None:
        policy = Policy(
            min_replicas,
            check_timeout(quorum_timeout, default=timeout, name="quorum_timeout").total_seconds(),
            check_timeout(
                heartbeat_timeout, default=DEFAULT_HEARTBEAT_TIMEOUT, name="heartbeat_timeout"
            ).total_seconds(),
            init_sync,
        )
    elif not isinstance(policy, Policy):
        raise TypeError(f"`policy` must be a `gang.ft.policy.Policy`, but is {policy!r} instead.")
    else:
        given = {
            "min_replicas": min_replicas,
            "quorum_timeout": quorum_timeout,
            "heartbeat_timeout": heartbeat_timeout,
            "init_sync": init_sync,
        }
        for name, value in given.items():
            if value != _POLICY_DEFAULTS[name]:
                raise ValueError(
                    f"`{name}` must be left out when `policy` is given (the policy carries it), "
                    f"but is {value!r} instead."
                )
    if max_retries is not None:
        max_retries = check_int("max_retries", max_retries, minimum=1)
    return Terms(policy, timeout, max_retries)


__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_REPLICA_TIMEOUT", "Terms", "reconcile"]
