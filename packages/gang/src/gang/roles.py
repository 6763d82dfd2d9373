"""The one table of parallelism roles: what each gang of :class:`~gang.Gangs` spans.

Everything that knows about roles derives from :data:`ROLE_TABLE`: the invariants of
:class:`~gang.Gangs` (:data:`SIZE_RULES`) and its omitted roles, :meth:`~gang.Gangs.flatten`'s
axes, the grid that :mod:`gang.topology` lays ranks out on, the factories, both mesh bridges'
dimension names (and the names other libraries give them, through :data:`ALIASES`) and the
glossary in the documentation. Adding a dense role is a row here plus its field on
:class:`~gang.Gangs` (checked against the table when :mod:`gang.gangs` is imported) and its tests.

The **grid** orders the ranks of the root gang: :data:`GRID_AXES` lists its axes, slowest first
(pipeline, replicated data, sharded data, context, tensor parallel: torchtitan's and Megatron's
order). A *dense* role is a product of grid axes (``dp`` is ``rdp`` times ``sdp``); an *expert*
role re-factors the ``rdp x sdp x cp`` ranks of one (pp, tp) position into ``edp x ep``, with
``ep`` fastest (contiguous blocks of ``ep`` ranks in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ALIASES",
    "AXIS_ROLES",
    "DENSE_ROLES",
    "EXPERT_AXES",
    "EXPERT_GRID",
    "EXPERT_ROLES",
    "EXPERT_SPLITS",
    "GRID_AXES",
    "ROLES",
    "ROLE_TABLE",
    "SIZE_ONE",
    "SIZE_RULES",
    "Alias",
    "Role",
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
    :param axes: The grid axes whose product the role's gangs are (slowest first); for an expert
        role, the single axis of the ``edp x ep`` factorisation it is.
    :param omitted: What :class:`~gang.Gangs` holds when the role is not given: ``None`` (it must
        be given), :data:`SIZE_ONE` (a size-1 gang) or the name of the role whose gang it shares.
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
    :param folds_cp: Whether the name stands for the role with context parallel folded into it
        (torchtitan's flattened ``dp_shard_cp`` is ``sdp`` times ``cp``, as FSDP sees it).
    """

    name: str
    role: str
    library: str
    folds_cp: bool = False


GRID_AXES: tuple[str, ...] = ("pp", "rdp", "sdp", "cp", "tp")
"""The axes of the grid of ranks, slowest first: ``rank = ((((pp * rdp) + r) * sdp + s) * cp + c) * tp + t``."""

EXPERT_AXES: tuple[str, ...] = ("edp", "ep")
"""How the expert roles re-factor the ``rdp x sdp x cp`` ranks of one (pp, tp) position, slowest first."""

EXPERT_SPLITS: tuple[str, ...] = ("rdp", "sdp", "cp")
"""The grid axes (consecutive in :data:`GRID_AXES`) whose ranks the expert axes re-factor."""

EXPERT_GRID: tuple[str, ...] = (
    GRID_AXES[: GRID_AXES.index(EXPERT_SPLITS[0])] + EXPERT_AXES + GRID_AXES[GRID_AXES.index(EXPERT_SPLITS[-1]) + 1 :]
)
"""The axes of the expert factorisation of the grid, slowest first: :data:`GRID_AXES` with
:data:`EXPERT_AXES` in place of :data:`EXPERT_SPLITS` (``pp, edp, ep, tp``)."""

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
)
"""Every role, in the order of the fields of :class:`~gang.Gangs`."""

ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE)
"""The fields of :class:`~gang.Gangs`, in order."""

DENSE_ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE if r.kind == "dense")
"""The roles that are products of grid axes (what :meth:`gang.Gangs.flatten` combines)."""

EXPERT_ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE if r.kind == "expert")
"""The roles of the experts of mixture-of-experts layers."""

AXIS_ROLES: dict[str, str] = {r.axes[0]: r.name for r in ROLE_TABLE if r.kind != "root" and len(r.axes) == 1}
"""The role that is each axis alone, for every axis of :data:`GRID_AXES` and :data:`EXPERT_AXES`
(a process's rank along an axis is its rank in that role's gang)."""


def _cover(axes: tuple[str, ...], exclude: str) -> tuple[str, ...]:
    """The dense roles but ``exclude``, in table order, whose gangs multiply to the product of ``axes``:
    each taken when its axes are all among those not yet taken."""
    left, cover = list(axes), []
    for r in ROLE_TABLE:
        if r.kind == "dense" and r.name != exclude and set(r.axes) <= set(left):
            cover.append(r.name)
            left = [axis for axis in left if axis not in r.axes]
    assert not left, (axes, left)
    return tuple(cover)


SIZE_RULES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    *((_cover(r.axes, r.name), (r.name,)) for r in ROLE_TABLE if r.kind != "expert" and len(r.axes) > 1),
    (EXPERT_ROLES, _cover(EXPERT_SPLITS, "")),
)
"""The sizes that :class:`~gang.Gangs` checks, ``(left, right)``: the product of the sizes of the
``left`` roles equals that of the ``right`` ones (``dp * cp * tp * pp = root``, ``rdp * sdp = dp``,
``ep * edp = dp * cp``)."""

ALIASES: tuple[Alias, ...] = (
    Alias("dp_replicate", "rdp", "torchtitan"),
    Alias("dp_shard", "sdp", "torchtitan"),
    Alias("efsdp", "edp", "torchtitan"),
    Alias("batch", "dp", "torchtitan"),
    Alias("fsdp", "sdp", "torchtitan", folds_cp=True),
    Alias("dp_shard_cp", "sdp", "torchtitan", folds_cp=True),
    Alias("loss", "dp", "torchtitan", folds_cp=True),
    Alias("loss_mesh", "dp", "torchtitan", folds_cp=True),
    Alias("dp_cp", "dp", "torchtitan and Megatron-Core", folds_cp=True),
    Alias("data_parallel", "dp", "Megatron-Core"),
    Alias("tensor_model_parallel", "tp", "Megatron-Core"),
    Alias("pipeline_model_parallel", "pp", "Megatron-Core"),
    Alias("context_parallel", "cp", "Megatron-Core"),
    Alias("expert_model_parallel", "ep", "Megatron-Core"),
    Alias("expert_data_parallel", "edp", "Megatron-Core"),
)
"""The names other libraries give the roles (mesh dimension names, group names)."""


def role(name: str) -> Role:
    """Return the row of :data:`ROLE_TABLE` called ``name``.

    :raises ValueError: If ``name`` is not a role.
    """
    for row in ROLE_TABLE:
        if row.name == name:
            return row
    raise ValueError(f"`name` must be a role of {ROLES}, but is {name!r} instead.")


def _check_table() -> None:
    names = [r.name for r in ROLE_TABLE]
    assert len(set(names)) == len(names), names
    for r in ROLE_TABLE:
        allowed = EXPERT_AXES if r.kind == "expert" else GRID_AXES
        assert set(r.axes) <= set(allowed), r
        assert r.omitted in (None, SIZE_ONE, *names), r
    for a in ALIASES:
        assert a.role in names and a.name not in names, a
    assert set(AXIS_ROLES) == {*GRID_AXES, *EXPERT_AXES}, AXIS_ROLES
    start = GRID_AXES.index(EXPERT_SPLITS[0])
    assert GRID_AXES[start : start + len(EXPERT_SPLITS)] == EXPERT_SPLITS, EXPERT_SPLITS


_check_table()
