"""The one table of parallelism roles: what each gang of :class:`~gang.Gangs` spans.

Everything that knows about roles derives from :data:`ROLE_TABLE`: the invariants of
:class:`~gang.Gangs` (:data:`SIZE_RULES`) and its omitted roles, :meth:`~gang.Gangs.flatten`'s
axes, the grid that :mod:`gang.topology` lays ranks out on, the factories, both mesh bridges'
dimension names (and the names other libraries give them, through :data:`ALIASES`) and the
glossary in the documentation. Adding a dense role is a row here plus its field on
:class:`~gang.Gangs` (checked against the table when :mod:`gang.gangs` is imported) and its tests.

The **grid** orders the ranks of the root gang. :data:`VIEWS` are named factorisations of that one
grid (as Megatron-Core's ``HyperCommGrid`` views), each a row-major grid of axes, slowest first:
the *dense* view :data:`GRID_AXES` (pipeline, replicated data, sharded data, context, tensor
parallel: torchtitan's and Megatron's order) and the *expert* view :data:`EXPERT_GRID`, which
re-factors the ``rdp x sdp x cp x tp`` ranks of one pipeline stage as ``edp x ep x etp``
(``etp`` fastest, then ``ep``: contiguous blocks). Views share the axes they both name (``pp``),
which must agree (:class:`gang.topology.Layout` checks it). A *dense* role is a product of
dense axes (``dp`` is ``rdp`` times ``sdp``); an *expert* role is one expert axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

__all__ = [
    "ALIASES",
    "AXIS_ROLES",
    "DENSE_ROLES",
    "EXPERT_AXES",
    "EXPERT_GRID",
    "EXPERT_ROLES",
    "EXPERT_MESH_AXES",
    "EXPERT_SPLITS",
    "GRID_AXES",
    "ROLES",
    "ROLE_TABLE",
    "SIZE_ONE",
    "SIZE_RULES",
    "VIEWS",
    "Alias",
    "Role",
    "View",
    "alias",
    "covering",
    "role",
]

RoleKind = Literal["root", "dense", "expert"]


@dataclass(frozen=True)
class Role:
    """One row of :data:`ROLE_TABLE`.

    :param name: The field of :class:`~gang.Gangs` (and the mesh dimension name).
    :param title: The role's name in words.
    :param spans: What the role's gangs span, for the documentation.
    :param kind: ``"root"`` (every rank), ``"dense"`` (a product of grid axes) or ``"expert"``.
    :param axes: The axes of one view whose product the role's gangs are (slowest first); for an
        expert role, the single axis of the expert view it is.
    :param omitted: What :class:`~gang.Gangs` holds when the role is not given: ``None`` (it must
        be given), :data:`SIZE_ONE` (a size-1 gang) or the name of the role whose gang it shares.
        For the axis of an expert role set by the factories (``ep``, ``etp``) it is also the
        size the axis has when not given (1, or that role's size).
    """

    name: str
    title: str
    spans: str
    kind: RoleKind
    axes: tuple[str, ...]
    omitted: str | None = None


@dataclass(frozen=True)
class Alias:
    """A name another library gives a role (a mesh dimension name, a group's name).

    :param name: The other library's name.
    :param role: The role it stands for.
    :param library: Who uses the name.
    :param folds: The role folded into the name, if any (torchtitan's flattened ``dp_shard_cp``
        is ``sdp`` with ``cp`` folded in, as FSDP sees it).
    """

    name: str
    role: str
    library: str
    folds: str | None = None


@dataclass(frozen=True)
class View:
    """One of :data:`VIEWS`: a named factorisation of the ranks of the root gang into axes.

    :param name: The view's name.
    :param axes: Its axes, slowest first (row-major: the last varies fastest).
    :param derived: The axis whose size follows from the others (the view spans every rank), or
        ``None`` when every size is given.
    """

    name: str
    axes: tuple[str, ...]
    derived: str | None = None


VIEWS: tuple[View, ...] = (
    View("dense", ("pp", "rdp", "sdp", "cp", "tp")),
    View("expert", ("pp", "edp", "ep", "etp"), derived="edp"),
)
"""The named factorisations of the one grid of ranks: the dense view first, then the experts'
(``edp x ep x etp`` in place of ``rdp x sdp x cp x tp``). Axes named by several views are shared
and must agree."""

GRID_AXES: tuple[str, ...] = VIEWS[0].axes
"""The axes of the dense view, slowest first: ``rank = ((((pp * rdp) + r) * sdp + s) * cp + c) * tp + t``."""

EXPERT_GRID: tuple[str, ...] = VIEWS[1].axes
"""The axes of the expert view, slowest first (``pp, edp, ep, etp``)."""

EXPERT_AXES: tuple[str, ...] = tuple(axis for axis in EXPERT_GRID if axis not in GRID_AXES)
"""The axes of the expert view that the dense view does not share (``edp, ep, etp``), slowest first."""

EXPERT_SPLITS: tuple[str, ...] = tuple(axis for axis in GRID_AXES if axis not in EXPERT_GRID)
"""The dense axes whose ranks the expert axes re-factor (``rdp, sdp, cp, tp``: one pipeline stage)."""

EXPERT_MESH_AXES: dict[str, tuple[str, ...]] = {
    "pp": ("pp",),
    "rdp": ("rdp",),
    "sdp": ("edp", "ep"),
    "cp": (),
    "tp": ("etp",),
}
"""How a mesh with expert dimensions (torchtitan's sparse mesh ``pp, dp_replicate, efsdp, ep``)
reads each dense axis: as the product of these axes. ``sdp`` is ``edp x ep`` (torchtitan's
``efsdp x ep``), context parallel is folded away (size 1) and tensor parallel is the experts'
(a mesh cannot tell them apart, and omitted ``etp`` is ``tp``); ``rdp`` stays outside, so
``edp`` spans it too."""

SIZE_ONE = "size 1"
"""The :attr:`Role.omitted` of a role that is a size-1 gang when not given."""

ROLE_TABLE: tuple[Role, ...] = (
    Role("root", "root", "every process", "root", GRID_AXES),
    Role("dp", "data parallel", "the processes that see different batches (rdp x sdp)", "dense", ("rdp", "sdp")),
    Role(
        "rdp",
        "replicated data parallel",
        "the processes that hold the same shard of the model (inter-node for HSDP; what DDP uses)",
        "dense",
        ("rdp",),
    ),
    Role(
        "sdp",
        "sharded data parallel",
        "the processes that share the model's shards (intra-node for HSDP; what FSDP uses)",
        "dense",
        ("sdp",),
    ),
    Role("cp", "context parallel", "the processes that split one sequence between them", "dense", ("cp",), SIZE_ONE),
    Role("tp", "tensor parallel", "the processes that split each layer's weights between them", "dense", ("tp",)),
    Role("pp", "pipeline parallel", "the processes that hold different stages of the model", "dense", ("pp",)),
    Role(
        "ep",
        "expert parallel",
        "the processes that hold different experts of a mixture-of-experts layer",
        "expert",
        ("ep",),
        SIZE_ONE,
    ),
    Role(
        "edp",
        "expert data parallel",
        "the processes that hold the same experts (the data parallel gang of the experts' weights)",
        "expert",
        ("edp",),
        "dp",
    ),
    Role(
        "etp",
        "expert tensor parallel",
        "the processes that split one expert's weights between them (tp when not set)",
        "expert",
        ("etp",),
        "tp",
    ),
)
"""Every role, in the order of the fields of :class:`~gang.Gangs`."""

ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE)
"""The fields of :class:`~gang.Gangs`, in order."""

DENSE_ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE if r.kind == "dense")
"""The roles that are products of dense axes (what :meth:`gang.Gangs.flatten` combines)."""

EXPERT_ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE if r.kind == "expert")
"""The roles of the experts of mixture-of-experts layers."""

AXIS_ROLES: dict[str, str] = {r.axes[0]: r.name for r in ROLE_TABLE if r.kind != "root" and len(r.axes) == 1}
"""The role that is each axis alone, for every axis of :data:`VIEWS` (a process's rank along an
axis is its rank in that role's gang)."""


def covering(axes: Sequence[str], exclude: str = "") -> tuple[str, ...]:
    """The dense roles but ``exclude``, in table order, whose gangs multiply to the product of the
    dense ``axes``: each taken when its axes are all among those not yet taken (``rdp, sdp, cp``
    gives ``dp, cp``)."""
    left, cover = list(axes), []
    for r in ROLE_TABLE:
        if r.kind == "dense" and r.name != exclude and set(r.axes) <= set(left):
            cover.append(r.name)
            left = [axis for axis in left if axis not in r.axes]
    assert not left, (axes, left)
    return tuple(cover)


SIZE_RULES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    *((covering(r.axes, r.name), (r.name,)) for r in ROLE_TABLE if r.kind != "expert" and len(r.axes) > 1),
    (EXPERT_ROLES, covering(EXPERT_SPLITS, "")),
)
"""The sizes that :class:`~gang.Gangs` checks, ``(left, right)``: the product of the sizes of the
``left`` roles equals that of the ``right`` ones (``dp * cp * tp * pp = root``, ``rdp * sdp = dp``,
``ep * edp * etp = dp * cp * tp``)."""

ALIASES: tuple[Alias, ...] = (
    Alias("dp_replicate", "rdp", "torchtitan"),
    Alias("dp_shard", "sdp", "torchtitan"),
    Alias("efsdp", "edp", "torchtitan"),
    Alias("batch", "dp", "torchtitan"),
    Alias("fsdp", "sdp", "torchtitan", folds="cp"),
    Alias("dp_shard_cp", "sdp", "torchtitan", folds="cp"),
    Alias("loss", "dp", "torchtitan", folds="cp"),
    Alias("loss_mesh", "dp", "torchtitan", folds="cp"),
    Alias("dp_cp", "dp", "torchtitan and Megatron-Core", folds="cp"),
    Alias("data_parallel", "dp", "Megatron-Core"),
    Alias("tensor_model_parallel", "tp", "Megatron-Core"),
    Alias("pipeline_model_parallel", "pp", "Megatron-Core"),
    Alias("context_parallel", "cp", "Megatron-Core"),
    Alias("expert_model_parallel", "ep", "Megatron-Core"),
    Alias("expert_data_parallel", "edp", "Megatron-Core"),
    Alias("expert_tensor_parallel", "etp", "Megatron-Core"),
)
"""The names other libraries give the roles (mesh dimension names, group names)."""


def role(name: str) -> Role:
    """Return the row of :data:`ROLE_TABLE` called ``name``.

    :raises ValueError: If ``name`` is not a role.
    """
    return _ROLE_ROWS[name] if name in _ROLE_ROWS else _not_found("a role", tuple(_ROLE_ROWS), name)


def alias(name: str) -> Alias:
    """Return the entry of :data:`ALIASES` called ``name``.

    :raises ValueError: If ``name`` is not an alias.
    """
    return _ALIAS_ROWS[name] if name in _ALIAS_ROWS else _not_found("an alias", tuple(_ALIAS_ROWS), name)


_ROLE_ROWS = {row.name: row for row in ROLE_TABLE}
_ALIAS_ROWS = {row.name: row for row in ALIASES}


def _not_found(what: str, names: tuple[str, ...], name: str) -> NoReturn:
    raise ValueError(f"`name` must be {what} of {names}, but is {name!r} instead.")


def _check_table() -> None:
    names = [r.name for r in ROLE_TABLE]
    assert len(set(names)) == len(names), names
    for v in VIEWS:
        assert len(set(v.axes)) == len(v.axes) and v.derived in (None, *v.axes), v
    for r in ROLE_TABLE:
        allowed = EXPERT_AXES if r.kind == "expert" else GRID_AXES
        assert set(r.axes) <= set(allowed), r
        assert r.omitted in (None, SIZE_ONE, *names), r
    for a in ALIASES:
        assert a.role in names and a.name not in names and a.folds in (None, *names), a
    assert set(AXIS_ROLES) == {axis for v in VIEWS for axis in v.axes}, AXIS_ROLES
    # The expert view replaces one block of consecutive dense axes, and a mesh reads that block anew.
    start = GRID_AXES.index(EXPERT_SPLITS[0])
    assert GRID_AXES[start : start + len(EXPERT_SPLITS)] == EXPERT_SPLITS, EXPERT_SPLITS
    assert tuple(EXPERT_MESH_AXES) == GRID_AXES, EXPERT_MESH_AXES
    read = [axis for axes in EXPERT_MESH_AXES.values() for axis in axes if axis not in GRID_AXES]
    assert sorted(read) == sorted(EXPERT_AXES), EXPERT_MESH_AXES


_check_table()
