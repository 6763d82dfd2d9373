"""Every workflow of the monorepo: tests, lint, typecheck, docs, demo, bench.

Every session installs through ``constraints.txt`` (torch==2.13.0 is the local CPU wheel; a looser
requirement would pull a multi-GB CUDA build) and installs our own packages from their folders in
one pip call. Their distributions are ``gang-core``, ``gang-mesh`` and ``gang-jax`` (import names
``gang``, ``gang_mesh``, ``gang_jax``): the name ``gang`` on the registry is an unrelated project.

The sessions that need every package (typecheck, tests, launchers, docs) share one environment,
made fresh once per nox run: torch and JAX are installed once, not once per session. ``plugin``
(gang alone, as a user's project has it), ``demo``, ``bench`` and ``lint`` have their own.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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

# `packages` runs the first three targets of `tests` side by side; `tests` runs any one of them.
nox.options.sessions = ["lint", "typecheck", "packages", "tests(target='integration')", "launchers", "plugin", "docs"]
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
SHARED_TOOLS = ("pytest", "pytest-timeout", "mypy", "nox", "matplotlib", "sphinx", "furo")
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
        local = [arg for name in PACKAGES for arg in ("-e", str(ROOT / "packages" / name))]
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


@nox.session(venv_backend="none")
@nox.parametrize("target", TEST_TARGETS)
def tests(session: nox.Session, target: str) -> None:
    """Run one package's tests (or the cross-package tests in ``tests/``) on real local processes."""
    shared(session)
    share_jax_compilations(session)
    pytest = [str(SHARED_BIN / "pytest"), "-p", "no:cacheprovider"]
    if target != "integration":
        session.run(*pytest, str(ROOT / "packages" / target / "tests"), *session.posargs)
        return
    # The `launchers` and `ray` sessions run theirs.
    tests = [str(ROOT / "tests"), "--ignore", str(LAUNCHER_TESTS), "--ignore", str(RAY_TESTS)]
    if session.posargs:
        session.run(*pytest, *tests, *session.posargs)
        return
    # Two halves of about equal length, side by side: each keeps about one core busy (its processes
    # mostly take turns), so together they use the two cores of the CI machine.
    # Measured alone on an idle machine: tests/ft about 210 s, the rest about 240 s, of which
    # test_debug_mode.py about 22 s; it runs in the first half.
    ft, debug = ROOT / "tests" / "ft", ROOT / "tests" / "reliability" / "test_debug_mode.py"
    halves = {
        "tests/ft, debug mode": [[*pytest, str(ft), str(debug)]],
        "the other tests": [[*pytest, *tests, "--ignore", str(ft), "--ignore", str(debug)]],
    }
    run_side_by_side(session, halves, env={})


@nox.session(venv_backend="none")
def packages(session: nox.Session) -> None:
    """Every package's own tests (``tests`` with each package as the target), side by side.

    Each package's pytest keeps about one core busy, so they run :data:`LANES` at a time (see
    :func:`run_side_by_side`): ``gang`` in one lane, ``gang-mesh`` then ``gang-jax`` in the other.
    """
    shared(session)
    share_jax_compilations(session)
    pytest = [str(SHARED_BIN / "pytest"), "-p", "no:cacheprovider"]
    suites = {name: [*pytest, str(ROOT / "packages" / name / "tests"), *session.posargs] for name in PACKAGES}
    lanes = {"gang": [suites["gang"]], "gang-mesh, gang-jax": [suites["gang-mesh"], suites["gang-jax"]]}
    run_side_by_side(session, lanes, env={})


LAUNCHER_TESTS = ROOT / "tests" / "launchers"
LAUNCHER_PACKAGES = ("slurm-wlm", "munge", "openmpi-bin")


@nox.session(venv_backend="none")
def launchers(session: nox.Session) -> None:
    """The real launchers: a SLURM cluster on localhost (srun, sbatch), mpirun, two-node torchrun.

    Needs slurm-wlm, munge and Open MPI. When they are missing they are installed with apt-get
    only if asked (``nox -s launchers -- --install``, or ``CI=true``); otherwise the session is
    skipped. The tests start and stop their own SLURM daemons (see ``tests/launchers``).
    """
    posargs = [arg for arg in session.posargs if arg != "--install"]
    asked = "--install" in session.posargs or os.environ.get("CI") == "true"
    sbin = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    programs = ("srun", "sbatch", "slurmctld", "slurmd", "munged", "mpirun")
    missing = [program for program in programs if not shutil.which(program, path=sbin)]
    if missing and not asked:
        session.skip(
            f"{', '.join(missing)} not installed; `nox -s launchers -- --install` (or CI=true) "
            f"runs `apt-get install {' '.join(LAUNCHER_PACKAGES)}`"
        )
    if missing:
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        apt = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run(*sudo, "apt-get", "update", "-q", env=apt)
        session.run(*sudo, "apt-get", "install", "-y", "-q", *LAUNCHER_PACKAGES, env=apt)
    shared(session)
    env = {"GANG_REQUIRE_LAUNCHERS": "1", "OMP_NUM_THREADS": "1"}
    session.run(str(SHARED_BIN / "pytest"), str(LAUNCHER_TESTS), "-p", "no:cacheprovider", *posargs, env=env)


@nox.session
def plugin(session: nox.Session) -> None:
    """A user's project tested through gang's pytest plugin: ``examples/plugin-project``.

    Installs gang from its folder (which registers the plugin through its ``pytest11`` entry point),
    then the example project, and runs the project's own pytest from its folder, so that its own
    ``pyproject.toml`` configures pytest and nothing of this repository's test set-up is loaded.
    """
    project = ROOT / "examples" / "plugin-project"
    # One pip call; the project editable, so that no build/ copy of it is left in the tree.
    install(session, "pytest", "-e", str(project), packages=["gang"])
    session.chdir(project)
    session.run("pytest", "tests", "-p", "no:cacheprovider", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package, the examples, the benchmarks and every test folder."""
    shared(session)
    mypy = str(SHARED_BIN / "mypy")
    sources = [ROOT / "packages" / name / "src" for name in PACKAGES]
    session.run(
        mypy,
        *map(str, sources),
        str(ROOT / "examples"),
        str(ROOT / "benchmarks"),
        str(ROOT / "noxfile.py"),
        str(ROOT / "conftest.py"),
    )
    # Test folders import their helper modules (`*_workers.py`) by name: pytest finds them through
    # its `pythonpath` setting and mypy through its `mypy_path` (both in the root pyproject.toml).
    test_folders = [ROOT / "packages" / name / "tests" for name in PACKAGES] + [ROOT / "tests"]
    session.run(mypy, *map(str, test_folders))


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Build the Sphinx site warning-free, run its doctests, and run every example.

    Two lanes side by side (see :func:`run_side_by_side`): the html and doctest builds (the doctest
    build reads the pages the html build pickled) and then every second example, and the other
    examples.
    """
    shared(session)  # sphinx, furo, and pytest (the API reference documents the pytest plugin)
    build = ROOT / "docs" / "_build"
    sphinx = [str(SHARED_BIN / "sphinx-build"), "-W", "--keep-going", "-d", str(build / "doctrees")]
    builds = [[*sphinx, "-b", builder, "docs", str(build / builder)] for builder in ("html", "doctest")]
    examples = [
        [str(SHARED_BIN / "python"), str(example)]
        for example in sorted((ROOT / "examples").glob("*.py"))
        if not example.name.startswith("_")
    ]
    lanes = {"sphinx, examples": builds + examples[1::2], "examples": examples[::2]}
    run_side_by_side(session, lanes, env={"OMP_NUM_THREADS": "1"})


LANES = 2
"""How many jobs :func:`run_side_by_side` runs at once: the cores of the CI machine.

Each job given to it keeps about one core busy on its own (CPU seconds about equal to its wall
seconds, measured with ``/usr/bin/time``), so two of them use the machine without crowding it.
"""


def run_side_by_side(session: nox.Session, jobs: dict[str, list[list[str]]], *, env: dict[str, str]) -> None:
    """Run ``jobs`` (each a list of commands, run one after another) at most :data:`LANES` at a time.

    A job's output is printed whole when the job ends, so that outputs never interleave. After every
    job has ended, the session fails if a command failed (a failing command ends its own job).
    """
    full_env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}, **env}
    lock = threading.Lock()

    def run(name: str) -> bool:
        start = time.monotonic()
        for command in jobs[name]:
            done = subprocess.run(command, env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            with lock:
                session.log(f"[{name}] {shlex.join(command)}")
                print(done.stdout.decode(errors="replace"), end="", flush=True)
            if done.returncode != 0:
                with lock:
                    session.log(f"[{name}] failed with exit status {done.returncode}")
                return False
        with lock:
            session.log(f"[{name}] done in {time.monotonic() - start:.0f} s")
        return True

    with ThreadPoolExecutor(max_workers=LANES) as pool:
        outcomes = dict(zip(jobs, pool.map(run, jobs), strict=True))
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


@nox.session
def ray(session: nox.Session) -> None:
    """A gang inside Ray Train's ``TorchTrainer`` on a local Ray cluster (loopback, 2 CPU workers).

    Not in the default sessions (``ray[train]``, pinned in ``constraints.txt``, is a large install);
    ``.ci/run`` runs it after them. The test gives Ray its token and a temporary folder, so nothing is
    written under the home directory.
    """
    install(session, "pytest", "pytest-timeout", "ray[train]", packages=["gang", "gang-mesh"])
    session.run("pytest", str(RAY_TESTS), "-p", "no:cacheprovider", *session.posargs, env={"OMP_NUM_THREADS": "1"})


# The versions users run (`nox -s versions`, not in CI's run): the newest this machine installs and
# the lowest the packages declare (their pyproject.toml's lower bounds are exactly these). torch
# 2.13 is the first with `ProcessGroup.all_gather_single` and `reduce_scatter_single`, which
# ProcessGroupGang calls directly (torch 2.10 and 2.12 lack them; 2.10 failed the suites). JAX 0.8.1
# is the first whose `jax.distributed.initialize` takes `shutdown_timeout_seconds` (0.6.2 lacks
# `heartbeat_timeout_seconds` too; both failed gang-jax's tests).
VERSIONS = {
    "newest": ("torch==2.14.1", "jax==0.10.2", "jaxlib==0.10.2"),
    "lowest": ("torch==2.13.0", "jax==0.8.1", "jaxlib==0.8.1"),
}
# A representative subset of the suites (about a third of bare nox's test time): every package's
# own tests, FSDP2 parity (FSDP2's private hooks), and fault tolerance with its process group (DDP's
# and autograd's hooks). Left out: the conformance table, reliability (dead peers), the quorum's
# and healing's own tests, launchers. `nox -s versions -- PATHS` runs other tests instead.
VERSION_TESTS = {
    "gang": ["packages/gang/tests"],
    "gang-mesh, gang-jax, FSDP2, fault tolerance": [
        "packages/gang-mesh/tests",
        "packages/gang-jax/tests",
        "tests/test_fsdp_parity.py",
        "tests/ft/test_ft.py",
        "tests/ft/test_ft_process_group.py",
    ],
}


@nox.session
@nox.parametrize("pins", list(VERSIONS))
def versions(session: nox.Session, pins: str) -> None:
    """The suites (:data:`VERSION_TESTS`) on the newest torch installed here and the lowest torch and JAX declared.

    ``nox -s "versions(pins='lowest')"`` runs one. The torch and JAX pins of ``constraints.txt`` are
    replaced by :data:`VERSIONS`' (torch 2.14.1 is a CUDA build, with its CUDA libraries about
    3 GB, that runs on the CPU; the lowest torch is the CI's CPU build).
    """
    replaced = {pin.split("==")[0] for pin in VERSIONS[pins]}
    kept = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.split("==")[0] not in replaced]
    constraints = Path(session.create_tmp()).resolve() / "constraints.txt"
    constraints.write_text("\n".join([*kept, *VERSIONS[pins]]) + "\n")
    session.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    local = [arg for name in PACKAGES for arg in ("-e", str(ROOT / "packages" / name))]
    session.install("-c", str(constraints), *local, *VERSIONS[pins], "pytest", "pytest-timeout")
    session.run("python", "-c", OURS, silent=True)
    session.run("python", "-c", "import torch, jax; print('torch', torch.__version__, 'jax', jax.__version__)")
    share_jax_compilations(session)
    pytest = [str(Path(session.bin) / "python"), "-m", "pytest", "-p", "no:cacheprovider"]
    if session.posargs:
        session.run(*pytest, *session.posargs)
        return
    lanes = {name: [[*pytest, *suites]] for name, suites in VERSION_TESTS.items()}
    run_side_by_side(session, lanes, env={})


@nox.session
def bench(session: nox.Session) -> None:
    """Collective and overhead benchmarks (not in the default sessions): ``nox -s bench -- --quick --out results.json``.

    Runs ``python -m gang.bench --nproc N`` (the benchmark that ships in the package) for 2 and 4
    ranks, then the repository-only benchmarks (8-rank set-up, FakeGang); writes the JSON rows to
    ``--out`` and the PNG plots next to it. See ``docs/performance.rst``.
    """
    install(session, "matplotlib", packages=["gang", "gang-mesh", "gang-jax"])
    session.run("python", "-m", "benchmarks.run", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # Fault tolerance (3 replica processes + the store); TORCHFT_PYTHON adds the torchft comparison.
    session.run("python", "-m", "benchmarks.ft", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # Healing a 1 GiB state (2 processes) against a raw gloo broadcast of the same bytes.
    session.run("python", "-m", "benchmarks.ft_heal", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # The gang.ft quorum with 4 to 256 replicas against one store.
    session.run("python", "-m", "benchmarks.ft_quorum", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    # HSDP across fault-tolerant replicas (2 of 2 processes) against a static mesh; TORCHFT_PYTHON adds torchft.
    session.run("python", "-m", "benchmarks.ft_hsdp", *session.posargs, env={"OMP_NUM_THREADS": "1"})


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
