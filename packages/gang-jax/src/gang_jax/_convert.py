"""Zero-copy views between torch CPU tensors and NumPy arrays, ``bfloat16`` included."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from torch import Tensor

from gang import NotSupportedError

_BFLOAT16 = np.dtype(jnp.bfloat16)
_UINT_BY_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def to_numpy(tensor: Tensor) -> np.ndarray[Any, Any]:
    """Return a writeable NumPy view of the CPU tensor ``tensor`` (no copy).

    :raises NotSupportedError: If NumPy has no equivalent of the tensor's dtype.
    """
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BFLOAT16)
    try:
        return tensor.numpy()
    except TypeError as ex:
        raise NotSupportedError(f"Tensors of dtype {tensor.dtype} cannot be used with a `JaxGang`.") from ex


def as_raw_bits(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Return a flat view of ``array``'s bytes as unsigned integers of up to 32 bits.

    Eight-byte items become two 32-bit words, so moving bits never needs JAX's 64-bit mode.
    """
    flat = np.ascontiguousarray(array).reshape(-1)
    width = min(flat.dtype.itemsize, 4)
    return flat.view(_UINT_BY_SIZE[width])
