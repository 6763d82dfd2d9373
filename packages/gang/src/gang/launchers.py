"""The launcher model: which program started this process, and what it says about the world.

One launcher's variables are read as a whole, never mixed with another's. When variables of
several launchers are present, the innermost launcher wins, in this order:

1. **torchrun** (also plain ``env://``): ``RANK`` or ``WORLD_SIZE`` is set. torchrun started
   inside an ``srun`` step or an ``mpirun`` job still wins as a whole.
2. **Open MPI** ``mpirun``: ``OMPI_COMM_WORLD_RANK`` or ``OMPI_COMM_WORLD_SIZE`` is set (an
   ``mpirun`` inside a SLURM job inherits the job's ``SLURM_*`` variables; they are ignored).
3. **SLURM** ``srun``: ``SLURM_PROCID`` and ``SLURM_STEP_ID`` are set. The batch script of
   ``sbatch`` is not a step (it has ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` but no
   ``SLURM_STEP_ID``): it is one process, and its ``srun`` starts the tasks. A ``salloc`` shell
   (no ``SLURM_PROCID``) is one process too.
4. None of them: a world of one process.

A variable set to blanks counts as unset. Each launcher is one small class, registered in
:data:`LAUNCHERS` in the order above; a new launcher (MPICH, PBS, LSF, ...) is one more class
registered with :func:`register_launcher`, last by default or ahead of a named one (``before=``).

Derived rendezvous ports are even, so ``port + 1`` is free for a second service of the same
job (``gang_jax`` puts the JAX coordinator there).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar, overload

__all__ = [
    "LAUNCHERS",
    "Launcher",
    "NoLauncher",
    "OpenMPILauncher",
    "SlurmLauncher",
    "TorchrunLauncher",
    "detect_launcher",
    "expand_hostlist",
    "expand_tasks_per_node",
    "register_launcher",
]

# Derived ports are even numbers in [_PORT_BASE, _PORT_BASE + 2 * _PORT_SLOTS), below Linux's
# ephemeral range (32768-60999), so an outgoing connection never holds one by chance.
_PORT_BASE = 20000
_PORT_SLOTS = 6000
# Open MPI's job ids are multiples of 2**12 (JAX divides the same way).
_OMPI_JOB_ID_UNIT = 2**12

_MPIRUN_FIX = "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ..."


def _error(name: str, raw: str, must: str) -> ValueError:
    return ValueError(f"The environment variable `{name}` must be {must}, but is {raw!r} instead.")


def _given(env: Mapping[str, str], name: str) -> bool:
    """Whether ``name`` is set to something other than blanks (a blank value counts as unset)."""
    return bool(env.get(name, "").strip())


def _int(env: Mapping[str, str], name: str, *, minimum: int, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        if default is None:
            raise ValueError(f"The environment variable `{name}` must be set, but is not set.")
        return default
    # Plain ASCII digits: `int()` would also take "1_000" or non-ASCII digits, which no launcher writes.
    if re.fullmatch(r"[+-]?[0-9]+", raw.strip()) is None:
        raise _error(name, raw, "an integer")
    value = int(raw.strip())
    if value < minimum:
        raise _error(name, raw, f"at least {minimum}")
    return value


def _below(env: Mapping[str, str], name: str, value: int, limit: int, what: str) -> int:
    if value >= limit:
        raise _error(name, env[name], f"less than the {what} ({limit})")
    return value


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    :raises ValueError: If ``text`` is not such a list.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None or int(match.group(2) or 1) < 1:
            raise ValueError(f"`{text}` is not a SLURM tasks-per-node list such as `2(x3),1`.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: ``"a[1,2],b"`` is ``["a[1,2]", "b"]``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"`{text}` is not a SLURM host list such as `gpu[01-04,07]`.")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth != 0 or any(not item.strip() for item in items):
        raise ValueError(f"`{text}` is not a SLURM host list such as `gpu[01-04,07]`.")
    return items


def _expand_ranges(text: str, whole: str) -> list[str]:
    """``"01-03,07"`` is ``["01", "02", "03", "07"]`` (zero padding kept)."""
    values: list[str] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"`{whole}` is not a SLURM host list such as `gpu[01-04,07]`.")
        first, last = match.group(1), match.group(2) or match.group(1)
        values += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return values


def _expand_host(item: str, whole: str) -> Iterator[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError(f"`{whole}` is not a SLURM host list such as `gpu[01-04,07]`.")
        yield item
        return
    prefix, ranges, rest = match.groups()
    tails = list(_expand_host(rest, whole)) if rest else [""]
    for value in _expand_ranges(ranges, whole):
        for tail in tails:
            yield prefix + value + tail


def expand_hostlist(text: str) -> list[str]:
    """Expand SLURM's compressed host list: ``"gpu[01-02,07],login"`` is
    ``["gpu01", "gpu02", "gpu07", "login"]``.

    :raises ValueError: If ``text`` is not such a list.
    """
    return [host for item in _split_top_level(text.strip()) for host in _expand_host(item.strip(), text)]


def _derived_port(key: int) -> int:
    return _PORT_BASE + 2 * (key % _PORT_SLOTS)


def _slurm_node_address(node: str, variable: str, value: str) -> str:
    """The address of a SLURM node: its name if the name resolves, else SLURM's ``NodeAddr``."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    # A node name need not be a DNS name: SLURM knows the node's address (`NodeAddr`).
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run(
                [scontrol, "show", "node", "-o", node], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        match = re.search(r"\bNodeAddr=(\S+)", out)
        if match is not None:
            return match.group(1)
    raise ValueError(
        f"The first node `{node}` of `{variable}`={value!r} cannot be resolved to an address (neither by name "
        "nor by `scontrol show node`); set `MASTER_ADDR` to the address of the node of rank 0."
    )


@dataclass(frozen=True)
class Launcher:
    """What the launcher of this process says about the world: the base of one small class per
    launcher, found through :data:`LAUNCHERS`.

    A new launcher (MPICH, PBS, LSF, ...) is one subclass: its :attr:`name`, :meth:`is_present`,
    :meth:`from_env` and, when it can derive a rendezvous address, :meth:`_derived_address`;
    :func:`register_launcher` puts it in the registry.

    :ivar name: ``"torchrun"``, ``"slurm"``, ``"openmpi"``, or ``"none"`` (a world of one process).
    :ivar rank: The global rank.
    :ivar world_size: The number of processes.
    :ivar local_rank: The rank on this node.
    :ivar local_world_size: The number of processes on this node.
    """

    name: ClassVar[str]
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    _env: Mapping[str, str] = field(repr=False, compare=False)

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Whether ``env`` shows that this launcher started the process."""
        raise NotImplementedError

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launcher:
        """Read this launcher's variables from ``env``, as a whole.

        :raises ValueError: If a variable is missing or malformed (the message names it and its value).
        """
        raise NotImplementedError

    @property
    def agent_store(self) -> bool:
        """Whether the launcher's agent serves the rendezvous store at :meth:`master_address` for the
        whole run (torchrun's ``TORCHELASTIC_USE_AGENT_STORE``), so no rank may serve it. ``False``
        by default: rank 0 serves it."""
        return False

    @property
    def restart_count(self) -> int:
        """How often the launcher restarted this job (0 on the first run), so that keys written in
        a store by an earlier run are never read as fresh. 0 where the launcher does not say."""
        return 0

    def master_address(self) -> tuple[str, int]:
        """Return the rendezvous ``(host, port)`` that every process of the world agrees on.

        ``MASTER_ADDR`` and ``MASTER_PORT`` win under every launcher. Otherwise:

        - torchrun: both are always set; plain ``env://`` must set them.
        - SLURM: the host is the first node of ``SLURM_STEP_NODELIST`` (else
          ``SLURM_JOB_NODELIST``), and the port is derived from ``SLURM_JOB_ID`` and
          ``SLURM_STEP_ID``, so concurrent steps of one job (whose step ids differ by less than
          6000) never collide.
        - Open MPI: the host is ``mpirun``'s address in ``OMPI_MCA_orte_hnp_uri`` (as JAX finds its
          coordinator; rank 0 must run on ``mpirun``'s node) and the port is derived from the
          Open MPI job id there. Open MPI 5 has no such variable: set ``MASTER_ADDR``.
        - No launcher: ``127.0.0.1`` and port 0 (pick a free port).

        :raises ValueError: If a variable is malformed, or the address cannot be found (the
            message names the launcher and the fix).
        """
        env = self._env
        host = env.get("MASTER_ADDR", "").strip() or None
        port = _int(env, "MASTER_PORT", minimum=1, default=0) or None
        if port is not None and port > 65535:
            raise _error("MASTER_PORT", env["MASTER_PORT"], "a port in the range [1, 65535]")
        if host is not None and port is not None:
            return host, port
        return self._derived_address(host, port)

    def _derived_address(self, host: str | None, port: int | None) -> tuple[str, int]:
        """The rendezvous address when ``MASTER_ADDR`` or ``MASTER_PORT`` (``None`` here) is missing.

        By default the launcher cannot derive one, and the error says which variable to set.
        """
        missing = "MASTER_ADDR" if host is None else "MASTER_PORT"
        raise ValueError(
            f"The environment variable `{missing}` must be set for a multi-process run launched by {self.name} "
            "(torchrun sets it; with plain `env://` set `MASTER_ADDR` and `MASTER_PORT`), but is not set."
        )


LAUNCHERS: list[type[Launcher]] = []
"""The known launchers, innermost first: :func:`detect_launcher` returns the first present one."""

_L = TypeVar("_L", bound=type[Launcher])


@overload
def register_launcher(cls: _L, *, before: str | None = None) -> _L: ...


@overload
def register_launcher(cls: None = None, *, before: str | None = None) -> Callable[[_L], _L]: ...


def register_launcher(cls: _L | None = None, *, before: str | None = None) -> _L | Callable[[_L], _L]:
    """Add the launcher class ``cls`` to :data:`LAUNCHERS` and return it; a class decorator.

    Without ``before`` it goes last, ahead of the catch-all ``none`` only: every launcher
    registered earlier wins over it. ``before`` names a registered launcher to put it ahead of, for
    a launcher whose variables are set inside that one's processes (an inner launcher), such as
    ``@register_launcher(before="torchrun")``.

    :raises ValueError: If ``before`` names no registered launcher.
    """
    names = [known.name for known in LAUNCHERS]
    if before is not None and before not in names:
        raise ValueError(f"`before` must be the name of a registered launcher {names}, but is {before!r} instead.")

    def add(launcher: _L) -> _L:
        if before is not None:
            index = [known.name for known in LAUNCHERS].index(before)
        else:
            index = len(LAUNCHERS) - 1 if LAUNCHERS and LAUNCHERS[-1].name == "none" else len(LAUNCHERS)
        LAUNCHERS.insert(index, launcher)
        return launcher

    return add if cls is None else add(cls)


@register_launcher
class TorchrunLauncher(Launcher):
    """torchrun, or plain ``env://``: ``RANK`` or ``WORLD_SIZE`` is set."""

    name = "torchrun"

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Whether ``RANK`` or ``WORLD_SIZE`` is set."""
        return _given(env, "RANK") or _given(env, "WORLD_SIZE")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launcher:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``."""
        size = _int(env, "WORLD_SIZE", minimum=1)
        rank = _below(env, "RANK", _int(env, "RANK", minimum=0), size, "world size")
        has_local = [name for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if _given(env, name)]
        if len(has_local) == 1:
            other = "LOCAL_WORLD_SIZE" if has_local[0] == "LOCAL_RANK" else "LOCAL_RANK"
            raise ValueError(
                f"The environment variable `{other}` must be set when `{has_local[0]}` is (torchrun sets both), "
                "but is not set."
            )
        local_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1, default=1)
        local_rank = _below(
            env, "LOCAL_RANK", _int(env, "LOCAL_RANK", minimum=0, default=0), local_size, "local world size"
        )
        return cls(rank, size, local_rank, local_size, env)

    @property
    def agent_store(self) -> bool:
        """Whether ``TORCHELASTIC_USE_AGENT_STORE`` is ``True``: torchrun's agent serves the store."""
        return self._env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

    @property
    def restart_count(self) -> int:
        """``TORCHELASTIC_RESTART_COUNT`` (torchrun's ``--max-restarts`` count so far; 0 when unset)."""
        return _int(self._env, "TORCHELASTIC_RESTART_COUNT", minimum=0, default=0)


@register_launcher
class OpenMPILauncher(Launcher):
    """Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK`` or ``OMPI_COMM_WORLD_SIZE`` is set."""

    name = "openmpi"

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Whether ``OMPI_COMM_WORLD_RANK`` or ``OMPI_COMM_WORLD_SIZE`` is set."""
        return _given(env, "OMPI_COMM_WORLD_RANK") or _given(env, "OMPI_COMM_WORLD_SIZE")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launcher:
        """Read the ``OMPI_COMM_WORLD_*`` variables."""
        size = _int(env, "OMPI_COMM_WORLD_SIZE", minimum=1)
        rank = _below(env, "OMPI_COMM_WORLD_RANK", _int(env, "OMPI_COMM_WORLD_RANK", minimum=0), size, "world size")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", minimum=0)
        local_rank = _below(env, "OMPI_COMM_WORLD_LOCAL_RANK", local_rank, local_size, "local world size")
        return cls(rank, size, local_rank, local_size, env)

    def _derived_address(self, host: str | None, port: int | None) -> tuple[str, int]:
        uri = self._env.get("OMPI_MCA_orte_hnp_uri", "").strip()
        if not uri:
            missing = " and ".join(f"`{n}`" for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port)) if v is None)
            raise ValueError(
                f"Under Open MPI's mpirun the rendezvous address cannot be derived ({missing} not set, and no "
                f"`OMPI_MCA_orte_hnp_uri`, which Open MPI 5 no longer sets); export it to every rank: `{_MPIRUN_FIX}`."
            )
        # e.g. "1042350080.0;tcp://10.96.0.1,10.148.0.1:34911" or "...;tcp6://[fe80::1,...]:43370"
        match = re.fullmatch(r"(\d+)\.\d+;.*?tcp://([^,:]+)[,:].*|(\d+)\.\d+;.*?tcp6://\[([^,\]]+)[,\]].*", uri)
        if match is None:
            raise ValueError(
                f"The environment variable `OMPI_MCA_orte_hnp_uri` must be Open MPI's `jobid.vpid;tcp://host:port`, "
                f"but is {uri!r} instead; export the address to every rank: `{_MPIRUN_FIX}`."
            )
        job_id = match.group(1) or match.group(3)
        address = match.group(2) or match.group(4)
        return host or address, port or _derived_port(int(job_id) // _OMPI_JOB_ID_UNIT)


@register_launcher
class SlurmLauncher(Launcher):
    """SLURM's ``srun``: ``SLURM_PROCID`` and ``SLURM_STEP_ID`` are set (a batch script or ``salloc``
    shell is no step)."""

    name = "slurm"

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Whether ``SLURM_PROCID`` and ``SLURM_STEP_ID`` are set."""
        return _given(env, "SLURM_PROCID") and _given(env, "SLURM_STEP_ID")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launcher:
        """Read ``SLURM_NTASKS``, ``SLURM_PROCID``, the tasks per node, ``SLURM_NODEID`` and ``SLURM_LOCALID``."""
        size = _int(env, "SLURM_NTASKS", minimum=1)
        rank = _below(env, "SLURM_PROCID", _int(env, "SLURM_PROCID", minimum=0), size, "world size")
        variable = "SLURM_STEP_TASKS_PER_NODE" if _given(env, "SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
        raw = env.get(variable, "")
        if not raw.strip():
            raise ValueError(
                "The environment variable `SLURM_STEP_TASKS_PER_NODE` must be set under srun, but is not set."
            )
        try:
            counts = expand_tasks_per_node(raw)
        except ValueError:
            raise _error(variable, raw, "a SLURM tasks-per-node list such as `2(x3),1`") from None
        node = _int(env, "SLURM_NODEID", minimum=0)
        if node >= len(counts):
            raise _error("SLURM_NODEID", env["SLURM_NODEID"], f"less than the number of nodes in `{variable}`={raw!r}")
        local_size = counts[node]
        local_rank = _below(env, "SLURM_LOCALID", _int(env, "SLURM_LOCALID", minimum=0), local_size, "local world size")
        return cls(rank, size, local_rank, local_size, env)

    @property
    def restart_count(self) -> int:
        """``SLURM_RESTART_COUNT`` (how often a requeued job was started again; 0 when unset)."""
        return _int(self._env, "SLURM_RESTART_COUNT", minimum=0, default=0)

    def _derived_address(self, host: str | None, port: int | None) -> tuple[str, int]:
        env = self._env
        if host is None:
            variable = "SLURM_STEP_NODELIST" if _given(env, "SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
            value = env.get(variable, "")
            if not value.strip():
                raise ValueError(
                    "The environment variable `SLURM_STEP_NODELIST` must be set under SLURM, but is not set; "
                    "set `MASTER_ADDR` to the address of the node of rank 0."
                )
            try:
                first = expand_hostlist(value)[0]
            except ValueError as ex:
                raise _error(variable, value, f"a SLURM host list ({ex})") from None
            host = _slurm_node_address(first, variable, value)
        if port is None:
            job = _int(env, "SLURM_JOB_ID", minimum=0)
            step = _int(env, "SLURM_STEP_ID", minimum=0)
            port = _derived_port(job * 64 + step)
        return host, port


@register_launcher
class NoLauncher(Launcher):
    """No launcher: a world of one process (always present, so it comes last)."""

    name = "none"

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Always true: the catch-all."""
        return True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launcher:
        """Rank 0 of a world of one process."""
        return cls(0, 1, 0, 1, env)

    def _derived_address(self, host: str | None, port: int | None) -> tuple[str, int]:
        return host or "127.0.0.1", port or 0


def detect_launcher(environ: Mapping[str, str]) -> Launcher:
    """Return the launcher that ``environ`` (usually ``os.environ``) describes; see the module docs.

    The first class of :data:`LAUNCHERS` that :meth:`~Launcher.is_present` reads it.

    :raises ValueError: If a variable of the detected launcher is missing or malformed (the
        message names the variable and its value).
    """
    env = dict(environ)
    for launcher in LAUNCHERS:
        if launcher.is_present(env):
            return launcher.from_env(env)
    raise AssertionError("`NoLauncher` is always present")  # unreachable: the catch-all is registered
