"""gang: one object for the processes that run collectives together.

Pass a :class:`Gangs` around instead of scattered ``torch.distributed`` calls; run the same code
on one CPU with :class:`FakeGang`, on local processes, or on a cluster with
:class:`ProcessGroupGang`.
"""

from __future__ import annotations

import importlib.metadata

from gang.env import (
    get_default_device,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_world_size,
)
from gang.errors import (
    GangError,
    InvalidOperationError,
    NotSupportedError,
    OperationalError,
    raise_operational_gang_error,
)
from gang.factories import (
    create_default_gang,
    create_fake_gangs,
    create_fsdp_gangs,
    create_parallel_gangs,
    split_along,
)
from gang.fake import FakeGang
from gang.gang import Gang, ReduceOperation
from gang.gangs import Gangs, maybe_get_current_gangs
from gang.helpers import all_gather_objects, all_reduce_dict, all_sum, broadcast_flag, exchange_rows
from gang.process_group_gang import ProcessGroupGang
from gang.topology import Grid
from gang.work import Work

try:
    __version__ = importlib.metadata.version("gang-core")
    """The installed distribution's version (``gang-core`` in ``pyproject.toml``, its one source)."""
except importlib.metadata.PackageNotFoundError:  # a source tree on ``sys.path`` that was never installed
    __version__ = "0+unknown"

__all__ = [
    "FakeGang",
    "Gang",
    "GangError",
    "Gangs",
    "Grid",
    "InvalidOperationError",
    "NotSupportedError",
    "OperationalError",
    "ProcessGroupGang",
    "ReduceOperation",
    "Work",
    "all_gather_objects",
    "all_reduce_dict",
    "all_sum",
    "broadcast_flag",
    "create_default_gang",
    "create_fake_gangs",
    "create_fsdp_gangs",
    "create_parallel_gangs",
    "exchange_rows",
    "get_default_device",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "maybe_get_current_gangs",
    "raise_operational_gang_error",
    "split_along",
]
