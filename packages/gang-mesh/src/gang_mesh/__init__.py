"""gang_mesh: use :class:`~gang.Gangs` with torch's ``DeviceMesh`` (FSDP2, HSDP, DTensor tensor parallel).

:func:`to_device_mesh` turns gangs into a mesh that reuses their process groups,
:func:`fsdp_mesh` picks the mesh ``fully_shard`` wants, and :func:`from_device_mesh` turns a mesh
(from ``init_device_mesh``, torchtitan, or :func:`to_device_mesh`) back into gangs.
"""

from __future__ import annotations

import importlib.metadata

from gang.roles import ROLES  # The `Gangs` fields `to_device_mesh` accepts in `dims`.
from gang.topology import MESH_ROLES  # The roles a mesh dimension can play.
from gang_mesh.from_mesh import ALIASES, from_device_mesh
from gang_mesh.to_mesh import GangDeviceMesh, fsdp_mesh, to_device_mesh

try:
    __version__ = importlib.metadata.version("gang-mesh")
    """The installed distribution's version (``gang-mesh`` in ``pyproject.toml``, its one source)."""
except importlib.metadata.PackageNotFoundError:  # a source tree on ``sys.path`` that was never installed
    __version__ = "0+unknown"

__all__ = ["ALIASES", "GangDeviceMesh", "MESH_ROLES", "ROLES", "from_device_mesh", "fsdp_mesh", "to_device_mesh"]
