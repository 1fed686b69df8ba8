"""The paged attention operator for one step: writes new K/V into their slots, reads pages.

Tokens of the step arrive flat ([T], sequences concatenated). Each layer's call scatters the
new k/v into the store's slots (slot = page * page_size + offset), then gathers every
sequence's keys and values through its block table into a padded [B, max_ctx] batch and
runs one masked, causal, GQA-aware scaled-dot-product attention for all sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pypto_serving.kv.store import PagedKVStore


class PagedAttention:
    """Per-step attention metadata over a PagedKVStore; the model calls `attend` per layer."""

    def __init__(
        self,
        store: PagedKVStore,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
    ) -> None:
        """block_table [B, W]; slot_mapping [T]; q_lens, ctx_lens [B] (ctx includes new)."""
        self.store, self.slot_mapping = store, slot_mapping
        dev, page = block_table.device, store.page_size
        max_q, max_ctx = int(q_lens.max()), int(ctx_lens.max())
        j = torch.arange(max_ctx, device=dev)
        self.key_slots = (
            block_table.gather(1, (j // page).expand(len(q_lens), -1)) * page + j % page
        )
        i = torch.arange(max_q, device=dev)
        self.q_valid = i[None, :] < q_lens[:, None]  # [B, max_q]
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        self.q_index = (q_starts[:, None] + i[None, :]).clamp(max=len(slot_mapping) - 1)
        first_new = (ctx_lens - q_lens)[:, None, None]
        self.mask = (j[None, None, :] <= first_new + i[None, :, None]) & (
            j[None, None, :] < ctx_lens[:, None, None]
        )  # [B, max_q, max_ctx]: causal within the sequence, nothing past its end

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.store.k_cache[layer], self.store.v_cache[layer]
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        keys = k_cache[self.key_slots].transpose(1, 2)  # [B, Hkv, max_ctx, D]
        values = v_cache[self.key_slots].transpose(1, 2)
        queries = q[self.q_index].transpose(1, 2)  # [B, H, max_q, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask[:, None], enable_gqa=True
        )
        return out.transpose(1, 2)[self.q_valid]  # [T, H, D]
