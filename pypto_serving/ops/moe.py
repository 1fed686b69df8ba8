"""Mixture of experts (Qwen3-MoE style): top-k routing over experts that are SwiGLU MLPs.

The expert computation is one opaque custom op, `pypto::moe_experts`: which tokens go to
which expert is data, so a compiled graph calls it like the attention op and stays one graph
per shape. A rank holds some of the experts (all of them without expert parallelism); the op
sums, for every token, the weighted outputs of the experts held here that the token was
routed to, and the model adds the ranks' sums with an all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PLACEMENTS = ("linear", "round_robin")


def expert_placement(num_experts: int, rank: int, size: int, strategy: str) -> list[int]:
    """The experts rank `rank` of `size` holds: a contiguous block (linear, the counts
    differing by at most one) or every size-th expert from `rank` (round_robin)."""
    if strategy == "round_robin":
        return list(range(rank, num_experts, size))
    return list(range(num_experts * rank // size, num_experts * (rank + 1) // size))


@torch.library.custom_op("pypto::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
) -> torch.Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k]; gate_up [E, 2I, H] and down [E, H, I] of the
    experts held here, whose global ids are expert_ids [E]. Returns [T, H] in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j, expert in enumerate(expert_ids):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[j]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[j]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.float())
    return out


@moe_experts.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def route(
    router_logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, weights) [T, k]: softmax in float32 over the experts, the top k, optionally
    renormalised, weights in `dtype` (as Hugging Face's Qwen3-MoE router)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)
