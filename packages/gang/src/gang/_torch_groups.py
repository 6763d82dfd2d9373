"""The one place that touches torch's private API: named sub-groups, standalone groups, the ``fake``
backend, and the DDP, FSDP2 and autograd hooks of :mod:`gang.ft`.

**Named sub-groups.** ``dist.new_group(..., use_local_synchronization=True)`` (the only public way
to create a group among a subset of processes without every process of the world taking part)
names the group ``sha1(ranks + number of groups alive in *this* process)``. Two members with
different group histories (one of them is also in another sub-gang) compute different names and
wait forever for each other, and a group re-created with the same ranks reuses the store keys of
a destroyed one. Gangs instead name each sub-group after its parent gang and the parent's split
counter, which all members of the parent share because they call ``split``/``create_gang`` in the
same order (:func:`new_named_group`, :func:`alone_group`).

**Collectives across torch versions.** torch 2.13 added ``ProcessGroup.all_gather_single``,
``reduce_scatter_single`` and ``all_to_all_single`` (a group's own methods, which gangs call with
options built once) and renamed ``dist.all_gather_into_tensor``/``reduce_scatter_tensor`` to
``dist.all_gather_single``/``reduce_scatter_single`` (the old names warn there). Whether this torch
has them is read once, at import (:data:`SINGLE_COLLECTIVES`); where it does not (torch 2.11, 2.12),
gangs call the public functions :func:`all_gather_tensor`, :func:`reduce_scatter_tensor` and
``dist.all_to_all_single``, which every torch since 2.0 has.

**What else is here.** The standalone groups of :mod:`gang.ft` (:func:`new_standalone_group`), the
entry of its Python process group in torch's group registry (:func:`register_python_group`), DDP's
gradient buckets (:func:`fix_ddp_buckets`), FSDP2's gradient views
(:func:`fsdp_grads_view_reduce_output`) and the end of a backward pass (:func:`backward_pass_id`,
:func:`at_end_of_backward`) for :func:`gang.ft.replica_process_group.replicate_fsdp`, the class of the
meshes torch builds (:func:`as_mesh_subclass`, for :class:`gang_mesh.GangDeviceMesh`), the ``fake`` backend
of dry runs (:func:`init_fake_process_group`), a store served on one interface only
(:func:`serve_store`), and torch's store classes (``TCPStore``, ``PrefixStore``, ``Store``), the
collective options and DDP's ``GradBucket``, re-exported from the ``torch._C`` module where torch's
stubs declare them (they are the public ``torch.distributed`` classes; import them from here).

**If torch changes its private API**, each use falls back as follows:

* torch's internal group constructor (``_new_process_group_helper``) and registry (``_world``, which
  alone holds the default group's store): the public ``new_group(use_local_synchronization=True)``,
  with a warning, since it can deadlock (:func:`new_named_group`); a group of one on the default
  backend, or the public ``new_group`` on the ``fake`` one (:func:`alone_group`);
* a backend's ``supports_splitting``, a group's ``_device_types`` and ``options._timeout``: "cannot
  split", "timeout unknown";
* the registry entry of a Python group: none (a failed collective on it is then reported by torch
  as "not initialized");
* ``torch._C._current_graph_task_id`` and autograd's ``queue_callback``: ``replicate_fsdp``
  averages each module's gradients at once instead of once per backward pass;
* FSDP2's parameter group: the same (it cannot tell that gradients are views);

and these have **no fallback**, what fails is named:

* torch's private testing module ``torch.testing._internal.distributed.fake_pg`` (the ``fake``
  backend and its ``FakeStore``): :func:`gang.testing.dry_run` raises
  :class:`~gang.NotSupportedError` (a size-1 mesh dimension falls back as above);
* DDP's reducer (``_push_all_rebuilt_params``, ``_rebuild_buckets``): ``replicate_ddp`` raises
  :class:`~gang.NotSupportedError` naming the torch version, since replicas would otherwise hold
  different bucket layouts;
* a ``DeviceMesh``'s ``__class__`` assigned a subclass (:func:`as_mesh_subclass`; torch builds the
  meshes of ``init_device_mesh`` and of slicing itself): ``to_device_mesh`` raises
  :class:`~gang.NotSupportedError` where torch's ``DeviceMesh`` no longer allows it;
* NCCL's ``Options._timeout``: creating a :mod:`gang.ft` replica group on CUDA raises
  ``AttributeError`` (CPU, gloo, takes the timeout as an argument);
* the ``torch._C._distributed_c10d`` module the re-exported classes are imported from: importing
  :mod:`gang` fails.

The tests run each private use on the installed torch and check that it is taken, not its fallback
(``test_private_torch_api_is_used_not_its_fallback``).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (  # the options a process group's own methods take
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GradBucket,
    PrefixStore,
    ReduceScatterOptions,
    Store,
    TCPStore,
)
from torch.distributed import ProcessGroup

from gang.errors import NotSupportedError

__all__ = [
    "SINGLE_COLLECTIVES",
    "AllToAllOptions",
    "AllgatherOptions",
    "AllreduceOptions",
    "BarrierOptions",
    "BroadcastOptions",
    "GradBucket",
    "PrefixStore",
    "ReduceScatterOptions",
    "StandaloneGroup",
    "Store",
    "all_gather_tensor",
    "alone_group",
    "TCPStore",
    "as_mesh_subclass",
    "at_end_of_backward",
    "backward_pass_id",
    "can_split",
    "default_timeout",
    "fix_ddp_buckets",
    "fsdp_grads_view_reduce_output",
    "group_timeout",
    "init_fake_process_group",
    "is_fake_backend",
    "is_non_member",
    "is_registered",
    "new_named_group",
    "new_standalone_group",
    "reduce_scatter_tensor",
    "register_python_group",
    "serve_store",
    "unregister_python_group",
]

StandaloneGroup = Any
"""A torch ``Backend`` (``ProcessGroupGloo``/``ProcessGroupNCCL``): torch's stubs omit its collectives."""

SINGLE_COLLECTIVES: bool = all(
    hasattr(ProcessGroup, name) for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single")
)
"""Whether a ``ProcessGroup`` has its own ``all_gather_single``, ``reduce_scatter_single`` and
``all_to_all_single`` (torch 2.13 and later), which gangs call directly; read once, at import."""

all_gather_tensor: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``dist.all_gather_single`` (torch 2.13 and later), else ``dist.all_gather_into_tensor`` (the same
call under its earlier name): ``(output, input, group=None, async_op=False)``."""

reduce_scatter_tensor: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``dist.reduce_scatter_single`` (torch 2.13 and later), else ``dist.reduce_scatter_tensor`` (the same
call under its earlier name): ``(output, input, op=SUM, group=None, async_op=False)``."""


_warned_fallback = False


def new_named_group(global_ranks: list[int], name: str, timeout: timedelta | None) -> ProcessGroup | None:
    """Create a torch process group of ``global_ranks`` called ``name``; only its members call this.

    Every member must pass the same ``name``, and a name must not be used twice while the default
    group lives: derive it from something all members share (the parent gang and its split
    counter, a mesh and its call counter), never from per-process state such as the number of
    groups alive. This is what gangs use instead of ``new_group(use_local_synchronization=True)``.

    :param global_ranks: The members, as global ranks, in group rank order.
    :param name: The group's name (its rendezvous keys live under it).
    :param timeout: The collective timeout (``None``: the backend's default).
    :returns: The group, or ``None`` if this process is not a member.
    """
    me = dist.get_rank()
    if me not in global_ranks:
        return None
    helper: Any = getattr(c10d, "_new_process_group_helper", None)
    world: Any = getattr(c10d, "_world", None)
    default_pg = dist.group.WORLD
    try:
        backend, store = world.pg_map[default_pg]  # the default group's store, which only torch's registry holds
    except (AttributeError, KeyError, TypeError, ValueError):  # a renamed or changed private API
        helper = None
    if helper is None or default_pg is None:
        return _public_fallback(global_ranks, timeout)
    if timeout is None:
        timeout = default_timeout(backend)
    bound = default_pg.bound_device_id  # torch takes an accelerator only: a CPU binding is no binding
    try:
        pg, _ = helper(
            len(global_ranks),
            global_ranks.index(me),
            global_ranks,
            dist.Backend(backend),
            store,
            name,
            timeout=timeout,
            device_id=bound if bound is not None and bound.type != "cpu" else None,
            group_desc=name,
        )
    except TypeError:  # The internal signature changed: use the public API.
        return _public_fallback(global_ranks, timeout)
    with suppress(AttributeError, TypeError):  # a changed registry: torch then looks the ranks up itself
        world.pg_group_ranks[pg] = {rank: index for index, rank in enumerate(global_ranks)}
    group = _as_group(pg)
    if group is not None and dist.Backend(backend) == dist.Backend.GLOO:
        settle(group)
    return group


def settle(pg: ProcessGroup) -> None:
    """Return once every member of ``pg``, a gloo group this process has just created, has created it too.

    gloo's group constructor can return on one member while another is still inside it; destroying
    the group at once (a gang closed right after it was made, with no collective between) then
    breaks the other member's constructor with "Connection closed by peer". A barrier on the new
    group holds each member until all have come out of it. Only gloo groups need it.
    """
    dist.barrier(group=pg)


def default_timeout(backend: str) -> timedelta:
    """The collective timeout torch gives a group of ``backend`` created without one (public constants:
    NCCL's own default where torch sets one, else ``torch.distributed``'s 30 minutes)."""
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if str(backend) == "nccl" and isinstance(nccl, timedelta):
        return nccl
    return constants.default_pg_timeout


def _public_fallback(global_ranks: list[int], timeout: timedelta | None) -> ProcessGroup | None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            "gang: torch's internal group constructor is missing or changed, so sub-groups are created "
            "with `new_group(use_local_synchronization=True)`, whose group names depend on how many "
            "groups each process has: processes that belong to different sets of sub-gangs can then "
            "wait for each other forever. Create sub-gangs in the same order on every process.",
            RuntimeWarning,
            stacklevel=3,
        )
    group = _as_group(dist.new_group(global_ranks, timeout=timeout, use_local_synchronization=True))
    if group is not None and dist.get_backend(group) == dist.Backend.GLOO:
        settle(group)
    return group


def _as_group(pg: object) -> ProcessGroup | None:
    if pg is None or isinstance(pg, ProcessGroup):
        return pg
    raise TypeError(f"torch returned {pg!r} instead of a process group")


def can_split(pg: ProcessGroup, device: torch.device) -> bool:
    """Whether ``dist.split_group`` can split ``pg`` safely: the default group is bound to a device, the
    backend of ``pg`` on ``device`` supports splitting (NCCL; gloo in recent torch), and that backend
    serves no other device type of ``pg``. ``False`` when torch cannot tell.

    A backend that serves several device types (a group created with ``backend="gloo"`` maps both
    ``cpu`` and ``cuda`` to one ``ProcessGroupGloo``) is split once per device type by torch 2.13's
    ``ProcessGroup::splitGroup``, every copy rendezvousing under the same store prefix: the copies
    race for each other's keys and members wait forever in ``split_group`` (torch's later sources
    split such a backend once). Such a gang creates named sub-groups instead (:func:`new_named_group`).
    """
    default = dist.group.WORLD
    try:
        if default is None or default.bound_device_id is None:
            return False
        backend = pg._get_backend(device)
        if not backend.supports_splitting:
            return False
        others = [torch.device(t) for t in pg._device_types if torch.device(t).type != device.type]
        return all(pg._get_backend(other) is not backend for other in others)
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a renamed or changed private API
        return False


def group_timeout(pg: ProcessGroup, device: torch.device) -> timedelta | None:
    """The collective timeout ``pg`` was created with, or ``None`` when torch does not tell."""
    try:
        timeout = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a renamed or changed private API
        return None
    return timeout if isinstance(timeout, timedelta) else None


def init_fake_process_group(rank: int, world_size: int) -> ProcessGroup:
    """Initialise torch's default process group on its ``fake`` backend (one process, no peers).

    The ``fake`` backend and its ``FakeStore`` live in torch's private testing module
    (``torch.testing._internal.distributed.fake_pg``); collectives on it complete without moving
    or computing data. This is what :func:`gang.testing.dry_run` runs on.

    :raises NotSupportedError: If this torch has no ``fake`` backend.
    """
    store = _fake_store()
    if store is None:
        raise NotSupportedError(
            "A dry run needs torch's `fake` backend (in its private module "
            "`torch.testing._internal.distributed.fake_pg`), which this version of torch does not have."
        )
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    pg = dist.group.WORLD
    assert pg is not None
    return pg


_alone: dict[str, Any] = {}


def alone_group() -> ProcessGroup:
    """A process group of this process alone, on torch's ``fake`` backend: what a size-1 mesh dimension holds.

    A ``DeviceMesh`` wants a group for every dimension, a size-1 one too; ``init_device_mesh((1, 8))``
    creates one group per process for it (on the default backend), torchtitan puts its disabled
    axes on the ``fake`` backend. With one member every collective is the identity, which is what
    the ``fake`` backend computes for one member (it copies inputs to outputs and reduces nothing),
    so this group costs no communicator (no gloo context, no NCCL communicator) and no
    communication: only this process calls this. Where the ``fake`` backend does not copy (torch
    2.11: checked once per group with a scatter), the group of one is on the default backend. One
    group per default group, made on first use and kept (torch destroys it with the default group).

    :raises ValueError: If the default group is not initialised.
    """
    if not dist.is_initialized():
        raise ValueError("A size-1 mesh dimension needs torch's default process group, but it is not initialised.")
    default = dist.group.WORLD
    world: Any = getattr(c10d, "_world", None)
    cached = _alone.get("group")
    if cached is not None and _alone.get("default") is default and _registered(world, cached):
        group: ProcessGroup = cached
        return group
    me = dist.get_rank()
    _alone["count"] = count = _alone.get("count", 0) + 1
    name = f"gang_alone/{me}/{count}"  # only this process ever uses it
    helper: Any = getattr(c10d, "_new_process_group_helper", None)
    pg: object = None
    fake_store = _fake_store()
    if fake_store is None:  # no `fake` backend: a group of one on the default backend (a communicator)
        pg = dist.new_group([me], use_local_synchronization=True)
    elif helper is not None and world is not None:
        with suppress(AttributeError, TypeError):  # a changed private API: use the public one below
            pg, _ = helper(
                1, 0, [me], dist.Backend("fake"), fake_store, name, timeout=default_timeout("fake"), group_desc=name
            )
            world.pg_group_ranks[pg] = {me: 0}
    if pg is None:
        pg = dist.new_group([me], backend="fake", use_local_synchronization=True)
    if fake_store is not None and not _copies(pg, me):  # an older `fake` backend: a group of one on the default one
        with suppress(RuntimeError, ValueError):
            dist.destroy_process_group(pg)  # type: ignore[arg-type]
        pg = dist.new_group([me], use_local_synchronization=True)
    group = _as_group(pg)  # type: ignore[assignment]
    if group is None:  # Cannot happen: this process is the member.
        raise AssertionError(f"rank {me} is not in its own group")
    _alone.update(group=group, default=default)
    return group


def _copies(pg: Any, me: int) -> bool:
    """Whether the ``fake`` group ``pg`` of this process alone copies inputs to outputs, as a group of one
    computes: torch 2.13's does for every collective, 2.11's leaves the output of a scatter, a
    reduce-scatter and an all-to-all untouched (a sharded ``DTensor`` then holds garbage)."""
    sent, received = torch.ones(1), torch.zeros(1)
    try:
        dist.scatter(received, [sent], src=me, group=pg)
    except (RuntimeError, ValueError):
        return False
    return bool(received.item() == 1.0)


def _registered(world: Any, pg: object) -> bool:
    """Whether torch's registry still holds ``pg`` (``True`` where the registry changed: ``pg`` is kept)."""
    try:
        return pg in world.pg_map
    except (AttributeError, TypeError):  # a renamed or changed private API
        return True


def is_registered(pg: ProcessGroup) -> bool:
    """Whether torch's registry still holds ``pg``: not after it or the default group was destroyed.

    ``True`` where torch's registry changed (``pg`` is then kept).
    """
    return _registered(getattr(c10d, "_world", None), pg)


def _fake_store() -> Any:
    """A store of torch's ``fake`` backend (importing it registers the backend), or ``None`` where torch's
    private testing module no longer has it."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    return FakeStore()


def is_fake_backend(pg: ProcessGroup) -> bool:
    """Whether ``pg`` runs on torch's ``fake`` backend (collectives that compute nothing)."""
    try:
        return str(dist.get_backend(pg)) == "fake"
    except (RuntimeError, ValueError):  # a group torch does not know (e.g. already destroyed)
        return False


def is_non_member(pg: object) -> bool:
    """Whether ``pg`` is what torch's ``new_group`` returns to a process outside the group."""
    return type(pg) is int and pg == dist.GroupMember.NON_GROUP_MEMBER


def new_standalone_group(
    store: Store, rank: int, size: int, device: torch.device, timeout: timedelta, address: str | None = None
) -> StandaloneGroup:
    """Create a gloo (CPU) or NCCL (CUDA) group on ``store`` outside torch's group registry.

    :mod:`gang.ft` rebuilds its cross-replica group whenever the quorum changes, next to whatever
    default group the replica's own processes use, so the group must not touch torch's global
    state. ``ProcessGroupGloo``/``ProcessGroupNCCL`` are torch ``Backend`` objects (the type lives
    in a private module); the collective timeout is ``timeout`` for both. NCCL communicators are
    non-blocking (``config.blocking = 0``), so that the group's ``abort()`` ends a stuck collective.

    :param store: The store the members rendezvous on (a fresh prefix for every new group).
    :param rank: This process's rank in the group.
    :param size: The number of members.
    :param device: ``cpu`` for gloo, ``cuda:N`` for NCCL.
    :param timeout: The collective timeout.
    :param address: For gloo, the address of this host to bind (the one the other members reach);
        ``None``: torch's choice (``GLOO_SOCKET_IFNAME``, else the address of this host's name).
    """
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A non-blocking communicator (NCCL >= 2.14): `abort()` can then interrupt a collective
        # that is stuck on the device instead of leaving it to torch's watchdog.
        options.config.blocking = 0
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if address is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from torch's stubs
    gloo_options._timeout = timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, gloo_options)


def register_python_group(pg: ProcessGroup, backend: str) -> None:
    """Enter ``pg``, a process group written in Python, in torch's registry of groups.

    ``torch.distributed``'s functions look a ``group=`` up in that registry when the default
    group is initialized: to log a failed collective (without an entry, the failure is replaced
    by a ``ValueError`` that the group is not initialized), for ``get_backend`` and for
    ``get_rank(group)``. The entry maps this process's global rank to ``pg.rank()`` read at each
    look-up, so it follows a group whose rank changes. Does nothing if torch's registry changed.

    :param pg: The group.
    :param backend: The name ``get_backend(pg)`` returns.
    """
    world: Any = getattr(c10d, "_world", None)
    try:
        world.pg_map[pg] = (backend, None)
        world.pg_group_ranks[pg] = _OwnRank(pg)
    except (AttributeError, TypeError):  # a renamed or changed private API
        pass


def unregister_python_group(pg: ProcessGroup) -> None:
    """Remove what :func:`register_python_group` entered for ``pg``."""
    world: Any = getattr(c10d, "_world", None)
    for table in ("pg_map", "pg_group_ranks"):
        with suppress(AttributeError, TypeError):  # a renamed or changed private API
            getattr(world, table).pop(pg, None)


class _OwnRank(dict[int, int]):
    """The global-to-group rank map of a Python group: only this process, at its current rank."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__()
        self._pg = pg

    def __contains__(self, global_rank: object) -> bool:
        return dist.is_initialized() and global_rank == dist.get_rank()

    def __getitem__(self, global_rank: int) -> int:
        if global_rank not in self:
            raise KeyError(global_rank)
        return self._pg.rank()


def fix_ddp_buckets(ddp_model: Any) -> bool:
    """Assign the gradient buckets of ``ddp_model`` now, in parameter order, for good.

    DDP's reducer reassigns its buckets once, at the second forward pass, in the order the
    gradients became ready in the first backward pass, and broadcasts the new assignment from
    rank 0. Replicas that start at different times would then hold different bucket layouts, and
    a replica restarted later would broadcast it in a step where no one else does. Rebuilding
    the buckets at once from the parameters in order (the reducer's ``_push_all_rebuilt_params``
    and ``_rebuild_buckets``) gives every process the same layout and leaves nothing to
    rebuild. The reducer broadcasts the assignment through the model's group while doing so.

    :returns: ``False`` if the reducer declined: it rebuilds its buckets only once (it already did,
        at a second forward pass or an earlier call), and never with ``find_unused_parameters=True``
        unless ``static_graph=True``.
    :raises RuntimeError: The reducer's own refusal in its current state (a forward pass whose
        backward pass has not run yet, say).
    :raises NotSupportedError: This torch's reducer lacks these private calls or changed them.
    """
    try:
        reducer = ddp_model.reducer
        reducer._push_all_rebuilt_params()
        return bool(reducer._rebuild_buckets())
    except (AttributeError, TypeError) as error:  # a renamed or changed private API
        raise NotSupportedError(
            f"The gradient buckets of a `DistributedDataParallel` cannot be fixed on torch {torch.__version__}: "
            f"its reducer's private `_push_all_rebuilt_params` and `_rebuild_buckets` are missing or changed "
            f"({type(error).__name__}: {error})."
        ) from error


_Mesh = TypeVar("_Mesh")


def as_mesh_subclass(mesh: Any, cls: type[_Mesh]) -> _Mesh:
    """Make ``mesh``, a ``DeviceMesh`` that torch built, an instance of ``cls`` in place and return it.

    torch builds the meshes of ``init_device_mesh`` and of slicing (``DeviceMesh.__getitem__``)
    itself, with no way to ask for a subclass, so ``cls`` (a subclass of ``DeviceMesh`` that adds
    no instance state: :class:`gang_mesh.GangDeviceMesh`) is applied by assigning the object's
    ``__class__``. That relies on torch's ``DeviceMesh`` keeping an ordinary instance layout (no
    ``__slots__``, no C++ base class) and on torch never testing ``type(mesh) is DeviceMesh``.

    :raises NotSupportedError: If this torch's mesh refuses the new class.
    """
    if not isinstance(mesh, cls):
        try:
            mesh.__class__ = cls
        except TypeError as error:
            raise NotSupportedError(
                f"A `{type(mesh).__name__}` cannot be made a `{cls.__name__}` on torch {torch.__version__}: {error}."
            ) from error
    return mesh  # type: ignore[no-any-return]


def fsdp_grads_view_reduce_output(module: Any, reduce_output: torch.Tensor) -> bool:
    """Whether FSDP2 will make ``module``'s sharded gradients plain views of ``reduce_output``.

    ``reduce_output`` is what FSDP2 passes to ``module``'s all-reduce hook. After the hook, FSDP2
    views the gradient shards out of it unchanged when it casts nothing (the gradients have the
    reduce dtype), divides nothing afterwards (float32 or bfloat16 without forced sum
    reductions), offloads nothing and accumulates into no existing gradient. Then whatever is
    written into ``reduce_output`` before the optimizer reads the gradients is the gradient.
    Reads FSDP2's parameter group (private); ``False`` if it cannot tell.
    """
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or getattr(group, "force_sum_reduction_for_comms", False):
            return False
        params = list(group.fsdp_params)
        return (
            reduce_output.dtype in (torch.float32, torch.bfloat16)
            and reduce_output.device.type in ("cpu", "cuda")
            and bool(params)
            and all(
                not p.offload_to_cpu and p.sharded_param.grad is None and p.sharded_param.dtype == reduce_output.dtype
                for p in params
            )
        )
    except (AttributeError, RuntimeError, TypeError):  # a renamed or changed private API
        return False


def backward_pass_id() -> int:
    """The id of the backward pass running on this thread (``-1`` outside one, and where torch no
    longer tells: :func:`gang.ft.replica_process_group.replicate_fsdp` then averages at once, once per module)."""
    current: Any = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:  # a renamed private API
        return -1
    return int(current())


def at_end_of_backward(callback: Any) -> bool:
    """Run ``callback()`` when the backward pass running on this thread ends (after FSDP2's own end-of-backward work).

    :returns: ``False`` (and nothing is queued) outside a backward pass.
    """
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    except AttributeError:  # a renamed private API: the caller does the work at once instead
        return False
    return True


_WILDCARDS = ("", "0.0.0.0", "::")


def serve_store(
    host: str, port: int = 0, *, world_size: int | None = None, timeout: timedelta = timedelta(seconds=300)
) -> TCPStore:
    """Serve a ``TCPStore`` that listens on ``host`` only (``port`` 0: a free port).

    torch's store server listens on every interface whatever host it is given; here the listening
    socket is bound to ``host`` first and handed to the store (``master_listen_fd``), so a store on
    ``127.0.0.1`` cannot be reached from outside this machine. A wildcard ``host`` (``0.0.0.0``,
    ``::`` or empty) leaves the choice of interfaces to torch (every one).
    """
    if host in _WILDCARDS:
        return TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    bound = int(listener.getsockname()[1])
    fd = listener.detach()  # the store owns the socket from here on
    try:
        return TCPStore(
            host, bound, world_size, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise
