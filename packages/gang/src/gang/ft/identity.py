"""Who a :mod:`gang.ft` process is and where it meets the others: the checks of
:meth:`~gang.ft.ReplicaGang.join`'s identity arguments (replica id, replica rank and size), the
store's address, the death signal's address and the device, each from its argument or else from the environment.

Internal to :mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

import ipaddress
import os

import torch

from gang.env import get_rank, get_world_size
from gang.extend import check_device, check_int
from gang.ft.liveness import ROUTE


def check_replica_id(replica_id: object) -> str:
    """The replica id: ``replica_id``, else ``GANG_FT_REPLICA_ID`` (an ``int`` becomes its text)."""
    if replica_id is None:
        replica_id = os.environ.get("GANG_FT_REPLICA_ID")
        if replica_id is None:
            raise ValueError("`replica_id` must be given when `GANG_FT_REPLICA_ID` is not set, but is None.")
        name = "GANG_FT_REPLICA_ID"
    else:
        name = "replica_id"
    if isinstance(replica_id, int) and not isinstance(replica_id, bool):
        replica_id = str(replica_id)
    if not isinstance(replica_id, str):
        raise TypeError(f"`{name}` must be a `str` or an `int`, but is {replica_id!r} instead.")
    if not replica_id or not all(c.isalnum() or c in "-_." for c in replica_id):
        raise ValueError(
            f"`{name}` must be a non-empty id of letters, digits, `-`, `_` and `.`, but is {replica_id!r} instead."
        )
    return replica_id


def check_replica_rank(rank: object, size: object) -> tuple[int, int]:
    """The replica rank and size: the arguments, else ``GANG_FT_REPLICA_RANK``/``_SIZE``, else the launcher's."""
    rank_value = _rank_or_size("replica_rank", rank, "GANG_FT_REPLICA_RANK", 0)
    size_value = _rank_or_size("replica_size", size, "GANG_FT_REPLICA_SIZE", 1)
    rank_value = get_rank() if rank_value is None else rank_value
    size_value = get_world_size() if size_value is None else size_value
    if rank_value >= size_value:
        raise ValueError(
            f"`replica_rank` must be smaller than `replica_size` ({size_value}), but is {rank_value} instead."
        )
    return rank_value, size_value


def _rank_or_size(name: str, value: object, env: str, minimum: int) -> int | None:
    if value is None:
        text = os.environ.get(env)
        if text is None:
            return None
        if not text.isdigit():
            raise ValueError(f"`{env}` must be an integer of at least {minimum}, but is {text!r} instead.")
        value, name = int(text), env
    return check_int(name, value, minimum=minimum)


def check_store(store: object) -> tuple[str, int]:
    """The store's (host, port): ``store``, else ``GANG_FT_STORE``, of the form ``host:port``."""
    name = "store"
    if store is None:
        store = os.environ.get("GANG_FT_STORE")
        if store is None:
            raise ValueError("`store` must be given when `GANG_FT_STORE` is not set, but is None.")
        name = "GANG_FT_STORE"
    if not isinstance(store, str):
        raise TypeError(f"`{name}` must be a `str` of the form 'host:port', but is {store!r} instead.")
    host, _, port = store.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"`{name}` must have the form 'host:port', but is {store!r} instead.")
    return host, int(port)


def check_liveness_address(address: object) -> str | None:
    """Where the death signal listens (see :func:`gang.ft.liveness.listen_address`): ``address``,
    else ``GANG_FT_LIVENESS_ADDRESS``; ``None`` (neither set) is the interface that reaches the store."""
    name = "liveness_address"
    if address is None:
        address = os.environ.get("GANG_FT_LIVENESS_ADDRESS") or None
        if address is None:
            return None
        name = "GANG_FT_LIVENESS_ADDRESS"
    if not isinstance(address, str):
        raise TypeError(f"`{name}` must be a `str`, but is {address!r} instead.")
    if address == ROUTE:
        return address
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        raise ValueError(
            f"`{name}` must be {ROUTE!r} or an IP address of this host, but is {address!r} instead."
        ) from None


def check_replica_device(device: object) -> torch.device:
    """A replica gang's device: ``cpu`` (gloo, the default: ``None``) or ``cuda[:N]`` (NCCL).

    :func:`gang.extend.check_device`'s checks, then ``None`` allowed and only CPU and CUDA.
    """
    if device is None:
        return torch.device("cpu")
    device = check_device("device", device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"`device` must be of type `cpu` or `cuda`, but is of type `{device.type}` instead.")
    return device


__all__ = ["check_liveness_address", "check_replica_device", "check_replica_id", "check_replica_rank", "check_store"]
