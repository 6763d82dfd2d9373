"""What runs a :class:`~gang_jax.JaxGang`'s collectives on torch tensors: JAX in this process, or a child.

:class:`Op` is the table of operations (one :class:`Spec` each); :class:`Engine` is the interface,
one :meth:`Engine.run` for every operation. :class:`LocalEngine` runs them on this process's JAX
runtime (a :class:`~gang_jax._collectives.Communicator`), which :func:`start_runtime` and
:func:`stop_runtime` bring up and down. The isolated engine (:mod:`gang_jax._isolated`) forwards
the same calls to a child process (:mod:`gang_jax._server`) that holds a :class:`LocalEngine` per
gang and runs the same table. Arguments were checked by :class:`gang.Gang`; engines raise the backend's own exception
(one of :data:`gang.errors.BACKEND_ERRORS`), which the gang turns into a ``GangError``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum, unique
from typing import Any

import jax
import numpy as np
import torch
from jax.extend.backend import clear_backends
from torch import Tensor

from gang import ReduceOperation
from gang.address import (
    GLOO_SOCKET_IFNAME,
    gloo_env,
    is_loopback,
    is_loopback_address,
    outward_address,
    user_gloo_interface,
)
from gang.env import get_launcher
from gang_jax import _collectives as kernels
from gang_jax._collectives import Communicator, HostCall, Kernel
from gang_jax._convert import as_raw_bits, to_numpy
from gang_jax._lane import restart_clock
from gang_jax._rendezvous import Rendezvous

DEFAULT_COORDINATION_TIMEOUT = timedelta(minutes=5)
"""The timeout of JAX's coordination service when :meth:`JaxGang.create_default` is given none: how
long it waits for every process to join, and the heartbeat age after which it ends the job. It is
also the least time JAX's shutdown waits for the other processes to shut down too."""

_runtime_timeout: timedelta | None = None


def runtime_timeout() -> timedelta:
    """The timeout this process's JAX runtime was started with (:data:`DEFAULT_COORDINATION_TIMEOUT` if not by us)."""
    return _runtime_timeout or DEFAULT_COORDINATION_TIMEOUT


def start_runtime(where: Rendezvous, timeout: timedelta) -> None:
    """Initialise ``jax.distributed`` in this process; ``timeout`` bounds the join and the heartbeat.

    JAX's shutdown waits for every process to shut down too, at least
    :data:`DEFAULT_COORDINATION_TIMEOUT` (a process that merely runs late, such as one whose peer
    gave up on a collective, is not ended by JAX for it).
    """
    global _runtime_timeout
    seconds = max(1, math.ceil(timeout.total_seconds()))
    jax.distributed.initialize(
        where.coordinator_address,
        where.num_processes,
        where.process_id,
        initialization_timeout=seconds,
        heartbeat_timeout_seconds=seconds,
        shutdown_timeout_seconds=max(seconds, math.ceil(DEFAULT_COORDINATION_TIMEOUT.total_seconds())),
        coordinator_bind_address=_bind_address(where.coordinator_address, where.num_processes),
    )
    _use_gloo_interface(where.coordinator_address, where.num_processes)
    _runtime_timeout = timeout


def _several_hosts(num_processes: int | None) -> bool:
    """Whether the launcher says the job's processes span several hosts."""
    return (num_processes or 1) > get_launcher().local_world_size


def _use_gloo_interface(coordinator: str | None, num_processes: int | None) -> None:
    """Make JAX's CPU collectives (gloo) bind the interface that reaches the coordinator, when the
    job spans several hosts and that interface is not loopback (or the one ``GLOO_SOCKET_IFNAME``
    names), before JAX creates its CPU backend.

    JAX's gloo otherwise binds the address this host's name resolves to, which is loopback on many
    hosts: the other hosts then cannot connect. JAX offers the choice only when the CPU client is
    made, so its factory of the ``cpu`` backend is replaced by one that passes the interface.
    """
    host = "" if coordinator is None else coordinator.rpartition(":")[0].strip("[]")
    if not host or not _several_hosts(num_processes):
        return
    interface = user_gloo_interface() or gloo_env(host, several_hosts=True).get(GLOO_SOCKET_IFNAME)
    if interface is None or interface in ("lo", "lo0"):
        return
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax  # type: ignore[attr-defined]

    def cpu_client() -> Any:
        client = distributed.global_state.client
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=client, interface=interface)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def _bind_address(coordinator: str | None, num_processes: int | None) -> str | None:
    """Where process 0's coordinator listens: on its loopback address when every process reaches
    it there (a local run stays on loopback), else where JAX binds it by default (every interface).

    A coordinator named by a name that resolves to loopback on this host only (its own name, as
    many distributions map it) is reached by the other hosts at this host's real address: when
    the launcher says the processes span several hosts, it is bound to every interface
    (:func:`gang.address.outward_address` makes that choice).
    """
    if coordinator is None:
        return None
    host = coordinator.rpartition(":")[0].strip("[]")
    if not host or not is_loopback(host):
        return None
    try:
        outward = outward_address(host, several_hosts=_several_hosts(num_processes))
    except OSError:
        return None
    return coordinator if is_loopback_address(outward) else None


def stop_runtime() -> None:
    """Shut ``jax.distributed`` down, so that :func:`start_runtime` works again afterwards."""
    # Drop the XLA clients first: they hold the distributed runtime, and JAX refuses to initialise
    # it again while a client exists.
    clear_backends()  # type: ignore[no-untyped-call]
    jax.distributed.shutdown()  # type: ignore[no-untyped-call]


def _process_devices() -> dict[int, jax.Device]:
    """Map each JAX process index to the first CPU device it owns (device ids are not dense)."""
    owned: dict[int, jax.Device] = {}
    for device in sorted(jax.devices("cpu"), key=lambda d: d.id):
        owned.setdefault(device.process_index, device)
    return owned


_Args = tuple[Any, ...]


class Engine(ABC):
    """The operations of one gang on torch CPU tensors, run by :meth:`run` (one path for every :class:`Op`)."""

    rank: int
    size: int
    members: tuple[int, ...]
    """The JAX process index of each member, in gang rank order."""

    @abstractmethod
    def run(self, op: Op, outputs: Sequence[Tensor], inputs: Sequence[Tensor], args: _Args) -> None:
        """Run ``op`` with ``args``: read ``inputs``, write the result into ``outputs``.

        An in-place operation passes its tensor in both (the same object).
        """

    @abstractmethod
    def split(self, ranks: list[int]) -> Engine:
        """The engine of the sub-gang of ``ranks`` (ranks of this gang, sorted, holding this process)."""

    @property
    @abstractmethod
    def num_compiled(self) -> int:
        """How many compiled programs the engine holds."""

    @abstractmethod
    def close(self) -> None:
        """Release what the engine holds (idempotent)."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Give up on an operation that overran its timeout, for ``reason`` (an isolated engine ends its child)."""


_Local = Callable[["LocalEngine", Sequence[Tensor], Sequence[Tensor], _Args], None]


@dataclass(frozen=True)
class Spec:
    """How an :class:`Op` runs on a :class:`LocalEngine`: one compiled kernel, or a function of its own.

    :ivar kernel: The kernel compiled per (dtype, shape, arguments): it reads ``inputs[0]`` and
        its result is copied into ``outputs[0]`` (see :meth:`LocalEngine.run`).
    :ivar local: Runs the operation itself, on the engine (for what is not one kernel).
    :ivar empty_is_barrier: An empty tensor is a barrier instead (no kernel for zero elements).
    """

    kernel: Kernel | None = None
    local: _Local | None = None
    empty_is_barrier: bool = False


def _barrier(engine: LocalEngine, outputs: Sequence[Tensor], inputs: Sequence[Tensor], args: _Args) -> None:
    """A one-element all-reduce."""
    token = engine.token
    engine.run(Op.ALL_REDUCE, (token,), (token,), (ReduceOperation.SUM,))


_TORCH_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}
"""The unsigned torch dtype of each width of :func:`gang_jax._convert.as_raw_bits`."""


def _aliasing(shape: tuple[int, ...], bits: torch.dtype | None) -> Callable[[Tensor], Tensor]:
    """How a source tensor becomes a call's input without a copy: its ``bits`` (``None``: its values) as ``shape``.

    Detached first (the same memory): torch refuses to export a tensor that requires grad through DLPack.
    """
    if bits is None:
        return lambda t: t.detach().view(shape)
    return lambda t: t.detach().view(bits).view(shape)


def _bytes_of(t: Tensor) -> Tensor:
    """The bytes of the contiguous tensor ``t``, as a flat ``uint8`` view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _send_recv(engine: LocalEngine, outputs: Sequence[Tensor], inputs: Sequence[Tensor], args: _Args) -> None:
    """Send ``inputs[i]`` to ``args[0][i]`` and receive ``outputs[i]`` from ``args[1][i]``: one program per peer.

    Every rank runs its pairs in the same global order (the pair's lower rank, then its higher),
    so whatever order the caller lists them in, the smallest pair still pending always has both
    of its ranks waiting in it, and no rank waits for a pair its peer has not reached.
    """
    dests, sources = args
    if len(dests) <= 1 and len(sources) <= 1 and (not dests or not sources or dests[0] == sources[0]):
        engine.exchange(dests[0] if dests else sources[0], inputs, outputs)  # one peer: nothing to order
        return
    me = engine.rank
    for peer in sorted({*dests, *sources}, key=lambda p: (min(me, p), max(me, p))):
        sends = [t for t, d in zip(inputs, dests, strict=True) if d == peer]
        recvs = [t for t, s in zip(outputs, sources, strict=True) if s == peer]
        engine.exchange(peer, sends, recvs)


def _all_to_all_uneven(engine: LocalEngine, outputs: Sequence[Tensor], inputs: Sequence[Tensor], args: _Args) -> None:
    """Uneven rows through the all-to-all kernel: every block padded to the same number of rows.

    ``jax.lax.ragged_all_to_all`` is not implemented by XLA:CPU (JAX 0.10.2: "HLO opcode
    `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so the ranks first agree on
    the largest split of any rank (a one-element all-reduce), round it up to a power of two (a
    loop whose counts vary compiles a few programs, not one per count), and exchange padded blocks.
    """
    (output,), (input,) = outputs, inputs
    output_splits, input_splits = args
    largest = torch.tensor([max(0, *output_splits, *input_splits)], dtype=torch.int32)
    engine.run(Op.ALL_REDUCE, (largest,), (largest,), (ReduceOperation.MAX,))
    if int(largest) == 0:
        return
    rows = 1 << (int(largest) - 1).bit_length()
    trailing = tuple(input.shape[1:])
    send = torch.empty((engine.size, rows, *trailing), dtype=input.dtype)
    for j, block in enumerate(torch.split(input, list(input_splits))):
        send[j, : len(block)] = block
    received = torch.empty_like(send)
    engine.run(Op.ALL_TO_ALL, (received,), (send,), ())
    torch.cat([received[i, :n] for i, n in enumerate(output_splits)], out=output)


@unique
class Op(Enum):
    """The operations the engines run, each with its :class:`Spec`: the one table of the JAX engines.

    An isolated engine sends the member's name to the child, whose :class:`LocalEngine` runs the
    same entry, so adding an operation is one entry here (and the gang method that calls it), plus
    its kernel in :mod:`gang_jax._collectives` when it needs a new compiled program.
    """

    BARRIER = Spec(local=_barrier)
    ALL_REDUCE = Spec(kernels.ALL_REDUCE)
    REDUCE_SCATTER = Spec(kernels.REDUCE_SCATTER)
    ALL_GATHER = Spec(kernels.ALL_GATHER)
    ALL_TO_ALL = Spec(kernels.ALL_TO_ALL)
    BROADCAST = Spec(kernels.BROADCAST, empty_is_barrier=True)
    SEND_RECV = Spec(local=_send_recv)
    ALL_TO_ALL_UNEVEN = Spec(local=_all_to_all_uneven)


class LocalEngine(Engine):
    """Runs the operations of :class:`Op` on this process's JAX runtime.

    Each (operation, dtype, shape, arguments) of a kernel gets a
    :class:`~gang_jax._collectives.HostCall` on first use, and the result is copied from JAX's
    output buffer straight into the caller's tensor, the one copy a collective on host tensors
    must make. How the input gets in depends on the call: inputs up to
    :data:`~gang_jax._collectives.STAGED_BYTES` (16 MiB) are staged, copied into a device buffer
    that the call keeps (under :data:`~gang_jax._collectives.ALIAS_BYTES`, 2 MiB) or, from 2 MiB,
    aliased by JAX through DLPack; larger inputs are handed to JAX as a NumPy array (which JAX
    aliases on the CPU). The first call of each (the one that compiles) and every 64-bit
    arithmetic call (``float64``, ``int64``, ``complex128`` reductions) copy a staged input in,
    whatever its size, never alias it: 64-bit arithmetic runs inside a scoped ``jax.enable_x64``
    (entering it costs tens of microseconds, so nothing else does). Data movement sends 8-byte
    items as two 32-bit words.

    :param comm: The compiled collectives of the gang.
    :param members: The JAX process index of each member, in gang rank order.
    """

    def __init__(self, comm: Communicator, members: tuple[int, ...]) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.members = members
        self._calls: dict[tuple[Any, ...], HostCall] = {}
        self._direct: dict[tuple[int, int, int], HostCall] = {}
        """The staged point-to-point calls by (peer, bytes sent, bytes received), for one tensor each way."""
        self._pairs: dict[int, Communicator] = {}
        self.token = torch.zeros(1, dtype=torch.int32)
        """The tensor of a barrier."""

    @classmethod
    def of_processes(cls, members: list[int]) -> LocalEngine:
        """The engine of a gang of ``members`` (JAX process indices, this one among them) on this process's runtime.

        :raises ValueError: If this process is not a member, or a member owns no CPU device.
        """
        devices = _process_devices()
        me = jax.process_index()
        if me not in members:
            raise ValueError(f"`members` must contain this process ({me}), but is {members} instead.")
        missing = [m for m in members if m not in devices]
        if missing:
            raise ValueError(f"`members` must be JAX processes that own a CPU device, but {missing} own none.")
        return cls(Communicator([devices[m] for m in members], members.index(me)), tuple(members))

    def run(self, op: Op, outputs: Sequence[Tensor], inputs: Sequence[Tensor], args: _Args) -> None:
        """Run ``op``: its own function, or its kernel from ``inputs[0]`` into ``outputs[0]``."""
        spec = op.value
        if spec.local is not None:
            spec.local(self, outputs, inputs, args)
            return
        assert spec.kernel is not None
        source, target = inputs[0], outputs[0]
        if spec.empty_is_barrier and source.numel() == 0:
            self.run(Op.BARRIER, (), (), ())
            return
        self._launch(self.comm, spec.kernel, args, (op, source.dtype, source.shape, *args), source, target)

    def _launch(
        self,
        comm: Communicator,
        kernel: Kernel,
        args: _Args,
        key: tuple[Any, ...],
        source: Tensor,
        target: Tensor,
        *,
        copy_in: bool = True,
    ) -> None:
        """Run ``kernel`` on ``comm`` from ``source`` into ``target``; ``key`` names its :class:`HostCall`."""
        wide = kernel.arithmetic and source.element_size() >= 8  # float64, int64, complex128: in JAX's 64-bit mode
        if not source.is_contiguous():
            source = source.contiguous()
        call = self._calls.get(key)
        if call is not None and call.staged and not wide:
            # The steady state of a loop: as little as possible between the call and the collective.
            if call.alias is None:
                call.run_staged(source.data_ptr(), target.data_ptr())
            else:
                call.run_aliased(call.alias(source), target.data_ptr())
            return
        with jax.enable_x64(True) if wide else nullcontext():
            if call is None:
                call = self._calls[key] = self._prepare(comm, kernel, source, target, args, copy_in)
                restart_clock()  # compiling is not waiting for the peers

            def array() -> np.ndarray[Any, Any]:
                x = to_numpy(source)
                return x if kernel.arithmetic else as_raw_bits(x)

            call.run(source.data_ptr(), array, target.data_ptr())

    def _prepare(
        self, comm: Communicator, kernel: Kernel, source: Tensor, target: Tensor, args: _Args, copy_in: bool
    ) -> HostCall:
        x = to_numpy(source)
        if not kernel.arithmetic:
            x = as_raw_bits(x)
        if kernel.rows:
            x = x.reshape(comm.size, -1)
        key, body = comm.program(kernel, x.shape, x.dtype, args)
        nbytes_out = target.numel() * target.element_size()
        call = comm.host_call(key, body, (1, *x.shape), x.dtype, nbytes_out, copy_in=copy_in)
        if call.staged and call.nbytes_in >= kernels.ALIAS_BYTES:
            call.alias = _aliasing((1, *x.shape), None if kernel.arithmetic else _TORCH_BITS[x.dtype.itemsize])
        return call

    def _pair(self, peer: int) -> Communicator:
        """The communicator of this rank and ``peer`` alone (the lower rank first)."""
        comm = self._pairs.get(peer)
        if comm is None:
            low, high = sorted((self.rank, peer))
            devices = [self.comm.devices[low], self.comm.devices[high]]
            comm = self._pairs[peer] = Communicator(devices, 0 if self.rank == low else 1)
        return comm

    def exchange(self, peer: int, sends: Sequence[Tensor], recvs: Sequence[Tensor]) -> None:
        """Send the bytes of ``sends`` to ``peer`` and receive ``recvs`` from it, in one program of the two.

        The block is as long as the longer direction (both ranks compute the same length, since
        a receive has the shape and dtype of what the peer sends); a direction that carries no
        bytes is left out of the program, so a plain send moves data one way only.
        """
        if len(sends) <= 1 and len(recvs) <= 1:
            # A loop's steady state: the call made for these byte counts, from the tensors' own memory.
            n_out = sends[0].nbytes if sends else 0
            n_in = recvs[0].nbytes if recvs else 0
            direct = self._direct.get((peer, n_out, n_in))
            if direct is not None:
                if direct.alias is not None and n_out:
                    direct.run_aliased(direct.alias(sends[0]), recvs[0].data_ptr() if recvs else 0)
                else:
                    direct.run_staged(sends[0].data_ptr() if sends else 0, recvs[0].data_ptr() if recvs else 0)
                return
        else:
            n_out = sum(t.nbytes for t in sends)
            n_in = sum(t.nbytes for t in recvs)
        n = max(n_out, n_in)
        if n == 0:
            return
        low = self.rank < peer
        upward, downward = (n_out, n_in) if low else (n_in, n_out)
        perm = tuple(pair for pair, moved in (((0, 1), upward), ((1, 0), downward)) if moved)
        if n_out == 0 or len(sends) > 1 or n_out < n:
            source = torch.empty(n, dtype=torch.uint8)
            if n_out:
                torch.cat([_bytes_of(t.contiguous()) for t in sends], out=source[:n_out])
        else:
            source = _bytes_of(sends[0].contiguous())
        target = _bytes_of(recvs[0]) if len(recvs) == 1 else torch.empty(n_in, dtype=torch.uint8)
        key = (Op.SEND_RECV, peer, n, perm, n_out > 0, n_in)
        self._launch(self._pair(peer), kernels.PPERMUTE, (perm,), key, source, target, copy_in=n_out > 0)
        call = self._calls[key]
        if call.staged and len(sends) <= 1 and len(recvs) <= 1 and n_out in (0, n):
            # It reads the sent tensor's bytes and writes the received one's in place: later calls
            # with the same byte counts run it from the two addresses alone (see the top).
            self._direct[peer, n_out, n_in] = call
        if len(recvs) > 1:
            for t, received in zip(
                recvs, torch.split(target, [t.numel() * t.element_size() for t in recvs]), strict=True
            ):
                _bytes_of(t).copy_(received)

    def split(self, ranks: list[int]) -> LocalEngine:
        """A new engine on the sub-mesh of ``ranks`` (no communication: every member derives the same mesh)."""
        devices = [self.comm.devices[r] for r in ranks]
        return LocalEngine(Communicator(devices, ranks.index(self.rank)), tuple(self.members[r] for r in ranks))

    @property
    def num_compiled(self) -> int:
        """The compiled programs of this gang (its point-to-point programs included)."""
        return self.comm.cache_size + sum(pair.cache_size for pair in self._pairs.values())

    def abort(self, reason: str) -> None:
        """Nothing: JAX cannot cancel a program in this process (it ends when its peers meet it or XLA gives up)."""

    def close(self) -> None:
        """Drop the compiled programs and staging buffers."""
        self._calls.clear()
        self._direct.clear()
        self.comm.clear()
        for pair in self._pairs.values():
            pair.clear()
        self._pairs.clear()
