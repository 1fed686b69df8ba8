"""What one attention kind's KV costs and how its pages are laid out (`KVSpec`).

Each attention kind declares its spec; the attention operator allocates its cache tensors
from it (`paged_cache.PagedCache`), the page pool and the tiers size their pages by it, and
the SSD tier keys its files by it, so pages of different kinds never mix.

    kind  tensors  stored heads        row (values per head per token)
    gqa   K and V  the KV heads        head_dim (int8: head_dim int8 values + a 4-byte scale)
    mla   latent   1 (shared by all)   kv_lora_rank + qk_rope_head_dim

A page holds `page_size` tokens of every layer: each of its tensors is
[layers, heads, page_size, row].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pypto_serving.errors import PyptoError
from pypto_serving.kv.native_attention import INT8_SCALE_BYTES

KINDS = ("gqa", "mla")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV layout of one attention kind over `num_layers` layers."""

    kind: str
    """"gqa" (K and V per KV head, MHA included) or "mla" (one latent entry per token)."""
    num_layers: int
    num_heads: int
    """Heads stored per token (GQA: this rank's KV heads; MLA: 1, shared by every head)."""
    head_dim: int
    """Values attention reads per head per token (GQA: head_dim; MLA: the entry's size)."""
    row: int
    """Elements stored per head per token: head_dim, or for int8 head_dim + 4 scale bytes."""
    page_size: int
    dtype: torch.dtype
    """The storage dtype (torch.int8 for an int8 cache)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PyptoError(f"unknown attention kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def num_tensors(self) -> int:
        """Tensors per page: K and V (GQA), or the one latent tensor (MLA: key and value)."""
        return 2 if self.kind == "gqa" else 1

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """The shape of each of a page's tensors: [layers, heads, page_size, row]."""
        return (self.num_layers, self.num_heads, self.page_size, self.row)

    @property
    def token_bytes_per_layer(self) -> int:
        """What one token's KV costs in one layer."""
        return self.num_tensors * self.num_heads * self.row * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: every tensor, every layer, `page_size` tokens."""
        return self.num_tensors * math.prod(self.page_shape) * self.dtype.itemsize

    def describe(self) -> str:
        """A stable one-line form (keys the SSD tier's pages)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.kind}|{self.num_tensors}x{list(self.page_shape)}|{dtype}"


def kv_spec_for(
    cfg: Any, num_layers: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> KVSpec:
    """The KV spec of a model config (this rank's share: `cfg` holds its heads, `num_layers`
    its layers): MLA where `cfg.kv_lora_rank` > 0, else GQA. An int8 cache is GQA only."""
    latent = getattr(cfg, "kv_lora_rank", 0) or 0
    if latent > 0:
        if kv_cache_dtype == "int8":
            raise PyptoError(
                "kv_cache_dtype int8 is for grouped-query attention; this model's attention "
                "is MLA (its latent cache stays in the model's dtype)"
            )
        entry = latent + cfg.qk_rope_head_dim
        return KVSpec("mla", num_layers, 1, entry, entry, page_size, dtype)
    row, store_dtype = cfg.head_dim, dtype
    if kv_cache_dtype == "int8":  # int8 values and their float32 scale
        row, store_dtype = cfg.head_dim + INT8_SCALE_BYTES, torch.int8
    return KVSpec("gqa", num_layers, cfg.num_kv_heads, cfg.head_dim, row, page_size, store_dtype)
