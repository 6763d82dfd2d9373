"""Draw one layout as a torch mesh and as a JAX mesh, side by side, for the JAX guide (``docs/jax.rst``).

Run ``python -m benchmarks.mesh_pictures`` to write ``docs/_static/one_layout.png``. It starts 8
local processes (torch gloo and JAX in each), builds the gangs of ``rdp`` 2 x ``sdp`` 2 x ``tp`` 2
with the factories and asks both bridges for their mesh: :func:`gang_mesh.to_device_mesh` (global
ranks) and :func:`gang_jax.to_jax_mesh` (JAX devices). The picture is what they return, read on
rank 0.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from benchmarks.layout_pictures import output_path, save
from gang import Gang, create_fsdp_gangs, create_parallel_gangs
from gang.testing import World

DIMS = ("rdp", "sdp", "tp")
OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "_static" / "one_layout.png"


def meshes(root: Gang) -> dict[str, Any]:
    """Both bridges' meshes of ``DIMS`` on this process (run on every rank of the world)."""
    from gang_jax import JaxGang, to_jax_mesh
    from gang_mesh import to_device_mesh

    jax_root = JaxGang.create_default()
    gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=2), 2)
    torch_mesh = to_device_mesh(gangs, DIMS)
    jax_mesh = to_jax_mesh(gangs, DIMS)
    devices = jax_mesh.devices
    result = {
        "torch": torch_mesh.mesh.tolist(),
        "torch_names": torch_mesh.mesh_dim_names,
        "processes": np.vectorize(lambda d: d.process_index, otypes=[int])(devices).tolist(),
        "ids": np.vectorize(lambda d: d.id, otypes=[int])(devices).tolist(),
        "jax_names": jax_mesh.axis_names,
    }
    jax_root.close()
    return result


def draw(found: dict[str, Any], output: Path) -> None:
    """Two panels: each mesh as rows of ``rdp`` and columns of (``sdp``, ``tp``), one colour per ``tp`` gang."""
    plt.switch_backend("Agg")
    torch_ranks = np.array(found["torch"])
    processes = np.array(found["processes"])
    ids = np.array(found["ids"])
    rdp, sdp, tp = torch_ranks.shape
    colour = np.arange(rdp * sdp).reshape(rdp, sdp, 1).repeat(tp, axis=2).reshape(rdp, sdp * tp)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [
        (f"torch DeviceMesh {found['torch_names']}\n(to_device_mesh: global ranks)", torch_ranks, None),
        (f"JAX Mesh {found['jax_names']}\n(to_jax_mesh: devices)", processes, ids),
    ]
    for ax, (title, ranks, device_ids) in zip(axes, panels, strict=True):
        ax.imshow(colour % 20, cmap=plt.get_cmap("tab20"), vmin=0, vmax=19)
        flat = ranks.reshape(rdp, sdp * tp)
        for row in range(rdp):
            for column in range(sdp * tp):
                if device_ids is None:
                    label = f"rank {flat[row, column]}"
                else:
                    label = f"process {flat[row, column]}\ndevice {device_ids.reshape(rdp, sdp * tp)[row, column]}"
                ax.text(column, row, label, ha="center", va="center", fontsize=9)
        ax.set_xticks(range(sdp * tp), [f"sdp {c // tp}\ntp {c % tp}" for c in range(sdp * tp)], fontsize=8)
        ax.set_yticks(range(rdp), [f"rdp {r}" for r in range(rdp)], fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle("One Gangs layout (8 processes, rdp 2 x sdp 2 x tp 2) in both frameworks: one colour per tp gang")
    save(fig, output)


def main() -> None:
    """Parse ``--output``, ask both bridges on 8 local processes, and draw."""
    output = output_path(__doc__ or "", OUTPUT)
    with World(8, env={"OMP_NUM_THREADS": "1"}) as world:
        found = world.run(meshes)[0]
    draw(found, output)


if __name__ == "__main__":
    # The processes unpickle `meshes` by module name: run it from the module, not from `__main__`.
    importlib.import_module("benchmarks.mesh_pictures").main()
