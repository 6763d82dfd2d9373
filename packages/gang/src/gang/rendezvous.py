"""Every name that processes must agree on: rendezvous stores, generations and group names.

Processes find each other through keys in a store and through the names of the groups they
create. A key or name must be the same on every process that takes part, and must not be reused
by a later round (after :meth:`Gang.close <gang.Gang.close>` and a new initialisation, a stale
key would be read as fresh). This module makes the core's, and holds the rules and tools that
:mod:`gang_mesh` and :mod:`gang_jax` build theirs with (``gang_mesh`` gets the groups a mesh
does not hold from :func:`members_group`).
:mod:`gang.ft` is the exception: it names each replica group after the quorum its members agreed
on, under its own store prefix, since its membership changes at every step:

* :func:`store` keeps one TCP store per rendezvous address for the life of the process;
* :func:`next_generation` starts a new round of the default group, whose keys live under
  :func:`store_prefix` and whose root gang is called :func:`root_name`;
* :func:`wrapped_name` and :func:`sub_name` name the gangs made from a user's group and the
  sub-gangs of a gang, from what every member shares (the parent's name and how often the parent
  was split, a count each gang keeps of its own splits), never from per-process state such as
  the number of groups alive;
* :func:`next_call` counts the calls of a kind (a mesh conversion, a JAX rendezvous) that every
  process makes in the same order, so a name made from the count is the same everywhere;
* :func:`new_named_group` creates a torch group of some processes under such a name, and
  :func:`alone_group` the group of one process alone that a size-1 mesh dimension holds (its name
  never leaves the process);
* :func:`members_group` gives the group of some processes that an earlier call of the same kind
  created, while torch still holds it, and creates it (named after the kind, the members and how
  often they created it) only the first time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from gang._torch_groups import PrefixStore, Store, TCPStore, alone_group, is_registered, new_named_group

__all__ = [
    "alone_group",
    "generation",
    "members_group",
    "new_named_group",
    "next_call",
    "next_generation",
    "prefixed_store",
    "release_stores",
    "root_name",
    "store",
    "store_prefix",
    "sub_name",
    "wrapped_name",
]

_stores: dict[tuple[str, int], Store] = {}
_generation = 0
_calls: dict[str, int] = {}
_member_groups: dict[tuple[str, tuple[int, ...]], ProcessGroup] = {}


def store(host: str, port: int, world_size: int, *, is_master: bool, timeout: timedelta) -> Store:
    """Return the process's TCP store at ``host:port``, connecting (or serving, on the master) once.

    The store outlives the default group: a second initialisation in the same process reuses it
    (under a new :func:`store_prefix`), as the port may still be held by the first one.
    """
    cached = _stores.get((host, port))
    if cached is None:
        cached = TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=False)
        _stores[(host, port)] = cached
    return cached


def release_stores() -> None:
    """Drop this process's rendezvous stores, so that torch closes them now (joining their threads).

    Called at interpreter exit once the default group is destroyed; a later :func:`store` connects
    (or serves) again.
    """
    _stores.clear()


def next_generation() -> int:
    """Start a new round of the default group in this process and return its number (1, 2, ...)."""
    global _generation
    _generation += 1
    return _generation


def generation() -> int:
    """The number of the current round of the default group (0 before the first)."""
    return _generation


def store_prefix(round_number: int) -> str:
    """The prefix of the store keys of round ``round_number`` of the default group."""
    return f"gang/{round_number}"


def prefixed_store(base: Store, round_number: int) -> Store:
    """``base`` seen under :func:`store_prefix` of round ``round_number``."""
    prefixed: Store = PrefixStore(store_prefix(round_number), base)
    return prefixed


def root_name(round_number: int) -> str:
    """The name of the root gang of round ``round_number``; its sub-gangs' names start with it."""
    return f"gang{round_number}"


def next_call(kind: str) -> int:
    """Count one more call of ``kind`` in this process and return the count (1, 2, ...).

    Every process that takes part must make the calls of one kind in the same order; the count
    is then the same on all of them and can name what the call creates.
    """
    _calls[kind] = count = _calls.get(kind, 0) + 1
    return count


def members_group(global_ranks: Sequence[int], kind: str) -> ProcessGroup:
    """The torch group of ``global_ranks`` that an earlier call of ``kind`` created, or a new one; only members call it.

    A group is created (with :func:`new_named_group`, on the default group's backend) the first
    time ``kind`` asks for these members, and again only once torch no longer holds it (after it or
    the default group was destroyed); every other call returns it, so converting the same mesh
    again costs no new communicator. Its name is ``kind``, a digest of the members and how often
    this process created a group of ``kind`` for them. Every member must make the calls of ``kind``
    that involve it in the same order (then all of them create the group together, under the same
    name): true of a mesh conversion, which every process of the mesh makes.

    :param global_ranks: The members, as global ranks; the group lists them sorted.
    :param kind: Who asks (``"gang_mesh"``): groups of different kinds are never shared.
    :raises ValueError: If this process is not in ``global_ranks`` (before any communication).
    """
    members = tuple(sorted(global_ranks))
    if (me := dist.get_rank()) not in members:
        raise ValueError(f"`global_ranks` must hold this process (rank {me}), but is {list(members)} instead.")
    cached = _member_groups.get((kind, members))
    if cached is not None and is_registered(cached):
        return cached
    digest = hashlib.sha1(repr(members).encode(), usedforsecurity=False).hexdigest()[:16]
    count = next_call(f"{kind}/{digest}")
    pg = new_named_group(list(members), f"{kind}/{digest}/{count}", None)
    if not isinstance(pg, ProcessGroup):  # cannot happen: this process is a member
        raise AssertionError(f"rank {me} got no group of {list(members)}")
    _member_groups[(kind, members)] = pg
    return pg


def wrapped_name(group_name: str, size: int) -> str:
    """The name of a gang that wraps the user's torch group ``group_name`` of ``size`` processes.

    Members wrap the same group in the same order, so the name is the same on all of them; it
    holds the round of the default group, so a group re-created after a new initialisation
    (torch may reuse its name) gets a fresh one.
    """
    count = next_call(f"wrap:{group_name}")
    return f"wrap{_generation}:{group_name}:{count}:{size}"


def sub_name(parent: str, split_index: int, group_index: int) -> str:
    """The name of group ``group_index`` of the ``split_index``-th split of the gang named ``parent``."""
    return f"{parent}.{split_index}.{group_index}"
