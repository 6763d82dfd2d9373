"""Healing: who sends what to whom when a quorum forms, and the chunked transfer of a state dict.

A replica that is behind (restarted, new, or partly healed) receives the state of an up-to-date
member point to point, never through a broadcast, so members that are up to date receive
nothing. Who heals from whom is the quorum's heal plan (:func:`gang.ft.policy.heal_plan`), which
spreads the replicas that are behind over the up-to-date ones.

The transfer never builds one blob of the whole state. The sender sends a small pickled header
(the step number and the state dict with every tensor replaced by a :class:`TensorSlot`), then
the bytes of each tensor in chunks of at most :data:`CHUNK_BYTES`. A contiguous tensor on the
group's device is sent from its own memory (a view per chunk); a receiver writes each chunk into
the tensor its own ``state_dict()`` holds under the same key when that tensor is contiguous and
has the same dtype and shape (else into a new tensor), through a chunk-sized buffer only when the
target is not on the group's device. So a healer and a healing process each hold at most one
chunk beyond the state itself (a non-contiguous tensor of the sender is the exception: it is
copied whole, once).

:func:`heal` runs one heal of a quorum on this process: it sends the state of :class:`HealedState`
(the user's, with the states attached to it) to the ranks the plan gives this one, or receives and
loads it, and :func:`log_heal` reports it.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gang._torch_groups import StandaloneGroup
from gang.errors import GangError
from gang.ft.log import log_event
from gang.ft.policy import Quorum

CHUNK_BYTES = 64 * 2**20
"""The largest piece of a tensor sent at once (64 MiB)."""

_Path = tuple[object, ...]


@dataclass(frozen=True)
class TensorSlot:
    """Stands in the header for tensor ``index`` of the state; its bytes follow the header.

    :ivar index: The tensor's position in the order the tensors are sent.
    :ivar dtype: Its dtype.
    :ivar shape: Its shape.
    :ivar on_cpu: Whether it is on the CPU (else on the sender's accelerator).
    :ivar requires_grad: Whether it requires a gradient.
    """

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_cpu: bool
    requires_grad: bool


def _is_plain(value: object) -> bool:
    return isinstance(value, Tensor) and value.layout == torch.strided and not value.is_quantized


def flatten(state: object) -> tuple[object, list[tuple[_Path, Tensor]]]:
    """Split ``state`` into a skeleton (tensors replaced by :class:`TensorSlot`) and its tensors with their paths.

    Dicts, lists and tuples are walked; anything else (sparse or quantized tensors included)
    stays in the skeleton and travels pickled.
    """
    tensors: list[tuple[_Path, Tensor]] = []

    def walk(value: object, path: _Path) -> object:
        if _is_plain(value):
            assert isinstance(value, Tensor)
            slot = TensorSlot(
                len(tensors), value.dtype, tuple(value.shape), value.device.type == "cpu", value.requires_grad
            )
            tensors.append((path, value))
            return slot
        if isinstance(value, dict):
            return type(value)((k, walk(v, (*path, k))) for k, v in value.items())
        if type(value) in (list, tuple):
            assert isinstance(value, (list, tuple))
            return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
        return value

    return walk(state, ()), tensors


def _fill(skeleton: object, tensors: list[Tensor]) -> object:
    if isinstance(skeleton, TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, _fill(v, tensors)) for k, v in skeleton.items())
    if type(skeleton) in (list, tuple):
        assert isinstance(skeleton, (list, tuple))
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def _chunks(numel: int, element_size: int) -> Iterator[tuple[int, int]]:
    """The element ranges ``[start, stop)`` a tensor of ``numel`` elements travels in."""
    per = max(1, CHUNK_BYTES // max(1, element_size))
    for start in range(0, numel, per):
        yield start, min(numel, start + per)


def send_state(
    pg: StandaloneGroup,
    to: int,
    state: Mapping[str, Any],
    step: int,
    device: torch.device,
    finish: Callable[[Any], None],
) -> int:
    """Send ``state`` and ``step`` to rank ``to`` of ``pg``; return the number of bytes sent.

    :param finish: Waits for one operation's work to complete (on the device, for CUDA).
    """
    skeleton, tensors = flatten(dict(state))
    header = pickle.dumps((step, skeleton), protocol=pickle.HIGHEST_PROTOCOL)
    head = torch.tensor([len(header)], dtype=torch.int64, device=device)
    finish(pg.send([head], to, 0))
    finish(pg.send([torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)], to, 0))
    sent = len(header) + head.numel() * head.element_size()
    for _, tensor in tensors:
        source = tensor.detach()
        if not source.is_contiguous():
            source = source.contiguous()  # the documented exception: copied whole, once
        flat = source.reshape(-1)
        for start, stop in _chunks(flat.numel(), flat.element_size()):
            piece = flat[start:stop]
            if piece.device != device:
                piece = piece.to(device)
            finish(pg.send([piece.view(torch.uint8)], to, 0))
            sent += piece.numel() * piece.element_size()
    return sent


def receive_state(
    pg: StandaloneGroup,
    source: int,
    current: Mapping[str, Any],
    device: torch.device,
    finish: Callable[[Any], None],
) -> tuple[int, object, int]:
    """Receive what :func:`send_state` sent from rank ``source``; return ``(step, state, bytes received)``.

    Each tensor is written in place into the tensor at the same path of ``current`` (this
    process's own state) when that one is contiguous and has the same dtype and shape, else into a new tensor (on
    the CPU, or on ``device`` when the sender's was not on the CPU).
    """
    head = torch.zeros(1, dtype=torch.int64, device=device)
    finish(pg.recv([head], source, 0))
    raw = torch.empty(int(head.item()), dtype=torch.uint8, device=device)
    finish(pg.recv([raw], source, 0))
    # Like `broadcast_objects`, this unpickles what a peer sent: replicas trust each other.
    step, skeleton = pickle.loads(raw.cpu().numpy().tobytes())
    received = raw.numel() + head.numel() * head.element_size()
    del raw
    own = dict(flatten(dict(current))[1])
    tensors: list[Tensor] = []
    with torch.no_grad():
        for path, slot in _slots(skeleton):
            target = own.get(path)
            if not _fits(target, slot):
                where = torch.device("cpu") if slot.on_cpu else device
                target = torch.empty(slot.shape, dtype=slot.dtype, device=where).requires_grad_(slot.requires_grad)
            assert target is not None
            tensors.append(target)
            received += _receive_into(pg, source, target.detach(), device, finish)
    return int(step), _fill(skeleton, tensors), received


def _fits(target: Tensor | None, slot: TensorSlot) -> bool:
    """Whether a tensor of the receiver's own state can take the slot's bytes in place."""
    return (
        target is not None
        and target.dtype == slot.dtype
        and tuple(target.shape) == slot.shape
        and target.is_contiguous()
    )


def _receive_into(
    pg: StandaloneGroup, source: int, target: Tensor, device: torch.device, finish: Callable[[Any], None]
) -> int:
    """Receive a contiguous tensor's bytes chunk by chunk (through a chunk buffer if not on ``device``)."""
    flat = target.view(-1)
    staging: Tensor | None = None
    for start, stop in _chunks(flat.numel(), flat.element_size()):
        if target.device == device:
            finish(pg.recv([flat[start:stop].view(torch.uint8)], source, 0))
            continue
        if staging is None or staging.numel() != stop - start:
            staging = torch.empty(stop - start, dtype=target.dtype, device=device)
        finish(pg.recv([staging.view(torch.uint8)], source, 0))
        flat[start:stop].copy_(staging)
    return flat.numel() * flat.element_size()


def _slots(skeleton: object) -> list[tuple[_Path, TensorSlot]]:
    """The slots of a skeleton with their paths, in the order their tensors travel."""
    found: list[tuple[_Path, TensorSlot]] = []

    def walk(value: object, path: _Path) -> None:
        if isinstance(value, TensorSlot):
            found.append((path, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, (*path, k))
        elif type(value) in (list, tuple):
            assert isinstance(value, (list, tuple))
            for i, v in enumerate(value):
                walk(v, (*path, i))

    walk(skeleton, ())
    return sorted(found, key=lambda item: item[1].index)


_Get = Callable[[], Mapping[str, Any]]
_Load = Callable[[Mapping[str, Any]], None]


class HealedState:
    """What a replica gang's heals move: the user's state and the states attached to it.

    :param state_dict: Returns the user's state (``join``'s ``state_dict``).
    :param load_state_dict: Loads it (``join``'s ``load_state_dict``).
    :ivar dirty: Whether a heal wrote part of the state in place, then failed.
    :ivar moved: The bytes this process sent and received healing, in that order (for tests).
    """

    def __init__(self, state_dict: _Get, load_state_dict: _Load) -> None:
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        # State healed along with the user's (`LocalSGD`, `DiLoCo`): name -> (state_dict, load_state_dict).
        self._attached: dict[str, tuple[_Get, _Load]] = {}
        self.dirty = False
        self.moved = [0, 0]

    def attach(self, name: str, state_dict: _Get, load_state_dict: _Load) -> bool:
        """Heal ``state_dict()`` under ``name`` along with the user's state; ``False`` if ``name`` is taken.

        A replica that heals loads the user's state first, then each attached one in the order attached.
        """
        if name in self._attached:
            return False
        self._attached[name] = (state_dict, load_state_dict)
        return True

    def detach(self, name: str) -> None:
        """Stop healing what :meth:`attach` attached under ``name``."""
        self._attached.pop(name, None)

    def get(self) -> Mapping[str, Any]:
        """What a heal sends: the user's state, with the attached states when there are any."""
        if not self._attached:
            return self._state_dict()
        return {"user": self._state_dict(), "attached": {n: get() for n, (get, _) in self._attached.items()}}

    def load(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`get` of the healer returned."""
        if not self._attached:
            self._load_state_dict(state)
            return
        self._load_state_dict(state["user"])
        for name, (_, load) in self._attached.items():
            load(state["attached"][name])


def rank_plan(quorum: Quorum) -> dict[int, int]:
    """The quorum's heal plan by rank in the quorum: the rank of each member that heals -> its healer's."""
    index = {m: r for r, m in enumerate(quorum.members)}
    return {index[m]: index[source] for m, source in quorum.heal.items()}


def unhealable(replica_id: str, step: int, quorum: Quorum) -> GangError:
    """The error of a replica whose state a failed heal left dirty while no member of ``quorum`` heals it."""
    return GangError(
        f"`step` failed on replica {replica_id!r} before step {step + 1} of "
        f"{quorum.describe()}: a heal that failed midway left this replica's state partly "
        "overwritten, and no member is ahead of it to heal it again; restore it from a checkpoint "
        "(`load_state_dict` of the model and of this gang)."
    )


@dataclass(frozen=True)
class Healed:
    """What :func:`heal` did.

    :ivar step: The healer's step number, which this process took (``None``: this process sent).
    :ivar moved: The bytes sent or received.
    :ivar done: What was done, for the log ("received N bytes from rank R", "sent N bytes to ranks [...]").
    :ivar seconds: How long it took, from reading the state to loading it or sending the last byte.
    """

    step: int | None
    moved: int
    done: str
    seconds: float


def heal(
    pg: StandaloneGroup,
    rank: int,
    plan: Mapping[int, int],
    state: HealedState,
    step: int,
    device: torch.device,
    finish: Callable[[Any], None],
) -> Healed | None:
    """Receive ``state`` from this rank's healer in ``plan`` (:func:`rank_plan`) and load it, or send
    it (with ``step``) to every rank that ``plan`` gives this one; ``None`` if this rank has no part.

    :attr:`HealedState.dirty` is set while a received state is written in place, and cleared once
    it is loaded. Raises what a transfer, or the caller's ``state_dict``/``load_state_dict``, raised.

    :param finish: Waits for one transfer's work to complete.
    """
    receivers = [r for r, s in plan.items() if s == rank]
    if rank not in plan and not receivers:
        return None
    started = time.monotonic()
    if rank in plan:
        current = state.get()
        state.dirty = True  # from here on, tensors of `current` may be written in place
        healed_step, received_state, received = receive_state(pg, plan[rank], current, device, finish)
        state.moved[1] += received
        assert isinstance(received_state, Mapping)
        state.load(received_state)
        state.dirty = False
        return Healed(
            healed_step, received, f"received {received} bytes from rank {plan[rank]}", time.monotonic() - started
        )
    full = state.get()
    sent = sum(send_state(pg, r, full, step, device, finish) for r in receivers)
    state.moved[0] += sent
    return Healed(None, sent, f"sent {sent} bytes to ranks {receivers}", time.monotonic() - started)


def log_heal(quorum: Quorum, replica_id: str, replica_rank: int, healed: Healed, step: int) -> None:
    """Report what :func:`heal` did on replica ``replica_id``'s process ``replica_rank`` (now at ``step``)."""
    log_event(
        "heal",
        f"heal in {quorum.describe()} on replica {replica_id!r} rank {replica_rank}: "
        f"{healed.done} in {healed.seconds:.3f} s",
        replica=replica_id,
        replica_rank=replica_rank,
        round=quorum.round,
        source=quorum.heal.get(replica_id, replica_id),
        bytes=healed.moved,
        seconds=round(healed.seconds, 6),
        step=step,
    )


__all__ = [
    "CHUNK_BYTES",
    "Healed",
    "HealedState",
    "TensorSlot",
    "flatten",
    "heal",
    "log_heal",
    "rank_plan",
    "receive_state",
    "send_state",
    "unhealable",
]
