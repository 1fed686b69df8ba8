"""SwiGLU activation over a fused gate/up projection."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up is [..., 2 * intermediate] (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
