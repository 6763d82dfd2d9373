"""Pure rank arithmetic: named grids of ranks and the gangs they define.

Nothing in this package communicates or touches ``torch.distributed``. It is three modules, one
idea each, re-exported here:

* :mod:`gang.topology.grid`, the grid engine: :class:`Grid` (a row-major grid of named
  dimensions: coordinates, the groups of some dimensions, the sub-grid through a rank, and
  :meth:`Grid.place`, which lays gathered coordinates out on it), views of one grid checked to
  agree (:func:`check_views`) and the grid that dimensions of several views span
  (:meth:`Grid.spanning`);
* :mod:`gang.topology.layout`, the role layouts: a :class:`Layout` is the one grid of ranks seen
  through the views of :data:`gang.roles.VIEWS` (dense and expert), in closed form; the
  factories split gangs along it (:func:`parallel_layout`);
* :mod:`gang.topology.meshes`, the mesh-naming rules both mesh bridges use (``gang_mesh`` for
  torch's ``DeviceMesh``, ``gang_jax`` for JAX's ``Mesh``): :func:`mesh_dims` checks the
  dimensions asked for, :func:`mesh_roles` gives each dimension's role, :func:`mesh_spans` which
  dimensions make up each gang (with :func:`role_spans`), and :func:`mesh_layout` the layout of a
  whole mesh.

What has no layout finds its grid with :meth:`Grid.place`: :meth:`Gangs.flatten
<gang.Gangs.flatten>` and ``gang_mesh.to_device_mesh`` of gangs without a layout, from every
process's gathered coordinates; ``gang_mesh.from_device_mesh`` reads a mesh as a :class:`Grid` of
its dimensions.

Vocabulary: a grid's *dimensions* are ``(name, size)`` pairs; when the names are roles of
:class:`~gang.Gangs` (the table in :mod:`gang.roles`) each dimension's groups are that role's
gangs.
"""

from gang.topology.grid import Grid, check_views, partition_key
from gang.topology.layout import Layout, flattened_axes, parallel_grid, parallel_layout, sharded_grid
from gang.topology.meshes import (
    MESH_ALIASES,
    MESH_ROLES,
    MeshDim,
    mesh_dims,
    mesh_layout,
    mesh_roles,
    mesh_spans,
    role_spans,
)

__all__ = [
    "MESH_ALIASES",
    "MESH_ROLES",
    "Grid",
    "Layout",
    "MeshDim",
    "check_views",
    "flattened_axes",
    "mesh_dims",
    "mesh_layout",
    "mesh_roles",
    "mesh_spans",
    "parallel_grid",
    "parallel_layout",
    "partition_key",
    "role_spans",
    "sharded_grid",
]
