"""The pytest plugin (``@pytest.mark.gang``), run by pytest in real subprocesses through ``pytester``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# The plugin is registered by gang's `pytest11` entry point; `-p` also loads it where gang is on
# the path without being installed (it is then not loaded twice: the entry point has the same name).
PLUGIN = ("-p", "gang.pytest_plugin", "-p", "no:cacheprovider", "--strict-markers")

BODIES = '''
import os
import pytest
import torch
from gang import ReduceOperation


class Box:
    """A parameter whose class lives in the test module: it must unpickle on every rank."""

    def __init__(self, value):
        self.value = value


@pytest.fixture
def base():
    return 10


@pytest.fixture
def unpicklable():
    return lambda: None


@pytest.mark.gang(world_size=[1, 2])
@pytest.mark.parametrize("box", [Box(1), Box(3)], ids=["one", "three"])
def test_sum(gang, base, box, tmp_path):
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    with open(os.environ["PIDS"] + ".server", "a") as f:  # the fork server the worker was forked from
        f.write(f"{os.getppid()}\\n")
    t = torch.tensor([float(gang.rank + base * box.value)])
    gang.all_reduce(t, ReduceOperation.SUM)
    n = gang.size
    assert t.item() == n * base * box.value + n * (n - 1) / 2


@pytest.mark.gang(world_size=2)
def test_fails_on_rank_one(gang):
    values = [gang.rank, 7]
    gang.barrier()
    assert values[0] == 0


@pytest.mark.gang(world_size=2, timeout=2)
def test_hangs(gang):
    if gang.rank == 1:
        gang.barrier()  # rank 0 never joins


@pytest.mark.gang(world_size=2)
def test_unpicklable(gang, unpicklable):
    pass


@pytest.mark.gang(world_size=2)
def test_skipped(gang):
    pytest.skip("not on this machine")


class TestInClass:
    @pytest.mark.gang(world_size=2)
    def test_method(self, gang):
        print(f"output of rank {gang.rank}")
        assert gang.size == 2
'''


def _worker_pids(path: Path) -> set[int]:
    return {int(line) for line in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_outcomes_tracebacks_timeouts_and_no_orphans(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    pytester.makepyfile(test_bodies=BODIES)
    monkeypatch.setenv("PIDS", str(pids))  # the workers write their process ids there
    result = pytester.runpytest_subprocess(*PLUGIN, "-rA", "-s")
    # The fork server the workers were forked from was stopped (and reaped) before pytest exited.
    (server,) = _worker_pids(Path(f"{pids}.server"))
    assert not _alive(server)
    result.assert_outcomes(passed=5, failed=3, skipped=1)
    out = result.stdout.str()
    # Parametrized by world size, with the parameters' own ids.
    result.stdout.fnmatch_lines(["PASSED *test_sum?world_size=1-one?", "PASSED *test_sum?world_size=2-three?"])
    # The failing rank's own traceback, with the rewritten assertion, and not the plugin's plumbing.
    result.stdout.fnmatch_lines(
        [
            "*AssertionError on rank 1 of 2: assert 1 == 0*",
            "Traceback on rank 1:",
            '  File "*test_bodies.py", line *, in test_fails_on_rank_one',
            "    assert values[0] == 0",
        ]
    )
    assert "pytest_plugin.py" not in out and "testing.py" not in out
    result.stdout.fnmatch_lines(["*test_hangs ran past its timeout of 2 s on 2 ranks; every rank was stopped*"])
    result.stdout.fnmatch_lines(["*`unpicklable` (*function) cannot be sent to the ranks: it does not pickle*"])
    result.stdout.fnmatch_lines(["SKIPPED ?1? test_bodies.py:*: not on this machine"])
    assert "output of rank 0" in out and "output of rank 1" in out
    # Every worker process is gone once pytest has exited.
    workers = _worker_pids(pids)
    assert len(workers) == 3  # one process for world_size=1, two for world_size=2 (reused by both params)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)


def test_usage_errors_are_reported_before_any_process_starts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_first_param="""
        import pytest

        @pytest.mark.gang(world_size=2)
        def test_wrong_first(x, gang):
            pass
        """,
        test_bad_size="""
        import pytest

        @pytest.mark.gang(world_size=0)
        def test_zero(gang):
            pass
        """,
        test_no_marker="""
        def test_plain(gang):
            pass
        """,
    )
    # One pytest run for the three files (each pytest subprocess imports torch): the first two fail
    # at collection, which would end the run before the third's setup error without
    # `--continue-on-collection-errors`; `-rE` names where each error came from.
    files = ("test_first_param.py", "test_bad_size.py", "test_no_marker.py")
    result = pytester.runpytest_subprocess(*PLUGIN, "-rE", "--continue-on-collection-errors", *files)
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(
        ["*takes the gang as its first parameter, named `gang`, but its parameters are ?'x', 'gang'?.*"]
    )
    result.stdout.fnmatch_lines(["*`world_size` must be a positive `int` or a non-empty list of them, but is 0*"])
    result.stdout.fnmatch_lines(["*the `gang` fixture exists only for tests marked `@pytest.mark.gang(world_size=N)`*"])
    result.stdout.fnmatch_lines(["ERROR test_first_param.py - *", "ERROR test_bad_size.py - *"])
    result.stdout.fnmatch_lines(["ERROR test_no_marker.py::test_plain - *"])


def test_importlib_mode_and_nested_folders(pytester: pytest.Pytester) -> None:
    # --import-mode=importlib names the module after its folders (`tests.deep.test_deep`) without
    # making it importable; the workers load it from its file under that name.
    pytester.mkpydir("mypkg")
    pytester.path.joinpath("mypkg", "shapes.py").write_text("def square(x):\n    return x * x\n")
    deep = pytester.mkdir("tests") / "deep"
    deep.mkdir()
    (deep / "test_deep.py").write_text(
        "import pytest\n"
        "from mypkg.shapes import square\n\n"
        "@pytest.mark.gang(world_size=2)\n"
        "def test_helper_and_name(gang):\n"
        "    assert square(gang.rank + 1) == [1, 4][gang.rank]\n"
        "    assert __name__.endswith('test_deep'), __name__\n"
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--import-mode=importlib", "-v")
    result.assert_outcomes(passed=1)


def test_run_timeout_options_and_their_deprecated_names(pytester: pytest.Pytester) -> None:
    # `gang_run_timeout` bounds a test body; `gang_timeout`, its former name (a gang's timeout is
    # that of its collectives, as in `World`), still works with a deprecation warning.
    pytester.makepyfile(
        test_timeouts="""
        from gang.pytest_plugin import _default_run_timeout

        def test_print(request):
            print(f"RUN_TIMEOUT={_default_run_timeout(request.config):g}")
        """
    )
    pytester.makeini("[pytest]\ngang_run_timeout = 9\n")
    result = pytester.runpytest_subprocess(*PLUGIN, "-s", "-W", "error::pytest.PytestDeprecationWarning")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*RUN_TIMEOUT=9*"])
    result = pytester.runpytest_subprocess(*PLUGIN, "-s", "--gang-timeout", "6")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*RUN_TIMEOUT=6*", "*PytestDeprecationWarning: `gang_timeout` (`--gang-timeout`)*"])
