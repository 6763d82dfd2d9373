"""Splitting a gang into the sub-gangs of a grid or a layout, creating only what is needed.

The factories (:mod:`gang.factories`) and :meth:`Gangs.flatten <gang.Gangs.flatten>` build on
these; a group of one rank is a :class:`~gang.FakeGang` and a group spanning the whole gang is
the gang itself, so no needless process group is created.
"""

from __future__ import annotations

from collections.abc import Sequence

from gang.fake import FakeGang
from gang.gang import Gang
from gang.topology import Layout


def split_groups(gang: Gang, groups: list[list[int]]) -> Gang:
    """The sub-gang of ``gang`` holding this process when ``groups`` (of equal sizes) partition it:
    ``gang`` itself for one group, a :class:`FakeGang` for groups of one rank."""
    if len(groups[0]) == gang.size:
        return gang
    if len(groups[0]) == 1:
        return FakeGang(gang.device, rank=0, size=1)
    sub = gang.split(groups)
    if sub is None:  # Impossible: the groups partition the gang.
        raise AssertionError(f"rank {gang.rank} is in no group of {groups}")
    return sub


def split_layout(gang: Gang, layout: Layout, roles: Sequence[str]) -> Gang:
    """Return the sub-gang of ``gang`` spanning ``roles`` of ``layout`` (which describes ``gang``'s ranks).

    A group of one rank gives a :class:`FakeGang` and a group spanning all of ``gang`` is ``gang``
    itself, so no needless process group is created. This process's group is computed in
    O(group size); every group is listed only for a backend that splits with all of them.
    Every member of ``gang`` must call it with the same arguments.

    :raises ValueError: If ``layout.size != gang.size`` or ``roles`` are not roles that can be
        spanned at once.
    """
    if layout.size != gang.size:
        raise ValueError(f"`layout` must have {gang.size} ranks (the gang size), but has {layout.size} instead.")
    roles = tuple(roles)
    size = layout.size_of(*roles)
    if size == gang.size:
        return gang
    if size == 1:
        return FakeGang(gang.device, rank=0, size=1)
    members = layout.members(gang.rank, *roles)

    def every_group() -> list[list[int]]:
        groups: list[list[int]] = layout.groups(*roles).tolist()
        return groups

    sub = gang.split_own_group(members, every_group)
    if sub is None:  # Impossible: the groups partition the gang.
        raise AssertionError(f"rank {gang.rank} is in no group of {roles}")
    sub._trace.rename(layout.describe(gang.rank, roles))
    return sub


__all__ = ["split_groups", "split_layout"]
