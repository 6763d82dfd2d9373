"""Every workflow of the monorepo: tests, lint, typecheck, docs, demo, bench.

Every session installs through ``constraints.txt`` (torch==2.13.0 is the local CPU wheel; a looser
requirement would pull a multi-GB CUDA build) and installs our own packages from their folders in
one pip call. Their distributions are ``gang-core``, ``gang-mesh`` and ``gang-jax`` (import names
``gang``, ``gang_mesh``, ``gang_jax``): the name ``gang`` on the registry is an unrelated project.

The sessions that need every package (all, typecheck, tests, launchers, docs) share one
environment, made fresh once per nox run: torch and JAX are installed once, not once per session.
``plugin`` (gang alone, as a user's project has it), ``demo``, ``bench`` and ``lint`` have their own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))

# A package joins the suite by appearing here (its folder under packages/). Ours are installed from
# their folders (`nox -s build` from their wheels).
PACKAGES = ("gang", "gang-mesh", "gang-jax")
# Each folder's distribution (its `name` in pyproject.toml; `gang` on the registry is not ours).
DISTRIBUTIONS = {"gang": "gang-core", "gang-mesh": "gang-mesh", "gang-jax": "gang-jax"}
# Each package's tests, and the cross-package tests in tests/.
TEST_TARGETS = [*PACKAGES, "integration"]

# Bare `nox`: lint, then `all` (typecheck, every package's tests, the cross-package tests but the
# slow ones, the plugin project and the docs' site as jobs on two lanes). Each of those has its own
# session too: `packages` runs the first three targets of `tests` side by side; `tests` runs any one.
nox.options.sessions = ["lint", "all"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True


def install(session: nox.Session, *extra: str, packages: list[str] | None = None) -> None:
    """Install our packages (editable, from their folders) and ``extra`` under the constraints."""
    session.env["PIP_NO_COMPILE"] = "1"
    session.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    names = list(PACKAGES) if packages is None else packages
    local = [arg for name in names for arg in ("-e", str(ROOT / "packages" / name))]
    session.install(*CONSTRAINTS, *local, *extra)
    session.run("python", "-c", OURS, silent=True)


# Proves that the `gang` imported is ours, from this checkout (an editable install of `gang-core`).
OURS = (
    "import gang, importlib.metadata as m, pathlib; "
    "assert gang.__version__ == m.version('gang-core'), gang.__version__; "
    f"assert pathlib.Path(gang.__file__).is_relative_to({str(ROOT)!r}), gang.__file__"
)


SHARED = ROOT / ".nox" / "shared"
SHARED_BIN = SHARED / ("Scripts" if os.name == "nt" else "bin")
SHARED_TOOLS = ("pytest", "pytest-timeout", "mypy", "nox", "matplotlib", "sphinx", "furo", "optax")
PLUGIN_PROJECT = ROOT / "examples" / "plugin-project"
_shared_made = False


def shared(session: nox.Session) -> None:
    """Run ``session`` in the shared environment (every package and tool), made on first use in this run.

    The session's commands are then called by path (``SHARED_BIN / name``), and its ``PATH`` starts
    with the environment's ``bin`` so the processes the tests start find the same programs.
    """
    global _shared_made
    if not _shared_made:
        shutil.rmtree(SHARED, ignore_errors=True)
        session.run(sys.executable, "-m", "virtualenv", "-q", str(SHARED))
        # The plugin's example project too (editable, so that no build/ copy is left in the tree):
        # `all` runs its tests here; `nox -s plugin` in an environment holding gang alone.
        local = [
            arg
            for path in [*(ROOT / "packages" / name for name in PACKAGES), PLUGIN_PROJECT]
            for arg in ("-e", str(path))
        ]
        env = {"PIP_NO_COMPILE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        session.run(str(SHARED_BIN / "python"), "-m", "pip", "install", *CONSTRAINTS, *local, *SHARED_TOOLS, env=env)
        session.run(str(SHARED_BIN / "python"), "-c", OURS, silent=True)
        _shared_made = True
    session.env["VIRTUAL_ENV"] = str(SHARED)
    session.env["PATH"] = os.pathsep.join([str(SHARED_BIN), os.environ.get("PATH", "")])


JAX_CACHE = ROOT / ".nox" / "jax-cache"
_jax_cache_made = False


def share_jax_compilations(session: nox.Session) -> None:
    """Let the JAX processes of this run's test sessions share compiled programs through JAX's cache.

    Many worlds of JAX processes compile the same programs (the conformance worlds, the isolated
    engines, the fault tests); with a persistent compilation cache (emptied once per nox run) a
    later process loads a program an earlier one compiled. JAX reads these variables at import.
    """
    global _jax_cache_made
    if not _jax_cache_made:
        shutil.rmtree(JAX_CACHE, ignore_errors=True)
        _jax_cache_made = True
    session.env["JAX_COMPILATION_CACHE_DIR"] = str(JAX_CACHE)
    session.env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    session.env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


class Step(NamedTuple):
    """One command of a job: its arguments, the folder it runs in and the variables it adds."""

    argv: list[str]
    cwd: Path = ROOT
    env: Mapping[str, str] = MappingProxyType({})


Jobs = dict[str, list[Step]]
"""Jobs by name, each a list of steps run one after another (see :func:`run_side_by_side`)."""

PYTEST = [str(SHARED_BIN / "pytest"), "-p", "no:cacheprovider"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def integration_jobs() -> Jobs:
    """The cross-package tests in four jobs (``tests/launchers``, ``tests/frameworks`` and
    ``tests/hosts`` are the `launchers`, `ray` and `hosts` sessions'): the fault-tolerance tests
    (``tests/ft``), the dead-peer scenarios, which mostly wait (see :data:`BESIDE`), the
    conformance table and the other tests. Bare ``nox`` runs the last two (:func:`all_checks`);
    ``nox -s slow`` the first two (see :data:`SLOW_JOBS`)."""
    tests = [str(ROOT / "tests"), *(arg for path in OWN_SESSION_TESTS for arg in ("--ignore", str(path)))]
    ft = ROOT / "tests" / "ft"
    dead_peers = [str(ROOT / "tests" / "reliability" / name) for name in DEAD_PEER_TESTS]
    conformance = ROOT / "tests" / "test_conformance.py"
    # Node ids as pytest writes them (from the root, where the jobs run): `--deselect` compares those.
    hung = [f"{conformance.relative_to(ROOT)}::{test}" for test in CONFORMANCE_DEAD_PEERS]
    others = [arg for path in [ft, conformance, *dead_peers] for arg in ("--ignore", str(path))]
    return {
        "tests/ft": [Step([*PYTEST, str(ft)])],
        "conformance": [Step([*PYTEST, str(conformance), *(arg for test in hung for arg in ("--deselect", test))])],
        "the other tests": [Step([*PYTEST, *tests, *others])],
        "dead peers": [Step([*PYTEST, *dead_peers, *hung])],
    }


SLOW_JOBS = ("tests/ft", "dead peers")
"""The jobs of :func:`integration_jobs` that bare ``nox`` leaves to ``nox -s slow`` (with the
launchers): the fault-tolerance scenarios and the dead peers, whose processes mostly wait for
timeouts, heartbeats and restarts. ``.ci/run`` runs ``slow`` right after bare ``nox``."""


# The scenarios in which a peer dies or hangs and the others wait for their gang's timeout (or JAX's
# heartbeat) to notice: each starts its own processes, which are mostly asleep.
DEAD_PEER_TESTS = ("test_process_group_faults.py", "test_jax_faults.py", "test_trace.py")
# The conformance table's rows of that kind (a peer late past the timeout, a receive nobody sends:
# each entry's world waits about 17 s for its timeout); the `conformance` job leaves them out.
CONFORMANCE_DEAD_PEERS = ("test_hung_peer", "test_receive_nobody_sends")


def package_jobs(posargs: list[str]) -> Jobs:
    """Every package's own tests: ``gang`` alone, ``gang-mesh`` then ``gang-jax`` (about equal).

    ``test_torchtitan.py`` is the ``titan`` session's (:data:`TITAN_TESTS`), left out here rather
    than skipped for want of torchtitan."""
    own = ("--ignore", str(TITAN_TESTS))
    suites = {name: Step([*PYTEST, str(ROOT / "packages" / name / "tests"), *own, *posargs]) for name in PACKAGES}
    return {"gang": [suites["gang"]], "gang-mesh, gang-jax": [suites["gang-mesh"], suites["gang-jax"]]}


def typecheck_jobs() -> Jobs:
    """mypy --strict over every package, the examples, the benchmarks, then every test folder."""
    mypy = str(SHARED_BIN / "mypy")
    sources = [ROOT / "packages" / name / "src" for name in PACKAGES]
    others = [ROOT / "examples", ROOT / "benchmarks", ROOT / "noxfile.py", ROOT / "conftest.py"]
    # Test folders import their helper modules (`*_workers.py`) by name: pytest finds them through
    # its `pythonpath` setting and mypy through its `mypy_path` (both in the root pyproject.toml).
    test_folders = [ROOT / "packages" / name / "tests" for name in PACKAGES] + [ROOT / "tests"]
    return {"typecheck": [Step([mypy, *map(str, [*sources, *others])]), Step([mypy, *map(str, test_folders)])]}


def docs_jobs() -> Jobs:
    """The html and doctest builds (the doctest build reads the pages the html build pickled)."""
    build = ROOT / "docs" / "_build"
    sphinx = [str(SHARED_BIN / "sphinx-build"), "-W", "--keep-going", "-d", str(build / "doctrees")]
    return {"sphinx": [Step([*sphinx, "-b", b, "docs", str(build / b)], env=ONE_THREAD) for b in ("html", "doctest")]}


def example_jobs() -> Jobs:
    """Every example (``examples/*.py``) in two jobs of about equal time: every second one, the others."""
    examples = [
        Step([str(SHARED_BIN / "python"), str(example)], env=ONE_THREAD)
        for example in sorted((ROOT / "examples").glob("*.py"))
        if not example.name.startswith("_")
    ]
    return {"examples": examples[::2], "examples, second half": examples[1::2]}


LAUNCHER_TESTS = ROOT / "tests" / "launchers"
LAUNCHER_PACKAGES = ("slurm-wlm", "munge", "openmpi-bin")


def launcher_jobs(session: nox.Session, posargs: list[str]) -> Jobs:
    """The real-launcher tests, after installing their programs with apt-get if asked; none
    (with one line saying why) when they are missing and not asked for."""
    asked = "--install" in posargs or os.environ.get("CI") == "true"
    sbin = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    programs = ("srun", "sbatch", "slurmctld", "slurmd", "munged", "mpirun")
    missing = [program for program in programs if not shutil.which(program, path=sbin)]
    if missing and not asked:
        session.log(
            f"launchers skipped: {', '.join(missing)} not installed; `nox -s launchers -- --install` "
            f"(or CI=true) runs `apt-get install {' '.join(LAUNCHER_PACKAGES)}`"
        )
        return {}
    if missing:
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        apt = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run(*sudo, "apt-get", "update", "-q", env=apt, external=True)
        session.run(*sudo, "apt-get", "install", "-y", "-q", *LAUNCHER_PACKAGES, env=apt, external=True)
    args = [arg for arg in posargs if arg != "--install"]
    env = {"GANG_REQUIRE_LAUNCHERS": "1", **ONE_THREAD}
    return {"launchers": [Step([*PYTEST, str(LAUNCHER_TESTS), *args], env=env)]}


def plugin_jobs(pytest: list[str]) -> Jobs:
    """The plugin project's own pytest, run from its folder with ``pytest`` (so that its own
    ``pyproject.toml`` configures pytest and nothing of this repository's test set-up is loaded)."""
    return {"plugin project": [Step([*pytest, "tests", "-p", "no:cacheprovider"], cwd=PLUGIN_PROJECT, env=ONE_THREAD)]}


# What each job of `all` took on a fresh clone of the 2-core machine with nothing else running
# (seconds, as `CI=true bash .ci/run` reports them): `all` starts the longest
# first, so that the short ones fill the lanes at the end. A job of BESIDE starts at once whatever
# its place here (`dead peers` mostly waits on timeouts: about 50 CPU s).
MEASURED = {
    "tests/ft": 310,
    "conformance": 284,
    "the other tests": 150,
    "dead peers": 250,
    "sphinx": 39,
    "gang": 74,
    "gang-mesh, gang-jax": 87,
    "launchers": 85,
    "examples": 95,
    "examples, second half": 75,
    "typecheck": 36,
    "plugin project": 6,
}


@nox.session(venv_backend="none", name="all")
def all_checks(session: nox.Session) -> None:
    """Typecheck, every package's tests, the cross-package tests but the slow ones, the plugin
    project and the docs' site: one pool of jobs on :data:`LANES` lanes, the longest first (bare
    ``nox`` runs it after ``lint``; ``nox -s slow`` runs the rest, the examples included).

    The same jobs as the sessions ``typecheck``, ``packages``, ``tests(target='integration')`` (less
    :data:`SLOW_JOBS`), ``plugin`` and ``docs`` (less its examples), in one environment (the shared one; the plugin
    project is installed there too, where ``nox -s plugin`` gives it an environment holding gang
    alone). One pool instead of five sessions in a row: no lane waits for the other's last job of a
    session.
    """
    shared(session)
    share_jax_compilations(session)
    jobs: Jobs = {
        **typecheck_jobs(),
        **package_jobs([]),
        **{name: steps for name, steps in integration_jobs().items() if name not in SLOW_JOBS},
        **plugin_jobs([str(SHARED_BIN / "pytest")]),
        **docs_jobs(),
    }
    order = sorted(jobs, key=lambda name: -MEASURED.get(name, 0))
    run_side_by_side(session, {name: jobs[name] for name in order})


@nox.session(venv_backend="none")
def slow(session: nox.Session) -> None:
    """The suites bare ``nox`` leaves out because they mostly wait: the fault-tolerance tests
    (``tests/ft``), the dead-peer scenarios (beside the lanes) and the real launchers (see
    :func:`launchers`), side by side; and in the time their processes leave to the CPU, every example
    (:func:`example_jobs`). ``.ci/run`` runs it right after bare ``nox``."""
    shared(session)
    share_jax_compilations(session)
    every = integration_jobs()
    jobs = {
        **{name: every[name] for name in SLOW_JOBS},
        **launcher_jobs(session, session.posargs),
        **example_jobs(),
    }
    run_side_by_side(session, dict(sorted(jobs.items(), key=lambda job: -MEASURED.get(job[0], 0))))


@nox.session(venv_backend="none")
@nox.parametrize("target", TEST_TARGETS)
def tests(session: nox.Session, target: str) -> None:
    """Run one package's tests (or the cross-package tests in ``tests/``) on real local processes."""
    shared(session)
    share_jax_compilations(session)
    if target != "integration":
        session.run(*PYTEST, str(ROOT / "packages" / target / "tests"), *session.posargs)
        return
    if session.posargs:
        tests = [str(ROOT / "tests"), *(arg for path in OWN_SESSION_TESTS for arg in ("--ignore", str(path)))]
        session.run(*PYTEST, *tests, *session.posargs)
        return
    # Two halves side by side: each keeps about one core busy (its processes mostly take turns),
    # so together they use the two cores of the CI machine; the dead-peer scenarios beside them.
    run_side_by_side(session, integration_jobs())


@nox.session(venv_backend="none")
def packages(session: nox.Session) -> None:
    """Every package's own tests (``tests`` with each package as the target), side by side.

    Each package's pytest keeps about one core busy, so they run :data:`LANES` at a time (see
    :func:`run_side_by_side`): ``gang`` in one lane, ``gang-mesh`` then ``gang-jax`` in the other.
    """
    shared(session)
    share_jax_compilations(session)
    run_side_by_side(session, package_jobs(session.posargs))


@nox.session(venv_backend="none")
def launchers(session: nox.Session) -> None:
    """The real launchers: a SLURM cluster on localhost (srun, sbatch), mpirun, two-node torchrun.

    Needs slurm-wlm, munge and Open MPI. When they are missing they are installed with apt-get
    only if asked (``nox -s launchers -- --install``, or ``CI=true``); otherwise the session is
    skipped. The tests start and stop their own SLURM daemons (see ``tests/launchers``).
    """
    shared(session)
    jobs = launcher_jobs(session, session.posargs)
    if not jobs:
        session.skip("the launchers are not installed (see above)")
    run_side_by_side(session, jobs)


@nox.session
def plugin(session: nox.Session) -> None:
    """A user's project tested through gang's pytest plugin: ``examples/plugin-project``.

    Installs gang alone from its folder (which registers the plugin through its ``pytest11`` entry
    point), then the example project, and runs the project's own pytest from its folder, so that its
    own ``pyproject.toml`` configures pytest and nothing of this repository's test set-up is loaded.
    """
    # One pip call; the project editable, so that no build/ copy of it is left in the tree.
    install(session, "pytest", "-e", str(PLUGIN_PROJECT), packages=["gang"])
    session.chdir(PLUGIN_PROJECT)
    session.run("pytest", "tests", "-p", "no:cacheprovider", *session.posargs, env=ONE_THREAD)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check, and no history of the repository's making in its text (:func:`history`)."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    found = history()
    if found:
        session.error(
            "The docs and code describe the product; its history belongs in git and the CHANGELOG. "
            "Reword these lines:\n" + "\n".join(found)
        )


HISTORY = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(st|nd|rd|th)"
    r"|this|last|earlier|previous|next)\s+sessions?\b",
    re.IGNORECASE,
)
"""A session of work named by its rank (an ordinal) or as "this", "last", "earlier", "previous" or "next" one."""
HISTORY_ALLOWED = re.compile(r"nox session|pytest session|session\(|session\.|scope=.session", re.IGNORECASE)
"""Sessions of nox and pytest, which are product terms (checked on the lines of a match)."""
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DATED = re.compile(
    rf"\b20\d\d-[01]\d-[0-3]\d\b|\b(?:{MONTHS})\s+(?:[0-3]?\d,?\s+)?20\d\d\b|\b[0-3]?\d\s+(?:{MONTHS})\b"
)
"""A date (ISO, YYYY-MM-DD; a day and a month's name; a month's name and a year, with or without its
day), the mark of a dated run log, in any file but the CHANGELOG."""


def history(root: Path = ROOT) -> list[str]:
    """The places in the tracked ``.rst``, ``.md`` and ``.py`` files that log how the repository was built.

    Each as ``path:line: text`` (the lines of the match, which may span a line break): a numbered or
    "this/last/..." session (nox and pytest sessions aside), or a date outside ``CHANGELOG.md``.
    """
    listed = subprocess.run(
        ["git", "ls-files", "*.rst", "*.md", "*.py"], cwd=root, capture_output=True, text=True, check=True
    )
    found = []
    for name in listed.stdout.splitlines():
        path = root / name
        if not path.is_file():  # deleted in the work tree
            continue
        text = path.read_text(errors="replace")
        patterns = [HISTORY] if name == "CHANGELOG.md" else [HISTORY, DATED]
        for match in (m for pattern in patterns for m in pattern.finditer(text)):
            first = text.rfind("\n", 0, match.start()) + 1
            last = text.find("\n", match.end())
            lines = text[first : len(text) if last < 0 else last]
            if match.re is HISTORY and HISTORY_ALLOWED.search(lines):
                continue
            found.append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {' '.join(lines.split())}")
    return found


@nox.session(venv_backend="none")
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package, the examples, the benchmarks and every test folder."""
    shared(session)
    run_side_by_side(session, typecheck_jobs())


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Build the Sphinx site warning-free, run its doctests, and run every example.

    Side by side (see :func:`run_side_by_side`): the html and doctest builds, and the examples in two
    halves (:func:`example_jobs`; bare ``nox`` builds the site, ``nox -s slow`` runs the examples).
    """
    shared(session)  # sphinx, furo, and pytest (the API reference documents the pytest plugin)
    run_side_by_side(session, {**docs_jobs(), **example_jobs()})


LANES = 2
"""How many jobs :func:`run_side_by_side` runs at once, besides those of :data:`BESIDE`: the cores of the CI machine.

Each job given to it keeps about one core busy on its own (CPU seconds about equal to its wall
seconds, measured with ``/usr/bin/time``), so two of them use the machine without crowding it.
"""

BESIDE = frozenset({"dead peers", "replicas' process group"})
"""The jobs that mostly wait, which :func:`run_side_by_side` runs from the start beside the lanes.

The dead-peer scenarios (:data:`DEAD_PEER_TESTS`) wait for gang timeouts and JAX's heartbeat:
measured with ``/usr/bin/time`` on the 2-core machine they used a quarter to a third of a core (51
CPU seconds in 219 s of wall time under a load average of 15 to 18; 49 in 136 s under 8 to 12). In
a lane they would hold it idle; beside the lanes they use what the other jobs leave. So does the
replicas' process group of ``nox -s versions`` (:data:`VERSION_TESTS`: DDP and FSDP2 across replicas
under kills, restarts and a new replica, three tests that wait for processes to start and heal).
"""


def run_side_by_side(session: nox.Session, jobs: Jobs) -> None:
    """Run ``jobs`` at most :data:`LANES` at a time, in their order: a free lane takes the next job.

    A job named in :data:`BESIDE` takes no lane: it starts at once, beside them. A job's steps run one
    after another; its output is printed whole when the job ends, so that outputs never interleave,
    with each step's time. After every job has ended, the session fails if a step failed (a failing
    step ends its own job).
    """
    base_env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}}
    lock = threading.Lock()

    def run(name: str) -> bool:
        start = time.monotonic()
        for step in jobs[name]:
            began = time.monotonic()
            done = subprocess.run(
                step.argv, env={**base_env, **step.env}, cwd=step.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            with lock:
                session.log(f"[{name}] {shlex.join(step.argv)} ({time.monotonic() - began:.0f} s)")
                print(done.stdout.decode(errors="replace"), end="", flush=True)
            if done.returncode != 0:
                with lock:
                    session.log(f"[{name}] failed with exit status {done.returncode}")
                return False
        with lock:
            session.log(f"[{name}] done in {time.monotonic() - start:.0f} s")
        return True

    beside = [name for name in jobs if name in BESIDE]
    laned = [name for name in jobs if name not in BESIDE]
    with ThreadPoolExecutor(max_workers=max(1, len(beside))) as extra, ThreadPoolExecutor(max_workers=LANES) as pool:
        waiting = {name: extra.submit(run, name) for name in beside}
        outcomes = dict(zip(laned, pool.map(run, laned), strict=True))
        outcomes.update((name, future.result()) for name, future in waiting.items())
    failed = [name for name, ok in outcomes.items() if not ok]
    if failed:
        session.error(f"failed: {', '.join(failed)}")


WHEEL_CHECKS = ROOT / "tests" / "wheels" / "check_wheels.py"


@nox.session
def build(session: nox.Session) -> None:
    """Build the sdist and wheel of each package as a user gets them, check them, install and test them.

    ``python -m build`` (sdist, then the wheel from the sdist) into ``.nox/dist``, ``twine check
    --strict`` on their metadata, then a fresh environment with only the wheels (and their
    dependencies, under the constraints) runs ``tests/wheels/check_wheels.py`` from a folder outside
    the repository: imports from site-packages, versions, the pytest plugin's entry point (a test
    body on 2 processes, ``pytest --help``), ``python -m gang.bench --help``.
    """
    session.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    session.install(*CONSTRAINTS, "build", "twine")
    out = ROOT / ".nox" / "dist"
    shutil.rmtree(out, ignore_errors=True)
    for name in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(out), str(ROOT / "packages" / name), silent=True)
    built = sorted(str(path) for path in out.iterdir())
    expected = {DISTRIBUTIONS[name].replace("-", "_") for name in PACKAGES}
    for suffix in (".tar.gz", "-py3-none-any.whl"):
        found = {Path(path).name.split("-")[0] for path in built if path.endswith(suffix)}
        if found != expected:
            session.error(f"expected {sorted(expected)} as *{suffix}, built {built}")
    session.run("twine", "check", "--strict", *built)

    user = Path(session.create_tmp()).resolve() / "user"
    shutil.rmtree(user, ignore_errors=True)
    (user / "project").mkdir(parents=True)
    session.run(sys.executable, "-m", "virtualenv", "-q", str(user / "venv"), external=True)
    python = str(user / "venv" / ("Scripts" if os.name == "nt" else "bin") / "python")
    wheels = [path for path in built if path.endswith(".whl")]
    session.run(python, "-m", "pip", "install", "-q", *CONSTRAINTS, *wheels, "pytest", external=True)
    shutil.copy(WHEEL_CHECKS, user / "project")
    # The project's own pytest.ini: pytest looks no further up for configuration or conftest.py, so
    # nothing of this checkout configures it; --strict-markers fails unless the plugin registered `gang`.
    (user / "project" / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    session.chdir(user / "project")  # nothing of this checkout on sys.path
    pytest = [python, "-m", "pytest", WHEEL_CHECKS.name, "-p", "no:cacheprovider", "-q"]
    session.run(*pytest, env={"OMP_NUM_THREADS": "1"}, external=True)


RAY_TESTS = ROOT / "tests" / "frameworks"
HOSTS_TESTS = ROOT / "tests" / "hosts"
OWN_SESSION_TESTS = (LAUNCHER_TESTS, RAY_TESTS, HOSTS_TESTS)
"""The folders of ``tests/`` that their own sessions run (``launchers``, ``ray``, ``hosts``), not ``tests``."""


@nox.session(venv_backend="none")
def hosts(session: nox.Session) -> None:
    """Multi-node code on test hosts: network namespaces on one machine (:mod:`gang.testing_hosts`).

    Not in the default sessions (it needs root and ``ip``; elsewhere every test skips with one line
    saying why); ``.ci/run`` runs it after them. In the shared environment, as ``launchers``: two-node
    torchrun, fault-tolerant replicas and JAX across hosts, and the harness's own containment and
    fault tests.
    """
    shared(session)
    share_jax_compilations(session)
    session.run(*PYTEST, str(HOSTS_TESTS), *session.posargs, env=ONE_THREAD)


@nox.session
def ray(session: nox.Session) -> None:
    """A gang inside Ray Train's ``TorchTrainer`` on a local Ray cluster (loopback, 2 CPU workers).

    Not in the default sessions (``ray[train]``, pinned in ``constraints.txt``, is a large install);
    ``.ci/run`` runs it after them. The test gives Ray its token and a temporary folder, so nothing is
    written under the home directory.
    """
    install(session, "pytest", "pytest-timeout", "ray[train]", packages=["gang", "gang-mesh"])
    session.run("pytest", str(RAY_TESTS), "-p", "no:cacheprovider", *session.posargs, env={"OMP_NUM_THREADS": "1"})


TITAN_TESTS = ROOT / "packages" / "gang-mesh" / "tests" / "test_torchtitan.py"


@nox.session
def titan(session: nox.Session) -> None:
    """torchtitan's own ``ParallelDims`` meshes through ``gang_mesh``: a real client checks the mesh bridge.

    Not in the default sessions (torchtitan pulls in ``datasets``, ``wandb``, ``tensorboard`` and
    more); ``.ci/run`` runs it after them. Installs torchtitan 0.3.0 (pinned in ``constraints.txt``
    with torch 2.13.0) next to gang and gang-mesh, then runs ``test_torchtitan.py``, where
    ``GANG_REQUIRE_TORCHTITAN=1`` makes a missing torchtitan fail instead of skipping.
    """
    install(session, "pytest", "pytest-timeout", "torchtitan", packages=["gang", "gang-mesh"])
    session.run(
        "python",
        "-c",
        "import torch, importlib.metadata as m; print('torch', torch.__version__, "
        "'torchtitan', m.version('torchtitan'))",
    )
    env = {"GANG_REQUIRE_TORCHTITAN": "1", **ONE_THREAD}
    session.run("pytest", str(TITAN_TESTS), "-p", "no:cacheprovider", *session.posargs, env=env)


# The versions users run (`nox -s versions`; `.ci/run` runs it after bare `nox`): the newest torch on
# the registry and the lowest torch and JAX the packages declare (their pyproject.toml's lower bounds
# are exactly these). torch 2.11 lacks `ProcessGroup.all_gather_single`, `reduce_scatter_single` and
# `all_to_all_single` (2.13 added them): gangs then call the public `torch.distributed` functions
# (see gang._torch_groups.SINGLE_COLLECTIVES). JAX 0.8.1 is the first whose
# `jax.distributed.initialize` takes `shutdown_timeout_seconds` (0.6.2 lacks
# `heartbeat_timeout_seconds` too; both failed gang-jax's tests).
VERSIONS = {
    "newest": ("torch==2.15.0", "jax==0.10.2", "jaxlib==0.10.2"),
    "lowest": ("torch==2.11.0", "jax==0.8.1", "jaxlib==0.8.1"),
}
# Neither torch lies on this machine's disk, whose pip configuration caps torch at what does (2.14.1):
# their install alone reads no pip configuration (PIP_CONFIG_FILE=/dev/null), so pip takes them from
# the registry as a user's pip would (CUDA builds, with their CUDA libraries about 3 GB each, that run
# on the CPU; pip's cache keeps them for the next run).
REGISTRY_ONLY = {"PIP_CONFIG_FILE": os.devnull}
# The suites that meet torch's and JAX's API: every package's own tests, FSDP2 parity (FSDP2's
# private hooks), and DDP and FSDP2 across fault-tolerant replicas (`ReplicaProcessGroup`, DDP's and
# autograd's hooks, under kills, restarts and a new replica). Left out, as they reach torch only
# through what these test: the conformance table, reliability (dead peers), the rest of tests/ft
# (the quorum, healing, DiLoCo), launchers. `nox -s versions -- PATHS` runs other tests instead.
# Three jobs: the replicas' process group mostly waits (for kills, restarts and heals), so it runs
# beside the lanes (see BESIDE).
VERSION_TESTS = {
    "gang": ["packages/gang/tests"],
    "gang-mesh, gang-jax, FSDP2": ["packages/gang-mesh/tests", "packages/gang-jax/tests", "tests/test_fsdp_parity.py"],
    "replicas' process group": ["tests/ft/test_ft_process_group.py"],
}


@nox.session
@nox.parametrize("pins", list(VERSIONS))
def versions(session: nox.Session, pins: str) -> None:
    """The suites (:data:`VERSION_TESTS`) on the newest torch on the registry and the lowest torch and JAX declared.

    ``nox -s "versions(pins='lowest')"`` runs one. The torch and JAX pins of ``constraints.txt`` are
    replaced by :data:`VERSIONS`', installed from the registry past this machine's pip configuration
    (:data:`REGISTRY_ONLY`, for this install alone). ``nox --install-only -s versions`` makes the
    two environments and runs nothing; ``nox -R -s versions`` then runs the suites in them without
    installing again (``.ci/run`` installs them while ``slow`` runs).
    """
    replaced = {pin.split("==")[0] for pin in VERSIONS[pins]}
    kept = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.split("==")[0] not in replaced]
    constraints = Path(session.create_tmp()).resolve() / "constraints.txt"
    constraints.write_text("\n".join([*kept, *VERSIONS[pins]]) + "\n")
    session.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    local = [arg for name in PACKAGES for arg in ("-e", str(ROOT / "packages" / name))]
    session.install("-c", str(constraints), *local, *VERSIONS[pins], "pytest", "pytest-timeout", env=REGISTRY_ONLY)
    if session.run("python", "-c", OURS, silent=True) is None:
        return  # `nox --install-only` (nox skips every `session.run`): the environment is made, nothing runs
    session.run("python", "-c", "import torch, jax; print('torch', torch.__version__, 'jax', jax.__version__)")
    share_jax_compilations(session)
    pytest = [str(Path(session.bin) / "python"), "-m", "pytest", "-p", "no:cacheprovider"]
    if session.posargs:
        session.run(*pytest, *session.posargs)
        return
    own = ("--ignore", str(TITAN_TESTS))  # torchtitan 0.3.0 is pinned with torch 2.13: the `titan` session's
    run_side_by_side(session, {name: [Step([*pytest, *suites, *own])] for name, suites in VERSION_TESTS.items()})


EXIT_STRESS = ROOT / "tests" / "reliability" / "exit_stress.py"


@nox.session(venv_backend="none", name="exit_stress")
def exit_stress(session: nox.Session) -> None:
    """Start, use and exit gangs 25 times per launcher path under CPU load; fail on any abort at exit.

    The long version of ``tests/reliability/test_exit.py`` (not in the default sessions nor in
    ``.ci/run``): ``tests/reliability/exit_stress.py --runs 25 --load 2`` in the shared environment,
    on torchrun, plain environment variables and, where installed, mpirun. ``nox -s exit_stress --
    --runs 100`` runs more.
    """
    shared(session)
    args = session.posargs or ["--runs", "25", "--load", "2"]
    session.run(str(SHARED_BIN / "python"), str(EXIT_STRESS), *args, env=ONE_THREAD)


@nox.session
def bench(session: nox.Session) -> None:
    """Collective and overhead benchmarks (not in the default sessions): ``nox -s bench -- --quick --out results.json``.

    Runs ``python -m gang.bench --nproc N`` (the benchmark that ships in the package) for 2 and 4
    ranks, then the repository-only benchmarks (8-rank set-up, FakeGang); writes the JSON rows to
    ``--out`` and the PNG plots next to it. See ``docs/performance.rst``.
    """
    install(session, "matplotlib", "optax", packages=["gang", "gang-mesh", "gang-jax"])
    session.run("python", "-m", "benchmarks.run", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # Fault tolerance (3 replica processes + the store); TORCHFT_PYTHON adds the torchft comparison.
    session.run("python", "-m", "benchmarks.ft", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # Healing a 1 GiB state (2 processes) against a raw gloo broadcast of the same bytes.
    session.run("python", "-m", "benchmarks.ft_heal", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # The gang.ft quorum with 4 to 256 replicas against one store.
    session.run("python", "-m", "benchmarks.ft_quorum", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # HSDP across fault-tolerant replicas (2 of 2 processes) against a static mesh; TORCHFT_PYTHON adds torchft.
    session.run("python", "-m", "benchmarks.ft_hsdp", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # LocalSGD and (streaming) DiLoCo on 3 replicas: time and bytes per outer step, the overlap of a
    # delayed exchange, recovery; TORCHFT_PYTHON adds torchft's LocalSGD and DiLoCo side by side.
    session.run("python", "-m", "benchmarks.ft_diloco", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # DiLoCo for JAX models against DiLoCo for torch modules, both in the same 3 replica processes.
    session.run("python", "-m", "benchmarks.ft_diloco_jax", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # What recording one operation costs: gang's flight recorder against torch's own.
    session.run("python", "-m", "benchmarks.recorder_cost", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # What quantizing DiLoCo's exchange costs in quality (one process, about a minute of CPU): JSON and a PNG.
    session.run("python", "-m", "benchmarks.ft_diloco_quality", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """The main job, on 4 local CPU ranks launched by torchrun: a tour of the gangs and every
    collective, FSDP2 + tensor-parallel training through ``to_device_mesh``, and torch vs JAX; then
    fault-tolerant training on 3 replica processes, one killed and restarted, the same with HSDP
    (3 replicas of 2 processes), and streaming DiLoCo over 3 replicas, one killed and restarted."""
    install(session)
    for script in ("demo/tour.py", "fsdp_tp_training.py", "jax_vs_torch.py"):
        session.run(
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "4",
            str(ROOT / "examples" / script),
            env={"OMP_NUM_THREADS": "1"},
            external=False,
        )
    # Fault tolerance: 3 replica processes and the store, one replica killed and restarted; then
    # HSDP over 3 replicas of 2 processes, one process killed and its replica restarted.
    session.run("python", str(ROOT / "examples" / "demo" / "fault_tolerance.py"), env={"OMP_NUM_THREADS": "1"})
