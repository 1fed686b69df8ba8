"""The attention operator's KV: its cache tensors, and the addresses of tokens in them.

The operator owns its cache: the tensors are allocated once from its kind's spec
(`spec.KVSpec`), one per kind of stored value, each [layers, heads, slots, row], with slot
= page * page_size + offset. Head-major: one head's page is a contiguous [page_size, row]
block, so a sequence's keys gather page by page straight into the layout attention reads,
and the native kernels read them in place.

    GQA   k_cache, v_cache   [layers, kv_heads, slots, head_dim (+4 int8 scale bytes)]
    MLA   latent             [layers, 1, slots, kv_lora_rank + qk_rope_head_dim]
                             (both key and value: k_cache and v_cache are this one tensor)

Below the operator the pool (`pool.KVPool`) hands out page ids and moves pages
between tiers; it reads and writes a page's bytes only through `read_page` / `write_page`.
From a step's page lists the operator computes its block table and slot mapping itself
(`block_table`, `slot_mapping`, used by `paged_attention.StepAttention`).
"""

from __future__ import annotations

import torch

from pypto_serving.device import zeros
from pypto_serving.kv.spec import KVSpec
from pypto_serving.kv.tier import PageKV


class PagedCache:
    """The cache tensors of one attention kind over `num_pages` pages."""

    def __init__(self, spec: KVSpec, num_pages: int, device: torch.device) -> None:
        self.spec, self.num_pages, self.page_size = spec, num_pages, spec.page_size
        shape = (spec.num_layers, spec.num_heads, num_pages * spec.page_size, spec.row)
        self.tensors = tuple(zeros(shape, spec.dtype, device) for _ in range(spec.num_tensors))
        """The stored tensors: (K, V) for GQA, (latent,) for MLA."""
        self.k_cache, self.v_cache = self.tensors[0], self.tensors[-1]
        """What attention reads as keys and values (MLA: the same latent tensor twice)."""

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    def read_page(self, page_id: int) -> PageKV:
        """Views of one page: each stored tensor's [layers, heads, page_size, row]."""
        slots = slice(page_id * self.page_size, (page_id + 1) * self.page_size)
        return tuple(t[:, :, slots] for t in self.tensors)

    def write_page(self, page_id: int, kv: PageKV) -> None:
        """Copy a page's tensors (as `read_page` gives them) into page `page_id`."""
        for dst, src in zip(self.read_page(page_id), kv, strict=True):
            dst.copy_(src)


def block_table(pages: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, max pages] int64: each sequence's page ids (its page list), padded with 0."""
    width = max(len(p) for p in pages)
    rows = [p + [0] * (width - len(p)) for p in pages]
    return torch.tensor(rows, dtype=torch.long, device=device)


def slot_mapping(
    table: torch.Tensor, q_lens: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """[T] the cache slot of each new token: sequence b's q_lens[b] tokens (flat, sequences
    one after another) at `positions` go to page table[b, pos // page_size], offset
    pos % page_size."""
    seq = torch.repeat_interleave(q_lens, output_size=len(positions))
    return table[seq, positions // page_size] * page_size + positions % page_size
