"""The pytest plugin that installing ``gang`` registers: distributed test bodies on real processes.

A test marked ``@pytest.mark.gang(world_size=4)`` whose first parameter is ``gang`` runs its body
on 4 real local processes, each holding a gloo :class:`~gang.ProcessGroupGang` on the CPU; the
processes (the :func:`gang.testing.shared_world` of that size) are reused by every test of that size
and stopped at the end of the session. ``world_size=[2, 4]`` runs the test once per size.

* Fixtures and parameters of the test are computed once, in the pytest process, and sent to every
  rank by pickle (a value that does not pickle fails the test, naming the argument).
* A failure on any rank fails the test with that rank's traceback (assertions are rewritten as
  pytest rewrites them); the other ranks are stopped and the processes of that size restarted.
* ``timeout=`` (seconds) bounds the body; the default is the ``gang_run_timeout`` ini option or the
  ``--gang-run-timeout`` command-line option (120 seconds). A test that runs past it fails, and its
  processes are stopped. (The deprecated ``gang_timeout`` and ``--gang-timeout`` still work, with a
  warning: a gang's timeout is that of its collectives, as in :class:`gang.testing.World`.)
* ``pytest.skip()`` in the body on every rank skips the test.

The test module is loaded again in each process, from its file and under the name pytest gave
it, so tests are found whatever the ``--import-mode``; a test defined inside a function, or a
name that the module binds to another function, cannot be found there and fails with a message
that says so.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from gang import testing
from gang.testing import DEFAULT_RUN_TIMEOUT, RemoteTraceback, WorkerDiedError, close_shared_worlds, shared_world

__all__ = ["GangSlot"]

MARKER = "gang"
FIXTURE = "gang"


@dataclass(frozen=True)
class GangSlot:
    """What the ``gang`` fixture holds in the pytest process: the size of the gang the body gets.

    The body itself runs in the worker processes, where ``gang`` is a real
    :class:`~gang.ProcessGroupGang`; this placeholder only carries the world size to the plugin.
    """

    world_size: int


@dataclass(frozen=True)
class _Target:
    """Where a worker finds the test function: module name and file, qualified name, first line."""

    module: str
    path: str
    qualname: str
    lineno: int


@dataclass(frozen=True)
class _Skipped:
    reason: str


_RUN_TIMEOUT = "gang_run_timeout"
"""The ini option (and, as ``--gang-run-timeout``, the command-line option) of the default run timeout."""
_DEPRECATED = {"gang_timeout": _RUN_TIMEOUT}
"""The deprecated names of the options, each with its new name (ini; the command line adds ``--``)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--gang-run-timeout`` and the ``gang_run_timeout`` ini option (and their deprecated aliases)."""
    help_text = f"default seconds a @pytest.mark.gang test body may run (default {DEFAULT_RUN_TIMEOUT:g})"
    group = parser.getgroup("gang", "distributed tests on real local processes")
    parser.addini(_RUN_TIMEOUT, help_text, default="")
    group.addoption("--gang-run-timeout", type=float, default=None, dest=_RUN_TIMEOUT, help=help_text)
    for old, new in _DEPRECATED.items():
        parser.addini(old, f"deprecated: use {new}", default="")
        group.addoption(f"--{old.replace('_', '-')}", type=float, default=None, dest=old, help=f"deprecated: --{new}")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (so ``--strict-markers`` accepts it); warn of a deprecated option."""
    config.addinivalue_line(
        "markers",
        "gang(world_size, timeout=None): run the test body, whose first parameter is `gang`, on "
        "`world_size` real local gloo processes (a list of sizes parametrizes the test).",
    )
    for old, new in _DEPRECATED.items():
        if config.getoption(old) is not None or config.getini(old):
            warning = pytest.PytestDeprecationWarning(
                f"`{old}` (`--{old.replace('_', '-')}`) is deprecated: it is the run timeout of a test body, "
                f"now `{new}` (`--{new.replace('_', '-')}`)."
            )
            config.issue_config_time_warning(warning, stacklevel=2)


def _default_run_timeout(config: pytest.Config) -> float:
    """The seconds a ``@pytest.mark.gang`` body without ``timeout=`` may run.

    The first set of: ``--gang-run-timeout``, ``--gang-timeout`` (deprecated), the
    ``gang_run_timeout`` ini option, ``gang_timeout`` (deprecated); else
    :data:`gang.testing.DEFAULT_RUN_TIMEOUT`.
    """
    for name in (_RUN_TIMEOUT, *_DEPRECATED):
        option = config.getoption(name)
        if option is not None:
            return float(option)
    for name in (_RUN_TIMEOUT, *_DEPRECATED):
        value = config.getini(name)
        if value:
            return float(value)
    return DEFAULT_RUN_TIMEOUT


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop every process the plugin started (the shared worlds of :func:`gang.testing.shared_world`)."""
    close_shared_worlds()


def _usage_error(message: str) -> NoReturn:
    """Fail the collection of the test (no process is started) with ``message`` alone."""
    pytest.fail(message, pytrace=False)


def _world_sizes(marker: pytest.Mark, where: str) -> list[int]:
    if marker.args:
        _usage_error(f"{where}: pass `world_size` to `@pytest.mark.gang` by keyword.")
    unknown = set(marker.kwargs) - {"world_size", "timeout"}
    if unknown:
        _usage_error(
            f"{where}: `@pytest.mark.gang` takes `world_size` and `timeout`, but got {sorted(unknown)} as well."
        )
    if "world_size" not in marker.kwargs:
        _usage_error(f"{where}: `@pytest.mark.gang` needs `world_size`, e.g. `@pytest.mark.gang(world_size=2)`.")
    value = marker.kwargs["world_size"]
    sizes = list(value) if isinstance(value, (list, tuple)) else [value]
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        _usage_error(
            f"{where}: `world_size` must be a positive `int` or a non-empty list of them, but is {value!r} instead."
        )
    timeout = marker.kwargs.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        _usage_error(f"{where}: `timeout` must be a positive number of seconds, but is {timeout!r} instead.")
    return sizes


def _parameters(function: Callable[..., Any], in_class: bool) -> list[str]:
    names = list(inspect.signature(function).parameters)
    return names[1:] if in_class and names else names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Check the marker and the signature; parametrize ``gang`` over a list of world sizes."""
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    where = metafunc.definition.nodeid
    sizes = _world_sizes(marker, where)
    names = _parameters(metafunc.function, metafunc.cls is not None)
    if not names or names[0] != FIXTURE:
        _usage_error(
            f"{where}: a test marked `@pytest.mark.gang` takes the gang as its first parameter, named `gang`, "
            f"but its parameters are {names}."
        )
    if isinstance(marker.kwargs["world_size"], (list, tuple)):
        metafunc.parametrize(FIXTURE, sizes, indirect=True, ids=[f"world_size={s}" for s in sizes])


@pytest.fixture(name=FIXTURE)
def _gang_fixture(request: pytest.FixtureRequest) -> GangSlot:
    """The gang of a ``@pytest.mark.gang`` test (a placeholder here; a real gang on each rank)."""
    marker = request.node.get_closest_marker(MARKER)
    if marker is None:
        pytest.fail(
            f"{request.node.nodeid}: the `gang` fixture exists only for tests marked "
            "`@pytest.mark.gang(world_size=N)`, whose bodies run on N processes.",
            pytrace=False,
        )
    size = getattr(request, "param", None)
    return GangSlot(size if size is not None else _world_sizes(marker, request.node.nodeid)[0])


def _target(item: pytest.Function) -> _Target:
    function = inspect.unwrap(getattr(item.obj, "__func__", item.obj))
    qualname = getattr(function, "__qualname__", "")
    module = item.module
    path = getattr(module, "__file__", None) if module is not None else None
    if module is None or not path:
        pytest.fail(f"{item.nodeid}: a `@pytest.mark.gang` test must live in a module file.", pytrace=False)
    if "<locals>" in qualname.split("."):
        pytest.fail(
            f"{item.nodeid}: a `@pytest.mark.gang` test must be defined at module level (or in a class at module "
            f"level) so that every rank can find it by name, but it is `{qualname}`.",
            pytrace=False,
        )
    return _Target(module.__name__, str(path), qualname, function.__code__.co_firstlineno)


def _pickled_arguments(item: pytest.Function, names: list[str]) -> bytes:
    arguments = {name: item.funcargs[name] for name in names if name != FIXTURE}
    for name, value in arguments.items():
        try:
            pickle.dumps(value)
        except Exception as ex:
            problem = f"{type(ex).__name__}: {ex}"
        else:
            continue
        pytest.fail(
            f"{item.nodeid}: `{name}` ({type(value).__module__}.{type(value).__qualname__}) cannot be sent to the "
            f"ranks: it does not pickle ({problem}). The fixtures and parameters of a `@pytest.mark.gang` test are "
            "computed in the pytest process and sent to every rank by pickle; create such objects inside the test "
            "body instead.",
            pytrace=False,
        )
    return pickle.dumps(arguments)


def _timeout(item: pytest.Function, marker: pytest.Mark) -> float:
    timeout = marker.kwargs.get("timeout")
    if timeout is not None:
        return float(timeout)
    return _default_run_timeout(item.config)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run the body of a ``@pytest.mark.gang`` test on every rank of a world of its size."""
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    slot = pyfuncitem.funcargs[FIXTURE]
    assert isinstance(slot, GangSlot), slot
    size = slot.world_size
    timeout = _timeout(pyfuncitem, marker)
    names = list(pyfuncitem._fixtureinfo.argnames)  # the test's own parameters, as pytest passes them
    blob = _pickled_arguments(pyfuncitem, names)
    target = _target(pyfuncitem)
    world = shared_world(size)
    failure = None
    try:
        results = world.run(_run_on_rank, target, blob, timeout=timeout)
    except TimeoutError:
        world.close(force=True)
        failure = (
            f"{pyfuncitem.nodeid} ran past its timeout of {timeout:g} s on {size} ranks; every rank was stopped "
            "(raise it with `@pytest.mark.gang(..., timeout=SECONDS)` or `--gang-run-timeout`)."
        )
    except WorkerDiedError as ex:
        world.close(force=True)
        failure = f"{pyfuncitem.nodeid}: {ex}"
    except BaseException as ex:
        # A rank failed, or the run was interrupted (Ctrl-C, pytest-timeout) while the ranks were running.
        world.close(force=True)
        cause = ex.__cause__
        if not isinstance(cause, RemoteTraceback):
            raise
        failure = (
            f"{type(ex).__name__} on rank {cause.rank} of {size}: {ex}\n\n"
            f"Traceback on rank {cause.rank}:\n{_without_plumbing(cause.text)}"
        )
    if failure is not None:
        # Outside the `except` blocks, so that the report is the rank's traceback alone.
        pytest.fail(failure, pytrace=False)
    skipped = [result for result in results if isinstance(result, _Skipped)]
    if skipped:
        raise pytest.skip.Exception(skipped[0].reason, _use_item_location=True)
    return True


def _without_plumbing(text: str) -> str:
    """Drop the frames of this plugin and of :mod:`gang.testing` from a formatted traceback."""
    plumbing = {f'  File "{__file__}"', f'  File "{testing.__file__}"'}
    lines: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("  File "):
            skipping = line.split(",", 1)[0] in plumbing
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            lines.append(line)
    return "\n".join(lines)


def _run_on_rank(gang: Any, target: _Target, blob: bytes) -> _Skipped | None:
    """Run the test body on one rank (in a worker process)."""
    try:
        function = _find_test(target)
        arguments = pickle.loads(blob)
        try:
            function(**{FIXTURE: gang}, **arguments)
        except pytest.skip.Exception as ex:
            return _Skipped(str(ex.msg))
        return None
    finally:
        # Output of the body lands in pytest's capture of this test, not in a later one.
        sys.stdout.flush()
        sys.stderr.flush()


def _find_test(target: _Target) -> Callable[..., Any]:
    module = _load_module(target.module, target.path)
    owner: Any = module
    parts = target.qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
        if isinstance(owner, type):
            owner = owner()  # pytest calls test methods on a fresh instance too
    function = getattr(owner, parts[-1], None)
    found = inspect.unwrap(getattr(function, "__func__", function)) if function is not None else None
    if found is None or getattr(getattr(found, "__code__", None), "co_firstlineno", None) != target.lineno:
        raise LookupError(
            f"`{target.qualname}` of {target.path} (line {target.lineno}) cannot be found by name in the worker "
            "processes: a `@pytest.mark.gang` test must be a function (or method) that its module binds to its "
            "own name at import time, not one generated or rebound later."
        )
    assert function is not None
    return function  # type: ignore[no-any-return]


def _load_module(name: str, path: str) -> types.ModuleType:
    """Load the test module from its file under pytest's name for it (assertions rewritten), once per process."""
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "") or "").resolve() == Path(path).resolve():
        return module
    for parent in _parents(name):
        if parent in sys.modules:
            continue
        try:
            importlib.import_module(parent)
        except ImportError:
            # pytest's importlib mode names modules after their folders without making those importable.
            sys.modules[parent] = types.ModuleType(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load the test module {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    source = Path(path).read_bytes()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path)
    except ImportError:  # a pytest without it: plain assertions
        pass
    code = compile(tree, path, "exec", dont_inherit=True)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])
