"""The :class:`Gangs` container and the calling thread's current gangs."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from math import prod
from types import TracebackType
from typing import cast, final

import numpy as np
import torch

from gang.extend import check_open, check_values_exchangeable
from gang.fake import FakeGang
from gang.gang import Gang
from gang.roles import AXIS_ROLES, GRID_AXES, ROLE_TABLE, ROLES, SIZE_ONE, SIZE_RULES
from gang.split import split_groups, split_layout
from gang.topology import Grid, Layout, flattened_axes


def _omitted() -> Gang:
    """The default of an optional role (one whose :attr:`~gang.roles.Role.omitted` is set): filled in by
    :meth:`Gangs.__post_init__`."""
    return cast(Gang, None)


@dataclass(frozen=True, kw_only=True)
class Gangs:
    """The gangs of one process, one per parallelism role (the roles of :data:`gang.roles.ROLE_TABLE`).

    :param root: Every process.
    :param dp: Data parallel.
    :param rdp: Replicated data parallel (inter-node for HSDP; what DDP uses).
    :param sdp: Sharded data parallel (intra-node for HSDP; what FSDP uses).
    :param cp: Context parallel (the sequence split across ranks); a size-1 gang when omitted.
    :param tp: Tensor parallel.
    :param pp: Pipeline parallel.
    :param ep: Expert parallel (ranks that hold different experts); a size-1 gang when omitted.
    :param edp: Expert data parallel (ranks that hold the same experts); ``dp`` when omitted.
    :param etp: Expert tensor parallel (ranks that split one expert's weights); ``tp`` when
        omitted, so every ``ep`` and ``edp`` gang is then what it is without it.
    :param layout: Where every rank of ``root`` sits (the factories set it); ``None`` when not
        known. :meth:`flatten` and the mesh bridge use it instead of communicating.
    :raises TypeError: If a role is not a :class:`~gang.Gang`, or ``layout`` not a
        :class:`~gang.topology.Layout`.
    :raises ValueError: If the gangs do not share one device, or
        ``dp.size * cp.size * tp.size * pp.size != root.size``, ``rdp.size * sdp.size != dp.size``
        or ``ep.size * edp.size * etp.size != dp.size * cp.size * tp.size`` (the rules of
        :data:`gang.roles.SIZE_RULES`), or ``layout`` disagrees with the sizes.

    ``with gangs:`` makes them the calling thread's current gangs (see
    :func:`maybe_get_current_gangs`); the statement nests and returns the gangs.
    """

    root: Gang
    dp: Gang
    rdp: Gang
    sdp: Gang
    cp: Gang = field(default_factory=_omitted)
    tp: Gang
    pp: Gang
    ep: Gang = field(default_factory=_omitted)
    edp: Gang = field(default_factory=_omitted)
    etp: Gang = field(default_factory=_omitted)
    layout: Layout | None = field(default=None, repr=False, compare=False)
    _flattened: dict[tuple[str, ...], Gang] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.root, Gang):
            raise TypeError(f"`root` must be a `Gang`, but is of type `{type(self.root).__name__}` instead.")
        for row in ROLE_TABLE:
            if getattr(self, row.name) is None and row.omitted is not None:
                omitted = FakeGang(self.root.device) if row.omitted == SIZE_ONE else getattr(self, row.omitted)
                object.__setattr__(self, row.name, omitted)
        for name in ROLES:
            value = getattr(self, name)
            if not isinstance(value, Gang):
                raise TypeError(f"`{name}` must be a `Gang`, but is of type `{type(value).__name__}` instead.")
        for name in ROLES[1:]:
            gang = getattr(self, name)
            if gang.device != self.root.device:
                raise ValueError(
                    f"`{name}` must be on the root gang's device {self.root.device}, but is on {gang.device} instead."
                )
        for left, right in SIZE_RULES:
            factors = [getattr(self, name).size for name in left]
            want = prod(getattr(self, name).size for name in right)
            if prod(factors) != want:
                raise ValueError(
                    f"`{' * '.join(f'{name}.size' for name in left)}` must equal "
                    f"`{' * '.join(f'{name}.size' for name in right)}` ({want}), but is "
                    f"{' * '.join(map(str, factors))} = {prod(factors)} instead."
                )
        if self.layout is not None:
            if not isinstance(self.layout, Layout):
                raise TypeError(f"`layout` must be a `Layout` or `None`, but is {self.layout!r} instead.")
            sizes = {name: self.layout.size_of(name) for name in ROLES}
            actual = {name: getattr(self, name).size for name in ROLES}
            if sizes != actual:
                raise ValueError(f"`layout` must give the gangs' sizes {actual}, but gives {sizes} instead.")

    def items(self) -> list[tuple[str, Gang]]:
        """Return ``(role, gang)`` pairs in the order of :data:`gang.roles.ROLES`."""
        return [(name, getattr(self, name)) for name in ROLES]

    @final
    def flatten(self, *roles: str) -> Gang:
        """Return the gang that spans several dense roles at once, such as ``flatten("sdp", "cp")``.

        Every member of the root gang calls it with the same roles, in any order (it may create a
        group). The gang's rank order is the grid's: outer roles vary slowest, so ranks ascend as
        in torch's own groups. One role gives that role's gang. The result is cached and closed
        with these gangs. Gangs that know their :attr:`layout` find the members without
        communicating; others gather ``len(GRID_AXES)`` integers per process over ``root``.

        :raises ValueError: If ``roles`` is empty, or names an unknown or repeated role, or
            overlapping roles (``dp`` with ``rdp`` or ``sdp``; ``root`` or an expert role with any
            other role).
        :raises TypeError: If a role is not a ``str``.
        :raises NotSupportedError: If the gangs have no layout and ``root`` cannot exchange values
            (a dry run).
        :raises GangError: If creating the gang fails.
        """
        check_open(self.root, "flatten")
        axes = flattened_axes(roles)
        if len(roles) == 1:
            gang: Gang = getattr(self, roles[0])
            return gang
        cached = self._flattened.get(axes)
        if cached is None:
            cached = self._flatten(axes)
            self._flattened[axes] = cached
        return cached

    def _flatten(self, axes: tuple[str, ...]) -> Gang:
        return _flatten_gangs(self, axes)

    def close(self) -> None:
        """Close every distinct gang (flattened ones included), sub-gangs before the root. Idempotent."""
        seen: list[Gang] = []
        for gang in [*self._flattened.values(), *(getattr(self, name) for name in reversed(ROLES))]:
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


def _flatten_gangs(gangs: Gangs, axes: tuple[str, ...]) -> Gang:
    """The gang of :meth:`Gangs.flatten` spanning the grid ``axes`` (at least two roles' worth).

    With a layout the members are computed here; otherwise every process gathers, over ``root``,
    every process's rank along each grid axis: ``len(GRID_AXES)`` integers per process.
    """
    layout = gangs.layout
    if layout is not None:
        key = layout.key(*axes)
        for name, gang in gangs.items():
            if layout.key(name) == key:
                return gang
        return split_layout(gangs.root, layout, axes)
    root = gangs.root
    check_values_exchangeable(root, "flatten (of gangs without a layout)")
    along: dict[str, Gang] = {axis: getattr(gangs, AXIS_ROLES[axis]) for axis in GRID_AXES}
    # A process's coordinates are its ranks along the axes; the processes laid out on the grid
    # of those axes give every flattened gang as a group of the grid.
    row = [along[axis].rank for axis in GRID_AXES]
    table = torch.empty((root.size, len(row)), dtype=torch.int64, device=root.device)
    root.all_gather(table, torch.tensor(row, dtype=torch.int64, device=root.device))
    grid = Grid(tuple((axis, along[axis].size) for axis in GRID_AXES))
    try:
        placed = grid.place(table.cpu().numpy(), np.arange(root.size))
    except ValueError as ex:
        size = prod(along[axis].size for axis in axes)
        raise ValueError(
            f"`roles` must span gangs of {size} ranks, but the gangs of {axes} do not form a grid ({ex}) instead."
        ) from None
    groups = sorted(placed.reshape(-1)[grid.group_table(*axes)].tolist())
    return split_groups(root, groups)


def _check_fields() -> None:
    """The fields of :class:`Gangs` are the roles of the table, in order, optional where the table says so."""
    fields = [f for f in dataclasses.fields(Gangs) if f.init and f.name != "layout"]
    assert tuple(f.name for f in fields) == ROLES, ([f.name for f in fields], ROLES)
    for f, row in zip(fields, ROLE_TABLE, strict=True):
        assert (f.default_factory is _omitted) == (row.omitted is not None), row


_check_fields()
