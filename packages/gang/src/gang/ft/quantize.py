"""Blockwise quantization of flat tensors for the exchanges of :class:`~gang.ft.LocalSGD` and
:class:`~gang.ft.DiLoCo` (``quantize="int8"`` or ``"float8"``), in plain torch on any device.

Framework-neutral: everything here takes and returns flat (or row-major 2-D) torch tensors and
knows nothing of modules, optimizers or gangs, so an exchange over any framework's parameters
can reuse it.

**The format.** Values are cut into blocks of :data:`BLOCK` consecutive elements; each block
keeps one ``float32`` scale, its absolute maximum divided by the largest code (127 for
``"int8"``, 448 for ``"float8"``, the largest finite ``torch.float8_e4m3fn``), and one byte per
element: ``round(x / scale)`` clamped to ``[-127, 127]`` as ``int8``, or ``x / scale`` cast to
``float8_e4m3fn`` (round to nearest even). A block of zeros has scale 0 and zero codes. Values
are taken as ``float32`` first. On the wire a row of ``width`` elements (``width`` a multiple of
:data:`BLOCK`) is ``width`` code bytes followed by its ``width // BLOCK`` scales, :func:`wire_bytes`
in all (``1 + 4 / 128`` bytes per element: 0.254 of ``float32``, 0.127 of ``float64``).

**The exchange's arithmetic** (:func:`mean_of_rows` on the member that averages a chunk,
:func:`reference_mean` for a whole contribution in one process): every member's contribution is
quantized; the dequantized contributions are summed in ``float32`` in the given order and
divided by their number; the mean is quantized once. Every member dequantizes that same mean, so
all get the same bits. Since blocks never straddle chunks (a chunk's width is a multiple of
:data:`BLOCK`, :func:`chunk_width`), cutting a row into chunks changes nothing: the chunked
exchange and :func:`reference_mean` of the whole row agree bit for bit.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

BLOCK: Final = 128
"""The elements per block, each with its own ``float32`` scale."""

KINDS: Final = ("int8", "float8")
"""The quantizations, besides ``None`` (full precision)."""

_CODES: Final = {"int8": (torch.int8, 127.0), "float8": (torch.float8_e4m3fn, 448.0)}
_SCALE_BYTES: Final = 4


def check_quantize(value: object, name: str = "quantize") -> str | None:
    """``value`` if it is ``None`` or one of :data:`KINDS`, else a ``ValueError`` naming ``name`` and the value."""
    if value is None or (isinstance(value, str) and value in KINDS):
        return value
    raise ValueError(f'`{name}` must be None, "int8" or "float8", but is {value!r} instead.')


def chunk_width(numel: int, parts: int) -> int:
    """The elements of each of ``parts`` equal chunks holding ``numel`` elements, a multiple of :data:`BLOCK`."""
    per = -(-numel // parts)
    return max(BLOCK, -(-per // BLOCK) * BLOCK)


def wire_bytes(width: int) -> int:
    """The bytes of a quantized row of ``width`` elements (a multiple of :data:`BLOCK`): codes, then scales."""
    if width % BLOCK:
        raise ValueError(f"`width` must be a multiple of {BLOCK}, but is {width} instead.")
    return width + width // BLOCK * _SCALE_BYTES


def _views(wire: Tensor, width: int, kind: str) -> tuple[Tensor, Tensor]:
    """The codes ``(rows, width)`` and scales ``(rows, width // BLOCK)`` of a ``uint8`` wire table ``(rows, bytes)``."""
    dtype, _ = _CODES[kind]
    return wire[:, :width].view(dtype), wire[:, width:].view(torch.float32)


def quantize_rows(x: Tensor, kind: str, out: Tensor | None = None) -> Tensor:
    """Quantize each row of ``x`` (``(rows, width)``, ``width`` a multiple of :data:`BLOCK`, any floating
    dtype) into the ``uint8`` wire table ``out`` (``(rows, wire_bytes(width))``, made when ``None``)."""
    rows, width = x.shape
    if out is None:
        out = torch.empty(rows, wire_bytes(width), dtype=torch.uint8, device=x.device)
    codes, scales = _views(out, width, kind)
    dtype, top = _CODES[kind]
    blocks = x.reshape(rows, width // BLOCK, BLOCK).to(torch.float32)
    absmax = blocks.abs().amax(dim=2)
    torch.div(absmax, top, out=scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    scaled = (blocks / safe).clamp_(-top, top)
    if kind == "int8":
        scaled.round_()
    codes.copy_(scaled.reshape(rows, width).to(dtype))
    return out


def dequantize_rows(wire: Tensor, width: int, kind: str, out: Tensor | None = None) -> Tensor:
    """The values of the ``uint8`` wire table ``wire`` (rows of ``width`` elements), written into ``out``
    (``(rows, width)``, any floating dtype; ``float32`` made when ``None``)."""
    codes, scales = _views(wire, width, kind)
    rows = wire.shape[0]
    values = codes.to(torch.float32).reshape(rows, width // BLOCK, BLOCK).mul_(scales.unsqueeze(2))
    if out is None:
        return values.reshape(rows, width)
    return out.copy_(values.reshape(rows, width))


def mean_of_rows(table: Tensor, order: list[int], width: int, kind: str, *, out: Tensor) -> Tensor:
    """The exchange's average on the member that owns a chunk: rows ``order`` of the wire table ``table``
    (one quantized chunk of ``width`` elements per member) dequantized, summed in ``float32`` in that
    order, divided by their number and quantized into ``out`` (``(1, wire_bytes(width))``)."""
    total = dequantize_rows(table[order[0] : order[0] + 1], width, kind)
    for r in order[1:]:
        total.add_(dequantize_rows(table[r : r + 1], width, kind))
    total.div_(len(order))
    return quantize_rows(total, kind, out=out)


def roundtrip(x: Tensor, kind: str) -> Tensor:
    """``x`` (flat, any length) quantized and dequantized, as ``float32``: what a receiver gets of it."""
    width = -(-x.numel() // BLOCK) * BLOCK
    padded = torch.zeros(1, width, dtype=torch.float32, device=x.device)
    padded[0, : x.numel()] = x.reshape(-1)
    return dequantize_rows(quantize_rows(padded, kind), width, kind)[0, : x.numel()]


def reference_mean(contributions: list[Tensor], kind: str) -> Tensor:
    """The quantized exchange of flat ``contributions`` (in member order) in one process, as ``float32``:
    each quantized, the dequantized values summed in ``float32`` in order and divided by their
    number, the mean quantized once and dequantized. Equal bit for bit to what every member of the
    real exchange gets (:mod:`gang.ft.diloco`), whatever the number of chunks."""
    total = roundtrip(contributions[0], kind)
    for c in contributions[1:]:
        total.add_(roundtrip(c, kind))
    return roundtrip(total.div_(len(contributions)), kind)


__all__ = [
    "BLOCK",
    "KINDS",
    "check_quantize",
    "chunk_width",
    "dequantize_rows",
    "mean_of_rows",
    "quantize_rows",
    "reference_mean",
    "roundtrip",
    "wire_bytes",
]
