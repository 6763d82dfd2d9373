"""The heartbeat of one :mod:`gang.ft` process: a background thread that writes it to the store.

The keys it writes are described in :mod:`gang.ft.quorum`. The thread has its own store
connection, so a training thread blocked in a request never delays a heartbeat. It also serves
this process's death signal and watches that of the process this one watches
(:mod:`gang.ft.liveness`): when that process dies, it marks it dead in the store at once. While
the training thread blocks for a vote's decision, it watches the vote at every beat
(:meth:`~gang.ft.quorum.QuorumClient.watch_vote`: ``abort`` on a silent member or a passed
deadline, which ends the wait). Every heartbeat carries the replicas this process reports it could
not reach, which the thread probes again after each beat (:class:`gang.ft.reach.Reports`). Internal
to :mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import suppress

from gang.errors import BACKEND_ERRORS
from gang.ft.liveness import Liveness
from gang.ft.log import log_event
from gang.ft.policy import Process, Quorum
from gang.ft.quorum import IdentityError, QuorumClient, collect, heartbeat_period
from gang.ft.reach import Reports

_BEAT_ERRORS: tuple[type[Exception], ...] = (IdentityError, *BACKEND_ERRORS)
"""What stops the heartbeat: the store failed, or another process took this identity over."""


class Heartbeat:
    """Writes one process's heartbeat every :func:`~gang.ft.quorum.heartbeat_period` and deletes
    the keys of the rounds this process closed as leader.

    :param protocol: A quorum client of this process with a store connection of its own.
    :param step: Returns the process's step number (written with every heartbeat).
    :param closed_rounds: Returns the rounds this process published as leader since the last call
        (:meth:`~gang.ft.quorum.QuorumClient.take_closed`).
    :param heartbeat_timeout: The process's ``heartbeat_timeout`` in seconds.
    :param name: The thread's name.
    :param liveness: This process's death signal (served and used to watch; closed by its owner).
    :param reports: The replicas this process reports unreachable (written with every heartbeat,
        probed again after each).
    """

    def __init__(
        self,
        protocol: QuorumClient,
        step: Callable[[], int],
        closed_rounds: Callable[[], list[int]],
        heartbeat_timeout: float,
        name: str,
        liveness: Liveness,
        reports: Reports | None = None,
    ) -> None:
        self.error: Exception | None = None
        """What stopped the heartbeat (an :class:`~gang.ft.quorum.IdentityError` or a store
        error), ``None`` while it runs."""
        self._protocol = protocol
        self._step = step
        self._closed_rounds = closed_rounds
        self._interval = heartbeat_period(heartbeat_timeout)
        self._liveness = liveness
        self.reports = Reports() if reports is None else reports
        """The replicas this process reports unreachable."""
        self._target: tuple[Process, str] | None = None  # set by the training thread
        self._vote: tuple[Quorum, float] | None = None  # set by the training thread while it waits in a vote
        self._watching: tuple[Process, str] | None = None
        self._dead: tuple[Process, str] | None = None  # seen dead, not marked in the store yet
        self._stop = threading.Event()
        self._release = threading.Lock()
        self._released = self._ended = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, target: tuple[Process, str] | None) -> None:
        """Watch the death signal of process ``target`` (with its incarnation) from the next beat on."""
        self._target = target

    def watch_vote(self, vote: tuple[Quorum, float] | None) -> None:
        """Watch the vote of a quorum, until a monotonic deadline, from the next beat on
        (:meth:`~gang.ft.quorum.QuorumClient.watch_vote`) while the training thread waits for its
        decision in a blocking request; ``None`` when the wait is over."""
        self._vote = vote

    @property
    def running(self) -> bool:
        """Whether the thread still beats (it stops on a store error or a lost identity)."""
        return self.error is None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it to end."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def release(self) -> None:
        """Close the death signal's sockets once the thread has ended: now, or when it ends (a
        beat stuck on a hung store may outlive :meth:`stop`'s wait)."""
        with self._release:
            self._released = True
            if self._ended:
                self._liveness.close()

    def _run(self) -> None:
        try:
            self._beat()
        finally:
            self.reports.close()
            with self._release:
                self._ended = True
                if self._released:
                    self._liveness.close()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._protocol.beat(self._step(), self.reports.current())
            except _BEAT_ERRORS as ex:
                self.error = ex
                return
            self.reports.wrote()
            with suppress(OSError):
                self.reports.poll()
            if self._stop.is_set():
                return
            with suppress(*BACKEND_ERRORS, OSError):  # a lost store shows at the next beat
                self._watch()
                vote = self._vote
                if vote is not None:
                    self._protocol.watch_vote(*vote)
            # Delete the keys of the rounds before those this process closed as leader: a few
            # requests per round it led, so a beat is never late behind a long clean-up (a failure
            # here only leaves keys behind, and a lost store shows at the next beat).
            with suppress(*BACKEND_ERRORS):
                for n in self._closed_rounds():
                    collect(self._protocol.client, n)

    def _watch(self) -> None:
        """Serve the processes watching this one; mark the watched one dead if its signal fired."""
        self._liveness.serve()
        target = self._target
        if target != self._watching:
            self._dead = None
            address = None if target is None else self._protocol.address_of(*target)
            self._liveness.watch(address, "" if target is None else target[1])
            if address is not None or target is None:  # a claim not found (a restarted store) is read again
                self._watching = target
        elif target is not None and self._liveness.died():
            self._dead = target
        if self._dead is not None:
            # Mark it now; a store error leaves `_dead` set, to mark it at the next beat.
            (rid, rank), token = self._dead
            marked = self._protocol.mark_dead((rid, rank), token)
            self._dead = None
            if marked:
                log_event(
                    "died",
                    f"replica {rid!r} rank {rank} died: the connection its process held open closed",
                    replica=rid,
                    replica_rank=rank,
                )


__all__ = ["Heartbeat"]
