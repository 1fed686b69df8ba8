"""The Llama family (Llama, Qwen2, Qwen3) as one decoder-only transformer.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj`; `loader.py` is the one place that maps HF tensors onto them.
The model works on a flat batch of tokens [T] (sequences concatenated) and leaves all
KV-cache handling to the `KVAttention` object it is given. Matmuls run in the weights' dtype
(bf16 or fp32); the residual stream is kept in float32, as llama.cpp keeps its activations,
so bf16 weights cost little accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from pypto_serving.distributed import Group, tp_all_gather
from pypto_serving.models.config import ModelConfig
from pypto_serving.ops.activation import silu_and_mul
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.linear import Linear, RowParallelLinear, VocabParallelEmbedding
from pypto_serving.ops.norm import RMSNorm
from pypto_serving.ops.rope import apply_rope, rope_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: Group) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = kv.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: Group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `logits` projects them.

    Under tensor parallelism (`tp.size > 1`) `cfg` is this rank's share
    (`ModelConfig.tensor_parallel_shard`): q/k/v and gate/up are column-parallel (each rank
    computes its heads and MLP columns, no communication), o_proj and down_proj row-parallel
    (an all-reduce each), the embedding and LM head split by vocabulary rows (an all-reduce
    after the lookup, an all-gather of the logits)."""

    def __init__(self, cfg: ModelConfig, tp: Group = Group()) -> None:  # noqa: B008 (frozen)
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = Decoder(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, self.model.embed_tokens.shard, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.rope_inv_freq), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        """input_ids, positions: [T] (a flat batch); returns hidden states [T, hidden]."""
        embeds = self.model.embed_tokens(input_ids)
        dtype = self.lm_head.weight.dtype
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.cfg.rope_scaling, dtype)
        x = embeds.float()  # the residual stream stays in float32 whatever the weights' dtype
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given hidden states [N, hidden]."""
        logits = self.lm_head(hidden).float()
        if self.tp.size == 1:
            return logits
        return tp_all_gather(logits)[:, : self.cfg.vocab_size]
