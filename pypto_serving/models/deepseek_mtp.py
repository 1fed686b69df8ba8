"""DeepSeek-V3's multi-token prediction (MTP) layer, as speculative decoding's drafter.

The checkpoint ships it after the decoder's layers, as `model.layers.{L}` (L =
num_hidden_layers): a full decoder layer (MLA, and MoE where the model's last layers are) with
`enorm`, `hnorm` and `eh_proj` in front and `shared_head` (a norm and an LM head) behind. At
position p it reads the target model's final hidden state h_p (normed, what the LM head reads)
and the embedding of the token at p + 1 (zero at position 0), and predicts the token at p + 2:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])
    y = layer(x)                  (its attention over its own entries at positions <= p)
    logits = shared_head.head(shared_head.norm(y))

Here it is a one-layer `DeepseekForCausalLM`: its decoder layer is the checkpoint's layer L
(its attention writes the KV store's layer L: the target's pool holds one layer more, so the
MTP entries live in the same pages as the target's, cached, moved between tiers and reloaded
with them), `model.norm` is shared_head.norm and `lm_head` shared_head.head. The loader
renames the checkpoint's tensors to these (`mtp_tensor_names`).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from pypto_serving.distributed import ParallelGroups
from pypto_serving.models.config import ModelConfig
from pypto_serving.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM, MLAttention
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.linear import Linear
from pypto_serving.ops.norm import RMSNorm

OWN_PARTS = {
    "enorm.": "enorm.",
    "hnorm.": "hnorm.",
    "eh_proj.": "eh_proj.",
    "shared_head.norm.": "model.norm.",
    "shared_head.head.": "lm_head.",
    "embed_tokens.": "model.embed_tokens.",
}
"""The MTP layer's own tensors (after `model.layers.{L}.`) and what this model calls them."""


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config for its one MTP layer: a one-layer model, MoE where the target's
    last layer is (DeepSeek-V3's MTP block is one of its MoE layers)."""
    moe = (cfg.num_layers - 1) in cfg.moe_layers
    return dataclasses.replace(
        cfg, num_layers=1, moe_layers=(0,) if moe else (), extra_layers=0, tie_word_embeddings=False
    )


def mtp_tensor_names(name: str, first: int, own: set[str], tied: bool) -> list[str]:
    """The MTP model's names for checkpoint tensor `name` (none: not the MTP's). first: the
    MTP layer's index (num_hidden_layers); own: the parts the layer ships itself (of
    OWN_PARTS' keys): the target's embedding and LM head (its embedding where tied) stand in
    for those it lacks."""
    m = re.match(rf"model\.layers\.{first}\.(.*)", name)
    if m is None:
        out = []
        if name == "model.embed_tokens.weight":
            out += ["model.embed_tokens.weight"] * ("embed_tokens." not in own)
            out += ["lm_head.weight"] * (tied and "shared_head.head." not in own)
        elif name == "lm_head.weight" and "shared_head.head." not in own:
            out.append("lm_head.weight")
        return out
    rest = m[1]
    for part, ours in OWN_PARTS.items():
        if rest.startswith(part):
            return [ours + rest[len(part) :]]
    return ["model.layers.0." + rest]


class DeepseekMTP(DeepseekForCausalLM):
    """The MTP layer: `forward` takes the target's hidden states beside the next tokens and
    returns its own (before shared_head's norm); `logits` applies the norm and the head."""

    compiles = False

    def __init__(
        self, target: ModelConfig, kv_layer: int, groups: ParallelGroups | None = None
    ) -> None:
        """kv_layer: its entries' layer in the KV store, the one after the target's layers
        there (under PP rank 0's: after its stage's)."""
        super().__init__(mtp_config(target), groups)
        size, eps = target.hidden_size, target.rms_norm_eps
        self.enorm = RMSNorm(size, eps)
        self.hnorm = RMSNorm(size, eps)
        self.eh_proj = Linear(2 * size, size, bias=False)
        layer = self.model.layers[0]
        assert isinstance(layer, DeepseekDecoderLayer)
        attention = layer.self_attn
        assert isinstance(attention, MLAttention)
        attention.layer = torch.tensor(kv_layer, device="cpu")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVAttention,
        hidden: torch.Tensor | None = None,
        run_layer: object = None,
    ) -> torch.Tensor:
        """input_ids: the token after each position; hidden: the target's final hidden
        states at those positions [T, hidden]."""
        assert hidden is not None
        layer = self.model.layers[0]
        assert isinstance(layer, nn.Module)
        dtype = self.enorm.weight.dtype
        embedded = self.embed(input_ids).float().masked_fill((positions == 0)[:, None], 0.0)
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden.to(dtype))], dim=-1)
        x = self.eh_proj(x).float()
        cos, sin = self.layer_rope(positions, dtype)(0)
        out: torch.Tensor = layer(x, cos, sin, kv)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.model.norm is not None
        return super().logits(self.model.norm(hidden))
