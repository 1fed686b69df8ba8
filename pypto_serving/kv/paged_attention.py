"""The paged attention operator: writes a step's new K/V into their slots, reads pages.

Tokens of a step arrive flat ([T], sequences concatenated). For each layer the operator
scatters the new k/v into the store's slots (slot = page * page_size + offset), gathers every
sequence's keys and values through its block table into a padded [B, max_ctx] batch and runs
one masked, causal, GQA-aware scaled-dot-product attention for all sequences.

To the compiler the operator is one opaque custom op, `pypto::paged_attention(q, k, v,
layer)`: the step's metadata and the KV tensors are reached through the active `StepAttention`
(set by the executor around the forward), so a compiled model never sees cache mutation or
the per-step shapes of the metadata (the vLLM "forward context" pattern).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from pypto_serving.kv.store import PagedKVStore

_active: list[StepAttention] = []


class StepAttention:
    """Attention metadata of one step over a PagedKVStore (built once, used by every layer)."""

    def __init__(
        self,
        store: PagedKVStore,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        max_q: int,
        max_ctx: int,
    ) -> None:
        """block_table [B, W]; slot_mapping [T]; q_lens, ctx_lens [B] (ctx includes new)."""
        self.store, self.slot_mapping = store, slot_mapping
        dev, page, batch = block_table.device, store.page_size, len(q_lens)
        j = torch.arange(max_ctx, device=dev)
        pages = block_table.gather(1, (j // page).expand(batch, -1))
        self.key_slots = pages * page + j % page  # [B, max_ctx]
        inside = j[None, :] < ctx_lens[:, None]  # [B, max_ctx]: keys that exist
        self.decode = max_q == 1
        if self.decode:  # one query per sequence: only padding keys need masking
            self.mask = None if batch == 1 else inside[:, None, None, :]
            return
        i = torch.arange(max_q, device=dev)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        self.q_index = (q_starts[:, None] + i[None, :]).clamp(max=len(slot_mapping) - 1)
        causal = j[None, None, :] <= (ctx_lens - q_lens)[:, None, None] + i[None, :, None]
        self.mask = (causal & inside[:, None, :])[:, None]  # [B, 1, max_q, max_ctx]
        valid = (i[None, :] < q_lens[:, None]).flatten()  # padded query rows to drop
        self.out_index = valid.nonzero().squeeze(1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.store.k_cache[layer], self.store.v_cache[layer]
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        keys = k_cache[self.key_slots].transpose(1, 2)  # [B, Hkv, max_ctx, D]
        values = v_cache[self.key_slots].transpose(1, 2)
        if self.decode:  # GQA as [B, Hkv, group, D] queries: no K/V expansion
            batch, heads, dim = q.shape
            queries = q.view(batch, keys.shape[1], heads // keys.shape[1], dim)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask)
            return out.reshape(batch, heads, dim)
        queries = q[self.q_index].transpose(1, 2)  # [B, H, max_q, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask, enable_gqa=True
        )
        out = out.transpose(1, 2)  # [B, max_q, H, D]
        return out.reshape(-1, *out.shape[2:])[self.out_index]  # [T, H, D]


@contextmanager
def active_step(step: StepAttention) -> Iterator[None]:
    """Make `step` the attention metadata the model's attention layers use."""
    _active.append(step)
    try:
        yield
    finally:
        _active.pop()


@torch.library.custom_op("pypto::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _active[-1].attend(layer, q, k, v)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class PagedKV:
    """What the model sees on the paged path: attention through the custom op."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, k, v, layer)
