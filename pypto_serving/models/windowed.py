"""Llama-family models whose layers attend within a sliding window: Mistral, and Qwen2/Qwen3
(-MoE) with `use_sliding_window`. The model is Llama's (models/llama.py); its attention kind
is `kv/kinds/window.py`, each windowed layer reading the last `sliding_window` tokens."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.kv.kinds import AttentionKind, window
from pypto_serving.models.config import ModelConfig
from pypto_serving.models.llama import Attention, CausalLM, DecoderLayer
from pypto_serving.ops.attention import KVAttention


class WindowedAttention(Attention):
    """GQA's projections; attention within its window (None: every token)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: Group, size: int | None) -> None:
        super().__init__(cfg, layer, tp)
        self.window = size

    def attend(
        self, kv: KVAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return window.attend(kv, self.layer, q, k, v, self.window)


class WindowedDecoderLayer(DecoderLayer):
    attention_type: type[WindowedAttention] = WindowedAttention
    """The layer's attention class (a model's own: Gemma 3's, gpt-oss's)."""

    def attention(
        self, cfg: ModelConfig, layer: int, groups: ParallelGroups, index: int
    ) -> nn.Module:
        size = cfg.sliding_window if index in cfg.window_layers else None
        return self.attention_type(cfg, layer, groups.tp, size)


class WindowedCausalLM(CausalLM):
    """A Llama-family model with sliding-window layers (`cfg.window_layers`, by checkpoint
    index: a pipeline stage's layers keep theirs)."""

    layer_type = WindowedDecoderLayer
    attention_kind: ClassVar[AttentionKind] = window
