"""Mixture of experts: top-k routing (Qwen3-MoE's, or DeepSeek's by groups) over experts
that are SwiGLU MLPs.

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
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k]; gate_up [E, 2I, H] and down [E, H, I] of the
    experts held here, whose global ids are expert_ids [E]; swiglu_limit > 0 clamps the gate
    projection above and the up projection on both sides (DeepSeek-V4). Returns [T, H] in
    float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j, expert in enumerate(expert_ids):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[j]).chunk(2, dim=-1)
        if swiglu_limit > 0:
            gate, up = clamp_swiglu(gate, up, swiglu_limit)
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
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def clamp_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's clamped SwiGLU inputs: the gate at most `limit`, up within +-limit."""
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


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


def route_grouped(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    method: str,
    groups: tuple[int, int],
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's expert choice, as Hugging Face's routers: (expert ids, float32 weights)
    [T, k]. method "noaux_tc" (V3): sigmoid scores, chosen by score + `bias`
    (e_score_correction_bias) among the experts of the groups (n_group, topk_group) = `groups`
    whose two best sum highest; "group_limited_greedy" (V2): softmax scores, chosen among the
    groups with the best single score; "greedy": softmax top-k. The weights are the chosen
    scores, renormalised if `normalize`, times `scaling` (routed_scaling_factor)."""
    logits = router_logits.float()
    n_group, topk_group = groups
    sigmoid = method == "noaux_tc"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + bias.float() if sigmoid and bias is not None else scores
    if method != "greedy":
        per_group = choice.view(len(choice), n_group, -1)
        group_scores = per_group.topk(2, dim=-1)[0].sum(-1) if sigmoid else per_group.amax(-1)
        kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        mask = mask.repeat_interleave(per_group.shape[-1], dim=1)
        choice = choice.masked_fill(~mask, float("-inf") if sigmoid else 0.0)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


SCORES = {
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
}
"""DeepSeek-V4's router score functions, over float32 logits."""


def route_scored(
    router_logits: torch.Tensor,
    scoring: str,
    top_k: int,
    bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's expert choice: (expert ids, float32 weights) [T, k]. Scores by `scoring`;
    the experts are `fixed_ids` (a hash layer's token table rows) or the top k of score +
    `bias`; the weights are their scores, renormalised, times `scaling`."""
    scores = SCORES[scoring](router_logits.float())
    if fixed_ids is None:
        choice = scores if bias is None else scores + bias.float()
        fixed_ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, fixed_ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return fixed_ids, weights * scaling
