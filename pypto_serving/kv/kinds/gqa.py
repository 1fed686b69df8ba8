"""Grouped-query attention (GQA; MHA is its case of one query head per KV head): Llama, Qwen2,
Qwen3, Qwen3-MoE. The whole kind: its KV spec, its paged operator and custom op, its dense
oracle, and `attend`, its model code's call.

Each token keeps its K and V per KV head: two tensors [layers, kv_heads, slots, head_dim]. With
`kv_cache_dtype="int8"` (native kernels only) each row is head_dim int8 values followed by
their float32 scale, quantized by the kernel as it writes.
"""

from __future__ import annotations

from typing import Any

import torch

from pypto_serving.kv.native_attention import INT8_SCALE_BYTES, store_kv
from pypto_serving.kv.paged_attention import StepAttention, current_step, paged_step
from pypto_serving.kv.spec import KVGroup, KVSpec
from pypto_serving.ops.attention import DenseKV, KVAttention, causal_attention

NAME = "gqa"
KERNELS = True
NATIVE_DECODE = True
OWN_KERNELS = False
SPECULATES = True

step = paged_step
"""Its step: `StepAttention` over its one group of full attention."""


def kv_spec(
    cfg: Any, num_layers: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> KVSpec:
    """K and V of this rank's KV heads (`cfg.num_kv_heads`), `cfg.head_dim` values each."""
    row, store_dtype = cfg.head_dim, dtype
    if kv_cache_dtype == "int8":  # int8 values and their float32 scale
        row, store_dtype = cfg.head_dim + INT8_SCALE_BYTES, torch.int8
    heads = cfg.num_kv_heads
    return KVSpec(NAME, num_layers, heads, cfg.head_dim, row, page_size, store_dtype, num_tensors=2)


def kv_groups(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> list[KVGroup]:
    """One group, of full attention: every layer, every token kept."""
    return [KVGroup(NAME, kv_spec(cfg, len(layers), page_size, dtype, kv_cache_dtype))]


def attend(
    kv: KVAttention, layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Store k/v [T, kv_heads, D] of the new tokens, attend q [T, heads, D] causally over
    everything cached for their sequences, and return [T, heads, D]. `layer` is the layer's
    index as a 0-d CPU tensor (so that compiled layers share one graph)."""
    if isinstance(kv, DenseKV):
        return dense_attend(kv, int(layer), q, k, v)
    return paged_attention(q, k, v, layer)


def dense_attend(
    kv: DenseKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The oracle: the sequence's keys and values so far, then causal attention."""
    k, v = kv.extend(layer, k, v)
    return causal_attention(q, k, v)


def paged_attend(
    step: StepAttention,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k, v [T, Hkv, D] into their slots of layer `layer`, attend q [T, H, D] over the
    step's pages (with the layer's attention `sinks` [H] where it has them)."""
    k_cache, v_cache = step.cache.k_cache[layer], step.cache.v_cache[layer]
    kernel, slots = step.kernel, step.slot_mapping
    if kernel is None or not store_kv(kernel, k, v, k_cache, v_cache, slots):
        if k_cache.dtype == torch.int8:  # the kernel quantizes: give it contiguous rows
            assert kernel is not None, "an int8 cache is built with the kernels"
            k, v = k.contiguous(), v.contiguous()
            stored = store_kv(kernel, k, v, k_cache, v_cache, slots)
            assert stored, "contiguous keys and values are always stored"
        else:
            k_cache.index_copy_(1, slots, k.transpose(0, 1))
            v_cache.index_copy_(1, slots, v.transpose(0, 1))
    return step.attend(q, k_cache, v_cache, sinks)


@torch.library.custom_op("pypto::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    """The compiled graphs' view of the paged operator: opaque, over the active step."""
    return paged_attend(current_step(), int(layer), q, k, v)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)
