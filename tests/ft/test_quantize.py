"""``gang.ft.quantize``: the blockwise format, and the chunked exchange's average equal bit for bit
to the one-process reference (what the DiLoCo replay relies on)."""

from __future__ import annotations

import re

import pytest
import torch

from gang.ft.quantize import (
    BLOCK,
    KINDS,
    check_quantize,
    chunk_width,
    dequantize_rows,
    mean_of_rows,
    quantize_rows,
    reference_mean,
    roundtrip,
    wire_bytes,
)


def _exchange(contributions: list[torch.Tensor], order: list[int], kind: str) -> torch.Tensor:
    """The exchange as DiLoCo runs it, members simulated: rows cut into chunks of whole blocks, chunk
    ``j`` of every member averaged by member ``j``, the quantized averages gathered and dequantized."""
    size, numel = len(contributions), contributions[0].numel()
    width = chunk_width(numel, size)
    tables = []
    for c in contributions:
        row = torch.zeros(size * width, dtype=c.dtype)
        row[:numel] = c
        tables.append(quantize_rows(row.view(size, width), kind))
    gathered = torch.empty(size, wire_bytes(width), dtype=torch.uint8)
    for j in range(size):
        received = torch.stack([t[j] for t in tables])
        mean_of_rows(received, order, width, kind, out=gathered[j : j + 1])
    return dequantize_rows(gathered, width, kind).reshape(-1)[:numel]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("size", "numel"), [(1, 5), (2, 128), (3, 1000), (3, 100_003), (5, 20_000)])
def test_chunked_exchange_equals_the_reference(kind: str, size: int, numel: int) -> None:
    g = torch.Generator().manual_seed(numel + size)
    contributions = [torch.randn(numel, generator=g, dtype=torch.float64) * (1 + r) for r in range(size)]
    order = list(range(size))
    assert torch.equal(_exchange(contributions, order, kind), reference_mean(contributions, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_format_errors_and_zeros(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 * BLOCK, generator=g) * torch.logspace(-6, 3, 10).repeat_interleave(BLOCK)
    x[3 * BLOCK : 4 * BLOCK] = 0.0  # a block of zeros: scale 0, exact zeros back
    back = roundtrip(x, kind)
    blocks, err = x.view(10, BLOCK), (back - x).view(10, BLOCK)
    top = blocks.abs().amax(dim=1, keepdim=True)
    # int8: half a step of absmax/127; float8 e4m3: 3 mantissa bits (2^-4 relative), and the
    # subnormal step below 2^-6 of the scale.
    bound = top / 254 if kind == "int8" else torch.maximum(blocks.abs() / 16, top / 448 * 2.0**-10)
    assert bool((err.abs() <= bound * (1 + 1e-6)).all())
    assert torch.equal(back[3 * BLOCK : 4 * BLOCK], torch.zeros(BLOCK))
    assert wire_bytes(BLOCK) == BLOCK + 4 and wire_bytes(4 * BLOCK) / (4 * BLOCK * 4) <= 0.27


def test_chunk_width_and_bad_values() -> None:
    assert chunk_width(1, 3) == BLOCK and chunk_width(3 * BLOCK + 1, 3) == 2 * BLOCK
    assert check_quantize(None) is None and check_quantize("float8") == "float8"
    for bad in ("fp8", 8, True):
        with pytest.raises(ValueError, match=re.escape(f'`quantize` must be None, "int8" or "float8", but is {bad!r}')):
            check_quantize(bad)
    with pytest.raises(ValueError, match="`width` must be a multiple of 128, but is 100 instead"):
        wire_bytes(100)
