"""Run on every rank by ``test_fsdp_parity.py``: train on our mesh and on ``init_device_mesh``'s."""

from __future__ import annotations

from typing import Any

from gang import Gang, Gangs, create_fsdp_gangs, create_parallel_gangs
from gang_mesh import fsdp_mesh, to_device_mesh
from gang_mesh.parity import equivalent_init_mesh, train

# Each layout's gangs are created once per worker and kept for the life of the world.
_GANGS: dict[tuple[int, int, int | None, int], Gangs] = {}


def _gangs(root: Gang, tp: int, intra: int | None, cp: int) -> Gangs:
    key = (id(root), tp, intra, cp)
    if key not in _GANGS:
        _GANGS[key] = create_fsdp_gangs(create_parallel_gangs(root, tp_size=tp, cp_size=cp), intra)
    return _GANGS[key]


def parity(
    root: Gang, dims: tuple[str, ...] | None, tp: int, intra: int | None, steps: int, cp: int = 1
) -> dict[str, Any]:
    """Losses on the mesh of ``dims`` (``None``: :func:`fsdp_mesh`) and on the equivalent init mesh."""
    gangs = _gangs(root, tp, intra, cp)
    ours = fsdp_mesh(gangs) if dims is None else to_device_mesh(gangs, dims)
    names = ours.mesh_dim_names
    assert names is not None
    reference = equivalent_init_mesh(names, ours.shape)
    assert reference.mesh.tolist() == ours.mesh.tolist()
    return {
        "names": names,
        "ours": train(ours, steps=steps).losses,
        "reference": train(reference, steps=steps).losses,
    }
