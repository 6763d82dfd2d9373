"""The three packages as a user gets them: ``nox -s build`` installs their wheels into a fresh
environment and runs this file there with pytest, from a folder outside the repository.

Its name does not match pytest's ``test_*.py``, so the repository's own test sessions skip it; it
needs the installed wheels (not the source folders) and the pytest plugin their entry point
registers.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

import pytest
import torch

import gang as gang_core
import gang_jax
import gang_mesh
from gang import Gang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs

DISTRIBUTIONS: dict[str, ModuleType] = {"gang-core": gang_core, "gang-mesh": gang_mesh, "gang-jax": gang_jax}


@pytest.mark.parametrize("distribution", list(DISTRIBUTIONS))
def test_each_package_comes_from_its_installed_wheel(distribution: str) -> None:
    module = DISTRIBUTIONS[distribution]
    assert module.__version__ == importlib.metadata.version(distribution) != "0+unknown"
    assert module.__file__ is not None and "site-packages" in Path(module.__file__).parts, module.__file__
    files = {str(path) for path in importlib.metadata.files(distribution) or []}
    assert f"{module.__name__}/py.typed" in files, sorted(files)


def test_the_entry_points_are_registered() -> None:
    assert "gang.pytest_plugin" in {point.name for point in entry_points(group="pytest11")}
    assert "jax" in {point.name for point in entry_points(group="gang.bench")}


@pytest.mark.gang(world_size=2)
def test_the_plugin_runs_the_body_on_two_processes(gang: Gang) -> None:
    t = torch.ones(1)
    gang.all_reduce(t, ReduceOperation.SUM)
    assert t.item() == 2.0
    mesh = gang_mesh.fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(gang)))
    assert (mesh.mesh_dim_names, mesh.size()) == (("sdp",), 2)


@pytest.mark.parametrize(
    ("command", "expected"),
    [(["pytest", "--help"], "--gang-run-timeout"), (["gang.bench", "--help"], "--nproc")],
)
def test_the_command_lines(command: list[str], expected: str) -> None:
    done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, check=True)
    assert expected in done.stdout, done.stdout
