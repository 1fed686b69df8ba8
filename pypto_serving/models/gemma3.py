"""Gemma 3's text model (Gemma3ForCausalLM): local layers attending within a sliding window,
with a RoPE base of their own, between global layers (`kv/kinds/window.py`, through
models/windowed.py); four norms a layer (around attention and the MLP both), norms that scale
by 1 + weight, per-head q/k norms, queries scaled by query_pre_attn_scalar ** -0.5, a GELU
(tanh) gated MLP, embeddings scaled by sqrt(hidden_size), tied embeddings, and the logits
soft-capped where the config says."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.models.config import GemmaConfig, ModelConfig
from pypto_serving.models.llama import MLP
from pypto_serving.models.windowed import WindowedAttention, WindowedCausalLM, WindowedDecoderLayer
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.norm import RMSNorm
from pypto_serving.ops.rope import rope_cos_sin


class GemmaNorm(RMSNorm):
    """RMSNorm scaled by 1 + weight (the checkpoint stores the offset from one), in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(self.weight.dtype)


def _gemma(cfg: ModelConfig) -> GemmaConfig:
    assert cfg.gemma is not None, "a Gemma 3 config"
    return cfg.gemma


class GemmaAttention(WindowedAttention):
    """Llama's projections with Gemma's q/k norms; queries scaled to the attention's
    `query_scale` (the kind scales by head_dim ** -0.5)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: Group, size: int | None) -> None:
        super().__init__(cfg, layer, tp, size)
        self.q_norm = GemmaNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.q_scale = _gemma(cfg).query_scale * cfg.head_dim**0.5

    def attend(
        self, kv: KVAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return super().attend(kv, q * self.q_scale, k, v)


class GemmaMLP(MLP):
    """gelu_tanh(gate) * up, then down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(WindowedDecoderLayer):
    """Norms before and after attention and before and after the MLP."""

    attention_type = GemmaAttention

    def __init__(self, cfg: ModelConfig, layer: int, groups: ParallelGroups, index: int) -> None:
        super().__init__(cfg, layer, groups, index)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaNorm(size, eps)
        self.post_attention_layernorm = GemmaNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaNorm(size, eps)
        self.post_feedforward_layernorm = GemmaNorm(size, eps)

    def feed_forward(self, cfg: ModelConfig, groups: ParallelGroups, index: int) -> nn.Module:
        return GemmaMLP(cfg, groups.tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(WindowedCausalLM):
    """Gemma 3's decoder: the local layers' RoPE is their own (`local_inv_freq`)."""

    layer_type = GemmaDecoderLayer
    local_inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None) -> None:
        super().__init__(cfg, groups)
        if self.model.norm is not None:
            self.model.norm = GemmaNorm(cfg.hidden_size, cfg.rms_norm_eps)
        local = torch.tensor(_gemma(cfg).local_inv_freq)
        self.register_buffer("local_inv_freq", local, persistent=False)

    def set_rope(self, device: torch.device) -> None:
        """The local layers' RoPE buffer (built on "meta", lost by `to_empty`), on `device`."""
        self.local_inv_freq = torch.tensor(
            _gemma(self.cfg).local_inv_freq, dtype=torch.float32, device=device
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size), the scale rounded to their dtype as HF does."""
        embedded = super().embed(input_ids)
        return embedded * torch.tensor(_gemma(self.cfg).embed_scale, dtype=embedded.dtype)

    def layer_rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """The global layers' RoPE, or the local (windowed) layers' own."""
        local = _gemma(self.cfg).local_rope_scaling
        rope = {
            False: rope_cos_sin(positions, self.inv_freq, self.cfg.rope_scaling, dtype),
            True: rope_cos_sin(positions, self.local_inv_freq, local, dtype),
        }
        return lambda i: rope[i in self.cfg.window_layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        cap = _gemma(self.cfg).final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
