"""DeepSeek-V2/V3: multi-head latent attention (MLA) and a mixture of experts routed by groups,
shared experts beside them, on llama.py's decoder (its layers, stages, embedding and head).

MLA keeps one latent entry per token per layer, shared by all heads: the normed latent c_kv
(kv_lora_rank values) followed by the roped k_pe (qk_rope_head_dim). Attention runs on the
entries alone, by weight absorption: each head's query part without position (q_nope) is
taken into the latent space through that head's W_UK (kv_b_proj's key rows), so its product
with an entry is the product HF's expanded key would give; the attention's output, a mix of
entries, goes out through the head's W_UV (kv_b_proj's value rows). `loader.py` splits
kv_b_proj into `w_uk` and `w_uv` once, and de-interleaves the roped rows of the query and
latent projections where the checkpoint interleaves them (V3's `rope_interleave`, V2), so
`ops/rope.py`'s rotate-half rotation applies as it is.

Under tensor parallelism each rank holds its heads (q, kv_b and o split as Llama's q and o);
the latent projection and its norm are replicated, so the latent KV is the same on every rank.
Routed experts are placed by expert parallelism as Qwen3-MoE's; the shared experts are split
by columns, their partial sum joining the experts' in one all-reduce.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.kv.kinds import AttentionKind, mla
from pypto_serving.models.config import ModelConfig
from pypto_serving.models.llama import MLP, CausalLM, DecoderLayer, RoutedExperts
from pypto_serving.ops.activation import silu_and_mul
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.linear import Linear, RowParallelLinear
from pypto_serving.ops.moe import route_grouped
from pypto_serving.ops.norm import RMSNorm
from pypto_serving.ops.rope import apply_rope

LORA_NORM_EPS = 1e-6
"""HF's q_a_layernorm and kv_a_layernorm keep their default eps, not rms_norm_eps."""


class MLAttention(nn.Module):
    """Multi-head latent attention over `kv/kinds/mla.py` (this rank's heads)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: Group) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = torch.tensor(layer, device="cpu")  # a graph input: see llama.Attention
        heads, rank = cfg.num_heads, cfg.kv_lora_rank
        q_size = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_size, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, q_size, bias=False)
        latent = rank + cfg.qk_rope_head_dim
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, latent, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(rank, LORA_NORM_EPS)
        queries = [self.q_a_proj, self.q_b_proj] if cfg.q_lora_rank else [self.q_proj]
        for qk in (*queries, self.kv_a_proj_with_mqa):
            qk.exact_int8 = True  # queries and keys: 8 bits both under w8a8
        self.w_uk = nn.Parameter(torch.empty(heads, cfg.qk_nope_head_dim, rank))
        """kv_b_proj's key rows per head [heads, qk_nope_head_dim, kv_lora_rank]."""
        self.w_uv = nn.Parameter(torch.empty(heads, cfg.v_head_dim, rank))
        """kv_b_proj's value rows per head [heads, v_head_dim, kv_lora_rank]."""
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, cfg.hidden_size, cfg.o_bias, tp)
        # the op's scale is latent**-0.5; the queries carry the rest of the model's
        self.q_scale = cfg.softmax_scale * latent**0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        cfg = self.cfg
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(len(x), cfg.num_heads, -1)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1
        )
        k_pe = apply_rope(k_pe[:, None, :], cos, sin)[:, 0]
        entry = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        q = torch.cat([q_latent, apply_rope(q_pe, cos, sin)], dim=-1) * self.q_scale
        out = mla.attend(kv, self.layer, q, entry)[..., : cfg.kv_lora_rank]
        out = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(len(x), -1))


class Router(nn.Module):
    """The MoE gate, computed in float32 as HF's (not a Linear: never packed or quantized)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        bias = self.e_score_correction_bias if cfg.router == "noaux_tc" else None
        groups = (cfg.n_group, cfg.topk_group)
        return route_grouped(
            logits,
            bias,
            cfg.num_experts_per_tok,
            cfg.router,
            groups,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU MLP; under tensor parallelism this rank's columns, its
    partial sum left for the MoE's all-reduce."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size = cfg.shared_intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * size, bias=False)
        self.down_proj = Linear(size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DeepseekMoE(RoutedExperts):
    """Routed experts (this rank's, under expert parallelism) plus the shared experts."""

    float32_routing: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__(cfg, groups)
        self.gate = Router(cfg)
        self.shared_experts = SharedExperts(cfg) if cfg.shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        shared = None if self.shared_experts is None else self.shared_experts(x).float()
        return self.experts(x, ids, weights, shared)


class DeepseekDecoderLayer(DecoderLayer):
    """llama.py's layer with MLA, and DeepSeek's MoE after the first dense layers."""

    def attention(
        self, cfg: ModelConfig, layer: int, groups: ParallelGroups, index: int
    ) -> nn.Module:
        return MLAttention(cfg, layer, groups.tp)

    def feed_forward(self, cfg: ModelConfig, groups: ParallelGroups, index: int) -> nn.Module:
        return DeepseekMoE(cfg, groups) if index in cfg.moe_layers else MLP(cfg, groups.tp)


class DeepseekForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: CausalLM's forward and logits, its
    RoPE tables over qk_rope_head_dim (ModelConfig.rope_inv_freq)."""

    layer_type = DeepseekDecoderLayer
    attention_kind: ClassVar[AttentionKind] = mla
