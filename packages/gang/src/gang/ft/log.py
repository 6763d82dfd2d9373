"""The ``gang.ft`` logger: every quorum change, drop, death, stalled replica, heal and aborted step, with fields.

Each record's message is readable as it is; its fields are also attached as ``record.gang_ft``
(a ``dict`` with the ``event`` name), so a handler or formatter can emit them as JSON.
"""

from __future__ import annotations

import logging

from gang.ft.policy import Quorum

logger = logging.getLogger("gang.ft")
"""The logger of :mod:`gang.ft`."""


def log_event(event: str, message: str, *, level: int = logging.INFO, **fields: object) -> None:
    """Log ``message`` on the ``gang.ft`` logger with ``fields`` and ``event`` as ``record.gang_ft``.

    :param event: The kind of event: ``quorum``, ``drop``, ``died``, ``stalled``, ``unreachable``, ``apart``,
        ``heal``, ``abort`` or ``sync``
        (a sync of :class:`gang.ft.LocalSGD` or :class:`gang.ft.DiLoCo`).
    """
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"gang_ft": {"event": event, **fields}})


def log_quorum(replica_id: str, old: Quorum | None, new: Quorum, replica_rank: int = 0) -> None:
    """Log a quorum whose members differ from the last one's, every replica it dropped, and the
    replicas it waited ``quorum_timeout`` for (``stalled``: once per member replica, by its
    process of replica rank 0, since every process of every member learns the same quorum)."""
    if new.timed_out and replica_rank == 0:
        log_event(
            "stalled",
            f"quorum {new.round} waited `quorum_timeout` for live replica(s) {list(new.timed_out)} that did not "
            "join; they are left out until they join again",
            level=logging.WARNING,
            replica=replica_id,
            round=new.round,
            timed_out=list(new.timed_out),
        )
    if new.apart and replica_rank == 0 and (old is None or old.apart != new.apart):
        log_event(
            "apart",
            f"quorum {new.round} keeps replica(s) {list(new.apart)} apart: a link between them and a member is "
            "reported broken; they wait outside the quorum until it is back (the partition rule)",
            level=logging.WARNING,
            replica=replica_id,
            round=new.round,
            apart=list(new.apart),
        )
    if old is not None and old.members == new.members:
        return
    log_event(
        "quorum",
        f"replica {replica_id!r} is in {new.describe()} at step {new.max_step}",
        replica=replica_id,
        round=new.round,
        members=list(new.members),
        steps=list(new.steps),
        heal=dict(new.heal),
        stalled=list(new.stalled),
        apart=list(new.apart),
    )
    for dropped in () if old is None else sorted(set(old.members) - set(new.members)):
        log_event(
            "drop",
            f"replica {dropped!r} dropped from the quorum in round {new.round}",
            replica=dropped,
            round=new.round,
        )


def abort_reason(error: Exception | None) -> str:
    """The reason an aborted step is logged with: the recorded error, or a member that failed or did not vote."""
    return "a member failed or did not vote in time" if error is None else str(error)


__all__ = ["log_event", "logger"]
