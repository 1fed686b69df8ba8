"""Mixture of experts: top-k routing (Qwen3-MoE's, DeepSeek's by groups, gpt-oss's over the
logits) over experts that are SwiGLU MLPs (clamped, with biases and gpt-oss's gate where the
model has them).

The expert computation is one opaque custom op, `pypto::moe_experts`: which tokens go to
which expert is data, so a compiled graph calls it like the attention op and stays one graph
per shape. The experts' matrices are weights, or (a GGUF file's Q4_1 / Q8_0 experts,
`--quantization gguf`) each expert's records (`ExpertRecords`), multiplied in one native call
with activations quantized per 32 inputs, as llama.cpp multiplies them (`moe_records`). A rank
holds some of the experts (all of them without expert parallelism); the op sums, for every
token, the weighted outputs of the experts held here that the token was routed to. How the
other ranks' experts are reached is `routed_experts`' (the group's `expert_exchange`): under TP
every rank has every token, and their sums are added with an all-reduce; under DP attention +
EP each replica has its own tokens, and `pypto::moe_dispatch` sends them to the replicas
holding their experts and brings the results back:

    all_to_all:               token rows ──all-to-all──▶ owners' experts ──all-to-all──▶ back
    allgather_reducescatter:  all tokens gathered everywhere, each rank's experts on all of
                              them, a reduce-scatter returns each rank its own tokens' sums
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pypto_serving import native as native_kernels
from pypto_serving.distributed import (
    all_gather_rows,
    all_ranks_max,
    all_to_all_back,
    all_to_all_rows,
    exchange_ranks,
    reduce_scatter_rows,
    tp_all_reduce,
)
from pypto_serving.ops.linear import INT4_GROUP, RECORD_BYTES

PLACEMENTS = ("linear", "round_robin")


class ExpertRecords(NamedTuple):
    """The experts a rank holds as records (`ops/linear.py`'s `q4_records` / `q8_records`
    layouts), one row of bytes an expert, in the order of its held ids: gate_up [E, records of
    2I x H] (gate's rows, then up's), down [E, records of H x I], each stack of one format."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_format: int
    down_format: int


def moe_records(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    gate_up_format: int,
    down_format: int,
) -> torch.Tensor:
    """`moe_experts` over records (`ExpertRecords`' stacks and formats), in one native call
    (native/gemm.cpp's `pypto_moe_records`): for each chosen expert held here its tokens'
    rows quantized to int8 per 32 inputs, the products over the records, silu(gate) * up in
    float32, added weighted in the order of the held ids. llama.cpp's arithmetic for a
    Q4_1 / Q8_0 expert, at every width (the records' product beats dequantizing them into
    bf16 at the rows an expert meets); each row's result the same bits whatever rows come
    with it. Returns [T, H] float32."""
    lib = native_kernels.gemm_library()
    assert lib is not None, "experts are kept as records only where the native GEMM builds"
    rows, hidden = x.shape
    blocks = -(-hidden // 16)
    inter = down.shape[1] // (blocks * RECORD_BYTES[down_format]) * INT4_GROUP
    assert down.shape[1] == blocks * inter // INT4_GROUP * RECORD_BYTES[down_format]
    assert gate_up.shape[1] == 2 * inter // 16 * hidden // INT4_GROUP * RECORD_BYTES[gate_up_format]
    assert gate_up.is_contiguous() and down.is_contiguous()
    w1 = native_kernels.Matrix(gate_up.data_ptr(), None, 2 * inter, hidden, gate_up_format)
    w2 = native_kernels.Matrix(down.data_ptr(), None, hidden, inter, down_format)
    xf = x.float().contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.float().contiguous()
    held = torch.tensor(expert_ids, dtype=torch.int64)
    out = torch.empty(rows, hidden)
    failed = lib.pypto_moe_records(
        ctypes.byref(w1),
        gate_up.shape[1],
        ctypes.byref(w2),
        down.shape[1],
        held.data_ptr(),
        len(expert_ids),
        xf.data_ptr(),
        rows,
        ids.data_ptr(),
        weights.data_ptr(),
        ids.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    assert not failed, (rows, hidden, inter, gate_up_format, down_format)
    return out


def expert_placement(num_experts: int, rank: int, size: int, strategy: str) -> list[int]:
    """The experts rank `rank` of `size` holds: a contiguous block (linear, the counts
    differing by at most one) or every size-th expert from `rank` (round_robin)."""
    if strategy == "round_robin":
        return list(range(rank, num_experts, size))
    return list(range(num_experts * rank // size, num_experts * (rank + 1) // size))


def expert_owners(num_experts: int, size: int, strategy: str) -> list[int]:
    """The rank of `size` holding each expert (`expert_placement`'s inverse)."""
    owners = [0] * num_experts
    for rank in range(size):
        for expert in expert_placement(num_experts, rank, size, strategy):
            owners[expert] = rank
    return owners


def column_owners(owners: list[int], tp_rank: int, tp_size: int) -> list[int]:
    """Under DP attention + EP with TP ranks in each replica: the exchange of the rank with
    TP index `tp_rank` reaches the experts held in its column (the ranks of that index in
    every replica), each expert's owner then its replica's index; -1 for an expert of another
    column, which the replica's other TP ranks reach (their sums meet in the all-reduce)."""
    return [e // tp_size if e % tp_size == tp_rank else -1 for e in owners]


@torch.library.custom_op("pypto::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_format: int = 0,
    down_format: int = 0,
) -> torch.Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k]; gate_up [E, 2I, H] and down [E, H, I] of the
    experts held here, whose global ids are expert_ids [E]; swiglu_limit > 0 clamps the gate
    projection above and the up projection on both sides (DeepSeek-V4, gpt-oss);
    swiglu_alpha > 0 is gpt-oss's activation (`activate`); gate_up_bias [E, 2I] and down_bias
    [E, H] the experts' biases (gpt-oss). Where gate_up_format and down_format are records'
    formats (NATIVE_Q4, NATIVE_Q8; 0: weights), gate_up and down are the experts' records
    (`ExpertRecords`: a GGUF file's plain SwiGLU experts), multiplied by `moe_records`.
    Returns [T, H] in float32."""
    if gate_up_format:
        plain = not (swiglu_limit or swiglu_alpha) and gate_up_bias is None and down_bias is None
        assert plain, "experts kept as records are plain SwiGLU ones"
        args = (x, topk_ids, topk_weights, gate_up, down, expert_ids)
        return moe_records(*args, gate_up_format, down_format)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    held = {expert: j for j, expert in enumerate(expert_ids)}
    chosen = [e for e in torch.unique(topk_ids).tolist() if e in held]  # held in rising order
    for expert in chosen:  # only the experts the step's tokens chose: 8 of 128 in a decode
        j = held[expert]
        token, slot = torch.where(topk_ids == expert)
        bias = None if gate_up_bias is None else gate_up_bias[j]
        gate, up = F.linear(x[token], gate_up[j], bias).chunk(2, dim=-1)
        hidden = activate(gate, up, swiglu_limit, swiglu_alpha)
        bias = None if down_bias is None else down_bias[j]
        y = F.linear(hidden, down[j], bias) * topk_weights[token, slot, None]
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
    swiglu_alpha: float = 0.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_format: int = 0,
    down_format: int = 0,
) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def activate(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """An expert's SwiGLU: silu(gate) * up, its inputs clamped where `limit` > 0; with
    `alpha` > 0, gpt-oss's gate * sigmoid(alpha * gate) * (up + 1)."""
    if limit > 0:
        gate, up = clamp_swiglu(gate, up, limit)
    if alpha > 0:
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    return F.silu(gate) * up


def clamp_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's clamped SwiGLU inputs: the gate at most `limit`, up within +-limit."""
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    exchange: str,
    owners: list[int],
    partial: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    reduce_tp: bool = False,
    formats: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """Every token's weighted expert outputs [T, H] float32, plus `partial` (DeepSeek's
    shared experts: under TP this rank's columns' partial sum, joining the same all-reduce).
    exchange: the groups' `expert_exchange`; owners: each expert's rank in the EP group
    (under DP attention + EP its replica in this rank's column, -1 for another column's:
    `column_owners`); reduce_tp: DP attention + EP with TP ranks, whose column sums are
    all-reduced; swiglu_limit, swiglu_alpha and the biases: as `moe_experts`'; formats: its
    gate_up_format and down_format (records: `ExpertRecords`, which one rank serves)."""
    experts = (gate_up, down, expert_ids)
    tail = (swiglu_limit, swiglu_alpha, gate_up_bias, down_bias)
    if exchange in ("none", "all_reduce"):
        out = moe_experts(x, topk_ids, topk_weights, *experts, *tail, *formats)
        out = out if partial is None else out + partial
        return tp_all_reduce(out) if exchange == "all_reduce" else out
    assert not formats[0], "experts kept as records are not exchanged"
    out = moe_dispatch(x, topk_ids, topk_weights, *experts, owners, exchange, *tail)
    out = out if partial is None else out + partial
    return tp_all_reduce(out) if reduce_tp else out


def join_exchange(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    top_k: int,
    exchange: str,
    weight_dtype: torch.dtype,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> None:
    """DP attention + EP, a replica with no tokens this step: run its part of the layer's
    exchange with none of its own (its experts compute the other replicas' tokens, weighted
    in `weight_dtype`, the routing weights' dtype of the model's router)."""
    x = gate_up.new_empty(0, gate_up.shape[-1])
    ids = torch.empty(0, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(0, top_k, dtype=weight_dtype, device=x.device)
    tail = (swiglu_limit, swiglu_alpha, gate_up_bias, down_bias)
    moe_dispatch(x, ids, weights, gate_up, down, expert_ids, [], exchange, *tail)


@torch.library.custom_op("pypto::moe_dispatch", mutates_args=())
def moe_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    owners: list[int],
    backend: str,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """DP attention + EP: this rank's tokens x [T, H], routed to topk_ids with topk_weights
    [T, k], through the experts wherever they are held (owners: each expert's rank; [] when
    T is 0). Every rank of the EP group calls it once per MoE layer and step. Returns [T, H]
    float32; all_to_all adds each token's expert outputs in the order of the expert ids, as
    `moe_experts` does on one rank (the experts' matmuls, over other row counts, may round
    differently). The activation and biases: as `moe_experts`'."""
    x, topk_ids = x.to(gate_up.dtype), topk_ids.long()  # the same dtypes on every rank
    tail = (swiglu_limit, swiglu_alpha, gate_up_bias, down_bias)
    if backend == "allgather_reducescatter":
        return _gather_scatter(x, topk_ids, topk_weights, gate_up, down, expert_ids, tail)
    num, k = topk_ids.shape
    world = exchange_ranks()
    owner = torch.tensor(owners or [0], dtype=torch.int64, device=x.device)[topk_ids.flatten()]
    reached = torch.nonzero(owner >= 0).flatten()  # not another column's (`column_owners`)
    order = reached[torch.argsort(owner[reached], stable=True)]  # pairs grouped by owner
    token = order // k
    counts = torch.bincount(owner[reached], minlength=world).tolist()
    rows, recv_counts = all_to_all_rows(x[token], counts)
    chosen = [topk_ids.flatten()[order].float(), topk_weights.flatten()[order].float()]
    choice, _ = all_to_all_rows(torch.stack(chosen, 1), counts, recv_counts)  # id, weight
    ids, weights = choice[:, :1].long(), choice[:, 1:].to(topk_weights.dtype)
    y = moe_experts(rows, ids, weights, gate_up, down, expert_ids, *tail)
    back = all_to_all_back(y, recv_counts, counts)
    pairs = back.new_zeros(num * k, x.shape[-1]).index_copy_(0, order, back)
    pairs = pairs.view(num, k, x.shape[-1])
    slots = torch.argsort(topk_ids, dim=1)  # each token's experts in id order
    out = torch.zeros(num, x.shape[-1], dtype=torch.float32, device=x.device)
    for s in range(k):
        out += pairs[torch.arange(num, device=x.device), slots[:, s]]
    return out


def _gather_scatter(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    tail: tuple[float, float, torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor:
    """allgather_reducescatter: every rank's tokens (padded to the most any rank has, the
    padding routed to no expert) through this rank's experts, summed over the ranks."""
    num = len(topk_ids)
    rows = all_ranks_max([num])[0]
    if rows == 0:
        return torch.zeros(0, x.shape[-1], dtype=torch.float32, device=x.device)
    pad = rows - num
    ids = F.pad(topk_ids, (0, 0, 0, pad), value=-1)
    weights = F.pad(topk_weights.float(), (0, 0, 0, pad))
    every_x = all_gather_rows(F.pad(x, (0, 0, 0, pad)), rows)
    every_ids, every_weights = all_gather_rows(ids, rows), all_gather_rows(weights, rows)
    every_weights = every_weights.to(topk_weights.dtype)
    partial = moe_experts(every_x, every_ids, every_weights, gate_up, down, expert_ids, *tail)
    return reduce_scatter_rows(partial)[:num]


@moe_dispatch.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: list[int],
    owners: list[int],
    backend: str,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
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


def route_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's expert choice: (expert ids, weights) [T, k], the top k logits and a softmax
    over them (in float32, weights in the logits' dtype, as Hugging Face's router)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return ids, torch.softmax(top.float(), dim=-1).to(router_logits.dtype)


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
