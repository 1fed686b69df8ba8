"""What one attention kind's KV costs and how its pages are laid out (`KVSpec`).

Each attention kind (`kv/kinds/`) builds its spec from the model config; the attention
operator allocates its cache tensors from it (`paged_cache.PagedCache`), the page pool and
the tiers size their pages by it, and the SSD tier keys its files by it, so pages of
different kinds never mix. Nothing here knows the kinds: a spec says what its kind stores.

    kind  tensors  stored heads        row (values per head per token)
    gqa   K and V  the KV heads        head_dim (int8: head_dim int8 values + a 4-byte scale)
    mla   latent   1 (shared by all)   kv_lora_rank + qk_rope_head_dim

A page holds `page_size` tokens of every layer: each of its tensors is
[layers, heads, page_size, row].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV layout of one attention kind over `num_layers` layers."""

    kind: str
    """The kind's name ("gqa", "mla", ...): it names the kind in logs and in `describe`."""
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
    num_tensors: int = field(kw_only=True)
    """Tensors per page: K and V (GQA), or one tensor read as both (MLA's latent)."""
    same_on_tp_ranks: bool = field(default=False, kw_only=True)
    """Whether every tensor-parallel rank stores the same KV (MLA's latent: the latent
    projection is replicated) rather than its own share of the heads: the CPU tier then
    keeps one copy, rank 0's."""

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


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One group of an attention kind's layers as its kind declares it (`kv_groups`): a page
    layout, and the rule its manager (`kv/manager.py`) claims prefix hits and keeps pages by."""

    name: str
    """Names the group (and its SSD folder when a model has several)."""
    spec: KVSpec
    keep: int | None = None
    """Tokens before the next one that the group's layers still read (a sliding window's
    rows); None: every one (full attention)."""
