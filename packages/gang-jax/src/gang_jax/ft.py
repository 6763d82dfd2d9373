"""DiLoCo and LocalSGD for JAX models across fault-tolerant replicas.

The replicas meet through the same :class:`gang.ft.ReplicaGang` as torch replicas do, and the
sync is the same code as :class:`gang.ft.DiLoCo`'s (the exchange, the faults, the heal, the
``sync`` log records): only the model side differs. JAX being functional, parameters are a pytree
of ``jax.Array`` that the training loop owns; after each inner step the loop hands them over and
gets back the parameters to continue with::

    rg = ReplicaGang.join(state_dict=..., load_state_dict=...)
    with gang_jax.ft.DiLoCo(rg, params, optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=100) as diloco:
        params = diloco.params  # the replicas agreed on them on entering
        while diloco.local_step < steps:
            grads = grad_fn(params, batch())
            params, inner_state = inner_update(params, grads, inner_state)  # the user's optax step
            params = diloco.step(params)  # synced when a sync was due

:meth:`DiLoCo.step` counts one local step and, when a fragment is due, runs its sync: the
pseudo-gradient (global minus local parameters) is averaged over the quorum through the replica
gang, the outer optimizer (an ``optax`` transformation) updates the fragment's global parameters
from it, and the fragment's local parameters become ``alpha * local + (1 - alpha) * global``.
Without a sync it returns its argument as it is (nothing copied back).

How the leaves travel: the exchange runs on float tensors of the same dtype as the leaves (a
``float64`` leaf needs JAX's ``jax_enable_x64``), which :meth:`DiLoCo.step` fills from the
leaves it is given; what it returns is built from them. The outer optimizer keeps one state per
fragment (an optax transformation updates every leaf it is given, where torch's optimizers skip a
parameter without a gradient, so a fragment that is not due must not be given to it), and its
update runs under ``jax.jit``.

Healing: a replica that is behind receives, through the replica gang, the local and global
parameters, each fragment's optax state and the counters from an up-to-date member (the user's
``join(state_dict=...)`` carries what else the loop keeps, e.g. the inner optimizer's state;
:func:`tree_state` and :func:`load_tree` turn a pytree into tensors and back). A JAX replica heals
from JAX replicas only: its state has another form than a torch replica's (a heal between the two
is refused by name, see :meth:`DiLoCo.load_state_dict`).

Torch and JAX replicas can train one model in one job: the exchange is the same, so every replica
gets the same averaged pseudo-gradients, bit for bit. The global parameters then stay bit-identical
across the frameworks when both outer optimizers compute alike (plain SGD does: torch's
``p.add_(g, alpha=-lr)`` and the jitted ``optax.sgd`` both round once, as a fused multiply-add);
torch's Nesterov momentum rounds its buffer differently from ``optax``'s, which agree within a few
ulps per sync.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, final

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import Tensor, nn

from gang.ft import ReplicaGang
from gang.ft.diloco import _SemiSync

__all__ = ["DiLoCo", "LocalSGD", "load_tree", "tree_state"]


class OuterOptimizer(Protocol):
    """What :class:`DiLoCo` needs of an ``optax.GradientTransformation``: ``init`` and ``update``."""

    def init(self, params: Any) -> Any: ...

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]: ...


def tree_state(tree: Any) -> list[Tensor]:
    """The leaves of ``tree`` (arrays) as CPU tensors, in ``jax.tree.leaves`` order: a pytree in a
    form that :meth:`gang.ft.ReplicaGang.join`'s ``state_dict`` can return and a heal can carry."""
    return [_to_torch(leaf) for leaf in jax.tree.leaves(tree)]


def load_tree(template: Any, state: list[Tensor]) -> Any:
    """The pytree of ``template``'s structure whose leaves are ``state``'s tensors (what
    :func:`tree_state` returned), as ``jax.Array`` of the template leaves' dtypes.

    :raises ValueError: If ``state`` has another number of leaves than ``template``.
    """
    leaves, treedef = jax.tree.flatten(template)
    if len(leaves) != len(state):
        raise ValueError(f"`state` must have {len(leaves)} tensors, one per leaf of `template`, but has {len(state)}.")
    return jax.tree.unflatten(
        treedef,
        [
            jnp.asarray(t.detach().cpu().numpy(), dtype=jnp.asarray(leaf).dtype)
            for leaf, t in zip(leaves, state, strict=True)
        ],
    )


def _to_torch(leaf: Any) -> Tensor:
    return torch.from_numpy(np.array(leaf, copy=True))


class _Count(torch.optim.Optimizer):
    """A torch optimizer that changes nothing: its ``step()`` is the local step that runs the sync's hooks."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Count one local step (the hooks of :class:`gang.ft.diloco` do the rest)."""
        return None


class _Leaves(nn.Module):
    """The pytree's leaves as tensors, in ``jax.tree.leaves`` order: what the shared sync reads and writes."""

    def __init__(self, leaves: list[Tensor]) -> None:
        super().__init__()
        self.leaves = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in leaves])


def _check_params(params: object) -> tuple[list[Any], Any]:
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        raise ValueError(f"`params` must be a pytree with at least one array leaf, but is {params!r} instead.")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            where = jax.tree_util.keystr(path)
            raise TypeError(
                f"`params` must hold floating-point arrays, but its leaf {where or '(root)'} is {leaf!r} instead."
            )
    return leaves, treedef


class _JaxSync:
    """What the JAX :class:`DiLoCo` and :class:`LocalSGD` add to the shared sync: the leaves in and out."""

    _core: _SemiSync
    _treedef: Any
    _leaves: _Leaves
    _count: _Count
    _changed: bool

    def _setup(self, params: object) -> tuple[_Leaves, _Count]:
        leaves, self._treedef = _check_params(params)
        self._leaves = _Leaves([_to_torch(leaf) for leaf in leaves])
        self._count = _Count(list(self._leaves.leaves))
        self._changed = False
        self._dtypes = [leaf.dtype for leaf in leaves]
        return self._leaves, self._count

    @property
    def params(self) -> Any:
        """The local parameters as this object holds them (after entering: the ones the replicas agreed on)."""
        return jax.tree.unflatten(
            self._treedef,
            [jnp.asarray(p.detach().numpy(), dtype=d) for p, d in zip(self._leaves.leaves, self._dtypes, strict=True)],
        )

    def step(self, params: Any) -> Any:
        """Count one local step after the inner step that made ``params``; run a sync if one is due.

        :param params: The local parameters after the inner step (the pytree structure and leaf
            shapes given at construction).
        :returns: The parameters to continue with: ``params`` itself when nothing changed them, else
            new arrays (a sync applied, or this replica was healed).
        :raises ValueError: If ``params`` has another structure or leaf shapes.
        """
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self._treedef:
            raise ValueError(f"`params` must have the structure {self._treedef}, but has {treedef} instead.")
        with torch.no_grad():
            for i, (p, leaf) in enumerate(zip(self._leaves.leaves, leaves, strict=True)):
                if tuple(leaf.shape) != tuple(p.shape):
                    raise ValueError(
                        f"`params` leaf {i} must have the shape {tuple(p.shape)}, but has {tuple(leaf.shape)} instead."
                    )
                p.numpy()[...] = np.asarray(leaf)
        self._changed = False
        self._count.step()
        return self.params if self._changed else params


@final
class LocalSGD(_JaxSync, _SemiSync):
    """Local SGD across replicas for a JAX model: every ``sync_every`` local steps, the quorum
    averages its parameters (as :class:`gang.ft.LocalSGD` does for a torch module).

    :param rg: The replica gang.
    :param params: The starting parameters: a pytree of floating-point ``jax.Array``.
    :param sync_every: The number of local steps between syncs.
    :param quantize: ``None`` (full precision), ``"int8"`` or ``"float8"``: the exchange quantizes
        as :class:`gang.ft.LocalSGD`'s does (blocks of 128 elements, ``float32`` absmax scales).
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If ``sync_every`` is below 1, ``params`` has no leaves or ``quantize`` is unknown.
    """

    _kind = "LocalSGD"

    def __init__(self, rg: ReplicaGang, params: Any, *, sync_every: int, quantize: str | None = None) -> None:
        module, count = self._setup(params)
        _SemiSync.__init__(
            self,
            rg,
            module,
            count,
            sync_every=sync_every,
            fragments=1,
            fragment_sync_delay=0,
            fragment_update_alpha=0.0,
            quantize=quantize,
            optimizer_name="optimizer",
        )

    def __enter__(self) -> LocalSGD:
        _SemiSync.__enter__(self)
        return self

    def _contribute(self, i: int, local: Tensor, out: Tensor) -> None:
        out.copy_(local)

    def _land(self, averaged: dict[int, Tensor]) -> None:
        with torch.no_grad():
            for i, mean in averaged.items():
                self._params[i].copy_(mean)
        self._changed = True

    def _state(self) -> dict[str, Any]:
        return {**_SemiSync._state(self), "local": [p.detach() for p in self._params]}

    def _load(self, state: Mapping[str, Any]) -> None:
        _check_form(state, self._kind)
        _SemiSync._load(self, state)
        _copy_into([p.detach() for p in self._params], state["local"])
        self._changed = True


@final
class DiLoCo(_JaxSync, _SemiSync):
    """DiLoCo, and streaming DiLoCo with ``fragments > 1``, across replicas for a JAX model.

    The schedule, the exchange and the faults are :class:`gang.ft.DiLoCo`'s: after local step ``t``
    (counted from 0), fragment ``k`` (the leaves in ``jax.tree.leaves`` order cut into
    ``fragments`` contiguous groups of near-equal bytes) is prepared when ``t % sync_every ==
    ((k + 1) * sync_every) // fragments - 1``; its pseudo-gradient (global minus local) is
    averaged over the quorum, ``outer_optimizer`` turns the average into an update of the
    fragment's global parameters, and the local ones become ``alpha * local + (1 - alpha) *
    global`` (after ``fragment_sync_delay`` more local steps when that is set). A sync that was not
    committed changes nothing and is retried after the next local step.

    :param rg: The replica gang.
    :param params: The starting parameters: a pytree of floating-point ``jax.Array``.
    :param outer_optimizer: An ``optax.GradientTransformation`` (for example
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``); one state per fragment.
    :param sync_every: The number of local steps between two syncs of a fragment.
    :param fragments: The number of fragments.
    :param fragment_sync_delay: The number of local steps between a fragment's exchange and its
        application; less than ``sync_every // fragments``.
    :param fragment_update_alpha: The weight of the local values when a fragment is applied, in ``[0, 1]``.
    :param quantize: ``None`` (full precision), ``"int8"`` or ``"float8"``: the pseudo-gradients
        travel quantized as :class:`gang.ft.DiLoCo`'s do (blocks of 128 elements, ``float32`` absmax
        scales; every member gets the same bits).
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If an argument has a bad value.
    """

    _kind = "DiLoCo"

    def __init__(
        self,
        rg: ReplicaGang,
        params: Any,
        outer_optimizer: OuterOptimizer,
        *,
        sync_every: int,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        quantize: str | None = None,
    ) -> None:
        if not (
            callable(getattr(outer_optimizer, "init", None)) and callable(getattr(outer_optimizer, "update", None))
        ):
            raise TypeError(
                "`outer_optimizer` must be an `optax.GradientTransformation` (with `init` and `update`), but is "
                f"of type `{type(outer_optimizer).__name__}` instead."
            )
        module, count = self._setup(params)
        _SemiSync.__init__(
            self,
            rg,
            module,
            count,
            sync_every=sync_every,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            quantize=quantize,
            optimizer_name="inner_optimizer",
        )
        self._tx = outer_optimizer
        self._global: list[Tensor] = [p.detach().clone() for p in self._params]
        self._outer_states = [self._tx.init(self._fragment_tree(k)) for k in range(len(self._fragments))]

        def apply(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
            updates, state = self._tx.update(grads, state, params)
            return jax.tree.map(lambda p, u: p + u, params, updates), state

        self._apply = jax.jit(apply)

    def __enter__(self) -> DiLoCo:
        _SemiSync.__enter__(self)
        return self

    def _fragment_tree(self, k: int, values: Callable[[int], Tensor] | None = None) -> list[jax.Array]:
        """Fragment ``k``'s leaves (global values by default) as a list of ``jax.Array``."""
        pick = values or (lambda i: self._global[i])
        return [jnp.asarray(pick(i).numpy(), dtype=self._dtypes[i]) for i in self._fragments[k]]

    def _reset(self) -> None:
        with torch.no_grad():
            for g, p in zip(self._global, self._params, strict=True):
                g.copy_(p)

    def _contribute(self, i: int, local: Tensor, out: Tensor) -> None:
        torch.sub(self._global[i], local, out=out)

    def _land(self, averaged: dict[int, Tensor]) -> None:
        for k, indices in enumerate(self._fragments):
            if indices[0] not in averaged:
                continue
            grads = self._fragment_tree(k, lambda i: averaged[i])
            new, self._outer_states[k] = self._apply(grads, self._outer_states[k], self._fragment_tree(k))
            with torch.no_grad():
                for i, value in zip(indices, new, strict=True):
                    self._global[i].numpy()[...] = np.asarray(value)
                    local = self._params[i]
                    if self._alpha:
                        local.mul_(self._alpha).add_(self._global[i], alpha=1.0 - self._alpha)
                    else:
                        local.copy_(self._global[i])
        self._changed = True

    def _state(self) -> dict[str, Any]:
        return {
            **_SemiSync._state(self),
            "global": self._global,
            "local": [p.detach() for p in self._params],
            "outer": [tree_state(s) for s in self._outer_states],
        }

    def _load(self, state: Mapping[str, Any]) -> None:
        _check_form(state, self._kind)
        _SemiSync._load(self, state)
        _copy_into(self._global, state["global"])
        _copy_into([p.detach() for p in self._params], state["local"])
        self._outer_states = [
            load_tree(mine, theirs) for mine, theirs in zip(self._outer_states, state["outer"], strict=True)
        ]
        self._changed = True


def _check_form(state: Mapping[str, Any], kind: str) -> None:
    """Refuse a state of another form (a torch replica's ``DiLoCo``: its outer state is a torch optimizer's)."""
    if "local" not in state or ("outer" in state and not isinstance(state["outer"], list)):
        raise ValueError(
            f"`state_dict` must be a `gang_jax.ft.{kind}` state, but has the keys {sorted(state)} instead "
            "(a JAX replica heals from JAX replicas only)."
        )


def _copy_into(mine: list[Tensor], theirs: list[Tensor]) -> None:
    with torch.no_grad():
        for a, b in zip(mine, theirs, strict=True):
            if a is not b:
                a.copy_(b)
