"""MXFP4 checkpoint weights (gpt-oss's experts), dequantized as they load.

A weight W [..., rows, cols] is stored as two tensors: `NAME_blocks` [..., rows, cols / 32,
16] uint8, each byte two 4-bit E2M1 values (the low nibble first), and `NAME_scales`
[..., rows, cols / 32] uint8, one power-of-two scale per 32 values (E8M0: 2 ** (s - 127)).
gpt-oss stores its experts' projections this way with rows the outputs, so the dequantized
weight is transposed to the [..., inputs, outputs] layout its unquantized checkpoints use.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pypto_serving.errors import ModelLoadError

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit E2M1 code."""
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W [..., rows, cols] in bfloat16 (which holds every MXFP4 value exactly) from its
    blocks [..., rows, G, 16] and scales [..., rows, G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = torch.tensor(E2M1, dtype=torch.bfloat16)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    values = table[codes.long()]
    exponents = scales.to(torch.int32)[..., None] - 127
    return torch.ldexp(values, exponents).to(torch.bfloat16).flatten(-2)


def dequantized(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each MXFP4 pair (`NAME_blocks`, `NAME_scales`, in any
    order and shard) given as one `NAME` [..., inputs, outputs]; the other tensors as they
    are. A pair left incomplete at the end is an error."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        if base not in waiting:
            waiting[base] = (suffix, tensor)
            continue
        other_suffix, other = waiting.pop(base)
        if other_suffix == suffix:
            raise ModelLoadError(f"tensor {name!r} appears twice in the checkpoint")
        blocks, scales = (tensor, other) if suffix == "_blocks" else (other, tensor)
        try:
            weight = dequantize(blocks, scales)
        except ValueError as e:
            raise ModelLoadError(f"MXFP4 tensor {base!r}: {e}") from None
        yield base, weight.transpose(-1, -2)
    if waiting:
        shown = ", ".join(base + suffix for base, (suffix, _) in sorted(waiting.items()))
        raise ModelLoadError(f"MXFP4 tensors without their blocks or scales: {shown}")
