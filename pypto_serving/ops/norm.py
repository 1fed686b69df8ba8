"""RMSNorm as in Llama/Qwen: computed in float32, scaled by a learned weight.

The input may be the float32 residual stream; the output is in the weight's dtype (the
dtype the next matmul runs in), rounded once.
"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(self.weight.dtype)
