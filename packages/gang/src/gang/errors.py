"""The exceptions raised by gangs."""

from __future__ import annotations

from typing import NoReturn

BACKEND_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError, OSError)
"""What a backend raises when a communication fails, and what every gang reports as :class:`GangError`.

torch's ``DistError`` and its kin, JAX's ``JaxRuntimeError`` and the isolated JAX engine's errors
derive from ``RuntimeError``; a store or socket that breaks raises ``OSError``; torch raises
``ValueError`` for a group that is gone. :class:`gang.extend.guard` turns them into a ``GangError``.
"""


class GangError(Exception):
    """A collective or other communication of a gang failed.

    Raised when a peer died, a collective timed out or the backend reported an error. The message
    names the operation, the rank of the calling process in the gang and the gang's size; the
    original error is chained as ``__cause__``.
    """


class InvalidOperationError(Exception):
    """An operation was called in a state that does not allow it (for example on a closed gang)."""


class NotSupportedError(Exception):
    """An operation is not supported by this kind of gang."""


class OperationalError(Exception):
    """An unrecoverable operational failure, raised by :func:`raise_operational_gang_error`."""


def raise_operational_gang_error(cause: GangError) -> NoReturn:
    """Raise an :class:`OperationalError` chained to ``cause``.

    :param cause: The gang error that made the operation fail.
    :raises OperationalError: Always.
    """
    raise OperationalError("A collective communication operation failed.") from cause
