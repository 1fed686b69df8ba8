"""gpt-oss (GptOssForCausalLM): sliding-window layers (window 128 in the released models)
between full-attention layers, both with attention sinks (a learned logit per head in each
softmax's denominator, `kv/kinds/window.py`) and biases on every projection; every layer's
feed-forward is a mixture of experts whose router has a bias and softmaxes the top k logits,
and whose experts have biases and the clamped SwiGLU gate * sigmoid(alpha * gate) * (up + 1)
(`ops/moe.py`); YaRN RoPE (the config's). The released checkpoints store the experts' weights
in MXFP4 (`models/mxfp4.py`), dequantized as they load."""

from __future__ import annotations

import torch
from torch import nn

from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.kv.kinds import window
from pypto_serving.models.config import GptOssConfig, ModelConfig
from pypto_serving.models.llama import RoutedExperts
from pypto_serving.models.windowed import WindowedAttention, WindowedCausalLM, WindowedDecoderLayer
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.moe import route_top_logits


def _oss(cfg: ModelConfig) -> GptOssConfig:
    assert cfg.gpt_oss is not None, "a gpt-oss config"
    return cfg.gpt_oss


class SinkAttention(WindowedAttention):
    """The windowed Llama attention (biases from the config) with a sink logit per head of
    this rank (`sinks`, split by heads under tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: Group, size: int | None) -> None:
        super().__init__(cfg, layer, tp, size)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def attend(
        self, kv: KVAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return window.attend(kv, self.layer, q, k, v, self.window, self.sinks)


class GptOssMoE(RoutedExperts):
    """The router (replicated, with a bias) and the routed experts, with their biases and
    gpt-oss's activation."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__(cfg, groups)
        oss = _oss(cfg)
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)  # as MoE.gate
        n, size = len(self.held), cfg.moe_intermediate_size
        self.experts_gate_up_bias = nn.Parameter(torch.empty(n, 2 * size))
        self.experts_down_bias = nn.Parameter(torch.empty(n, cfg.hidden_size))
        self.swiglu_limit, self.swiglu_alpha = oss.swiglu_limit, oss.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route_top_logits(self.router(x), self.cfg.num_experts_per_tok)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(WindowedDecoderLayer):
    attention_type = SinkAttention

    def feed_forward(self, cfg: ModelConfig, groups: ParallelGroups, index: int) -> nn.Module:
        return GptOssMoE(cfg, groups)


class GptOssForCausalLM(WindowedCausalLM):
    layer_type = GptOssDecoderLayer
