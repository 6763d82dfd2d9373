"""The :class:`Gangs` container and the calling thread's current gangs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from types import TracebackType

from gang.extend import ROLES
from gang.gang import Gang


@dataclass(frozen=True, kw_only=True)
class Gangs:
    """The gangs of one process, one per parallelism role.

    :param root: Every process.
    :param dp: Data parallel.
    :param rdp: Replicated data parallel (inter-node for HSDP; what DDP uses).
    :param sdp: Sharded data parallel (intra-node for HSDP; what FSDP uses).
    :param tp: Tensor parallel.
    :param pp: Pipeline parallel.
    :raises TypeError: If a field is not a :class:`~gang.Gang`.
    :raises ValueError: If the gangs do not share one device, or
        ``dp.size * tp.size * pp.size != root.size`` or ``rdp.size * sdp.size != dp.size``.

    ``with gangs:`` makes them the calling thread's current gangs (see
    :func:`maybe_get_current_gangs`); the statement nests and returns the gangs.
    """

    root: Gang
    dp: Gang
    rdp: Gang
    sdp: Gang
    tp: Gang
    pp: Gang

    def __post_init__(self) -> None:
        for role in ROLES:
            value = getattr(self, role)
            if not isinstance(value, Gang):
                raise TypeError(f"`{role}` must be a `Gang`, but is of type `{type(value).__name__}` instead.")
        for role in ROLES[1:]:
            gang = getattr(self, role)
            if gang.device != self.root.device:
                raise ValueError(
                    f"`{role}` must be on the root gang's device {self.root.device}, but is on {gang.device} instead."
                )
        if self.dp.size * self.tp.size * self.pp.size != self.root.size:
            raise ValueError(
                f"`dp.size * tp.size * pp.size` must equal `root.size` ({self.root.size}), but is "
                f"{self.dp.size} * {self.tp.size} * {self.pp.size} = "
                f"{self.dp.size * self.tp.size * self.pp.size} instead."
            )
        if self.rdp.size * self.sdp.size != self.dp.size:
            raise ValueError(
                f"`rdp.size * sdp.size` must equal `dp.size` ({self.dp.size}), but is "
                f"{self.rdp.size} * {self.sdp.size} = {self.rdp.size * self.sdp.size} instead."
            )

    def items(self) -> list[tuple[str, Gang]]:
        """Return ``(role, gang)`` pairs in the order root, dp, rdp, sdp, tp, pp."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def close(self) -> None:
        """Close every distinct gang, sub-gangs before the root. Idempotent."""
        seen: list[Gang] = []
        for role in reversed(ROLES):
            gang = getattr(self, role)
            if not any(gang is other for other in seen):
                seen.append(gang)
        for gang in seen:
            gang.close()

    def __enter__(self) -> Gangs:
        _stack().append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack = _stack()
        if not stack or stack[-1] is not self:
            raise RuntimeError("`Gangs` context exits are out of order.")
        stack.pop()


_local = threading.local()


def _stack() -> list[Gangs]:
    stack: list[Gangs] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = []
        _local.stack = stack
    return stack


def maybe_get_current_gangs() -> Gangs | None:
    """Return the innermost gangs entered with ``with gangs:`` in this thread, or ``None``."""
    stack = _stack()
    return stack[-1] if stack else None
