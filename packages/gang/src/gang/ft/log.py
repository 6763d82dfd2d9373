"""The ``gang.ft`` logger: every quorum change, drop, stalled replica, heal and aborted step, with structured fields.

Each record's message is readable as it is; its fields are also attached as ``record.gang_ft``
(a ``dict`` with the ``event`` name), so a handler or formatter can emit them as JSON.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("gang.ft")
"""The logger of :mod:`gang.ft`."""


def log_event(event: str, message: str, *, level: int = logging.INFO, **fields: object) -> None:
    """Log ``message`` on the ``gang.ft`` logger with ``fields`` and ``event`` as ``record.gang_ft``.

    :param event: The kind of event: ``quorum``, ``drop``, ``stalled``, ``heal`` or ``abort``.
    """
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"gang_ft": {"event": event, **fields}})
