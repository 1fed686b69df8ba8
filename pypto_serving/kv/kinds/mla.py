"""Multi-head latent attention (MLA): DeepSeek-V2/V3. The whole kind: its KV spec, its paged
operator and custom op, its dense oracle, and `attend`, its model code's call.

Each token keeps one latent entry per layer, shared by every head: the normed latent c_kv
(kv_lora_rank values) followed by the roped k_pe (qk_rope_head_dim), one tensor
[layers, 1, slots, kv_lora_rank + qk_rope_head_dim]. The model absorbs its queries into the
latent space (models/deepseek.py), so attention is GQA's with one KV head whose keys and
values are the same entries: the same kernels and PyTorch path, the latent gathered once. The
latent projection is replicated under tensor parallelism, so every rank stores the same
entries (`same_on_tp_ranks`: the CPU tier keeps one copy). No int8 cache: it stays in the
model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from pypto_serving.errors import PyptoError
from pypto_serving.kv.paged_attention import StepAttention, current_step, paged_step
from pypto_serving.kv.spec import KVGroup, KVSpec
from pypto_serving.ops.attention import DenseKV, KVAttention, causal_attention

NAME = "mla"
KERNELS = True
NATIVE_DECODE = False
OWN_KERNELS = False
SPECULATES = True

step = paged_step
"""Its step: `StepAttention` over its one group of full attention."""


def kv_spec(
    cfg: Any, num_layers: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> KVSpec:
    """One entry of `cfg.kv_lora_rank + cfg.qk_rope_head_dim` values per token, one head."""
    if kv_cache_dtype == "int8":
        raise PyptoError(
            "kv_cache_dtype int8 is for grouped-query attention; this model's attention "
            "is MLA (its latent cache stays in the model's dtype)"
        )
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return KVSpec(
        NAME, num_layers, 1, entry, entry, page_size, dtype, num_tensors=1, same_on_tp_ranks=True
    )


def kv_groups(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> list[KVGroup]:
    """One group, of full attention: every layer, every token kept."""
    return [KVGroup(NAME, kv_spec(cfg, len(layers), page_size, dtype, kv_cache_dtype))]


def attend(
    kv: KVAttention, layer: torch.Tensor, q: torch.Tensor, entry: torch.Tensor
) -> torch.Tensor:
    """Store entry [T, E] of the new tokens, attend q [T, heads, E] causally over the
    sequence's cached entries, each both key and value, with scale E**-0.5 (the model
    pre-scales q), and return [T, heads, E] (softmax(q entries^T E**-0.5) @ entries).
    `layer` is the layer's index as a 0-d CPU tensor."""
    if isinstance(kv, DenseKV):
        return dense_attend(kv, int(layer), q, entry)
    return paged_latent_attention(q, entry, layer)


def dense_attend(kv: DenseKV, layer: int, q: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    """The oracle: the sequence's entries so far as one KV head's keys and values."""
    (entries,) = kv.extend(layer, entry)
    return causal_attention(q, entries[:, None, :], entries[:, None, :])


def paged_attend(
    step: StepAttention, layer: int, q: torch.Tensor, entry: torch.Tensor
) -> torch.Tensor:
    """Write entry [T, E] into its slots of layer `layer` (once), attend q [T, H, E] over the
    step's pages of entries as keys and values both (one KV head)."""
    latent = step.cache.k_cache[layer]  # [1, slots, E]
    latent[0].index_copy_(0, step.slot_mapping, entry)
    return step.attend(q, latent, latent)


@torch.library.custom_op("pypto::paged_latent_attention", mutates_args=())
def paged_latent_attention(
    q: torch.Tensor, entry: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    """The compiled graphs' view of the paged operator: opaque, over the active step."""
    return paged_attend(current_step(), int(layer), q, entry)


@paged_latent_attention.register_fake
def _(q: torch.Tensor, entry: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)
