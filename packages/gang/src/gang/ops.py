"""The reductions of :meth:`gang.Gang.all_reduce` and :meth:`gang.Gang.reduce_scatter`.

A module of its own so that :mod:`gang.gang` and :mod:`gang.extend` can both import it.
"""

from __future__ import annotations

from enum import Enum


class ReduceOperation(Enum):
    """The reductions of :meth:`gang.Gang.all_reduce` and :meth:`gang.Gang.reduce_scatter`."""

    SUM = 1
    MEAN = 2
    PRODUCT = 3
    MIN = 4
    MAX = 5
