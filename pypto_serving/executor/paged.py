"""The paged executor: one batched forward per step over every scheduled request.

Prefill chunks and decodes of all requests go through the model together as one flat token
batch; attention reads and writes the paged KV store through block tables and a slot
mapping computed here with vectorised arithmetic (no per-token Python).
"""

from __future__ import annotations

import logging

import torch

from pypto_serving.config import CacheConfig
from pypto_serving.kv.paged_attention import PagedAttention
from pypto_serving.kv.store import PagedKVStore
from pypto_serving.models.llama import CausalLM
from pypto_serving.ops.sampler import Sampled, SamplingRow, sample
from pypto_serving.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def num_pages_for(cache: CacheConfig, page_bytes: int) -> int:
    return cache.num_kv_pages or max(cache.kv_cache_bytes // page_bytes, 1)


class PagedExecutor:
    def __init__(
        self, model: CausalLM, device: torch.device, dtype: torch.dtype, cache: CacheConfig
    ) -> None:
        self.model, self.device = model, device
        cfg = model.cfg
        page_bytes = (
            2 * cfg.num_layers * cache.page_size * cfg.kv_size * torch.finfo(dtype).bits // 8
        )
        num_pages = num_pages_for(cache, page_bytes)
        self.kv = PagedKVStore(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            num_pages,
            cache.page_size,
            dtype,
            device,
            cache.enable_prefix_caching,
        )
        log.info(
            "KV cache: %d pages x %d tokens (%.1f MiB)",
            num_pages,
            cache.page_size,
            num_pages * page_bytes / 2**20,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, Sampled]:
        reqs = [s.request for s in out.scheduled]
        starts = [r.num_computed_tokens for r in reqs]
        counts = [s.num_new_tokens for s in out.scheduled]
        token_ids: list[int] = []
        for r, start, n in zip(reqs, starts, counts, strict=True):
            token_ids += r.token_ids[start : start + n]
        dev = self.device
        q_lens = torch.tensor(counts, device=dev)
        ctx_lens = torch.tensor(starts, device=dev) + q_lens
        seq = torch.repeat_interleave(torch.arange(len(reqs), device=dev), q_lens)
        positions = (
            ctx_lens[seq]
            - q_lens[seq]
            + (torch.arange(len(token_ids), device=dev) - (torch.cumsum(q_lens, 0) - q_lens)[seq])
        )
        block_table = self.kv.block_table([r.request_id for r in reqs])
        page = self.kv.page_size
        slot_mapping = block_table[seq, positions // page] * page + positions % page
        attn = PagedAttention(self.kv, block_table, slot_mapping, q_lens, ctx_lens)
        hidden = self.model(torch.tensor(token_ids, device=dev), positions, attn)
        for r, start, n in zip(reqs, starts, counts, strict=True):
            self.kv.cache_full_pages(r, start + n)
        done = [b for b, r in enumerate(reqs) if starts[b] + counts[b] == r.num_tokens]
        if not done:
            return {}
        last = (torch.cumsum(q_lens, 0) - 1)[done]
        logits = self.model.logits(hidden[last])
        rows = [
            SamplingRow(
                reqs[b].params,
                reqs[b].prompt_token_ids,
                reqs[b].output_token_ids,
                reqs[b].generator,
                reqs[b].eos_token_ids,
            )
            for b in done
        ]
        return dict(zip([reqs[b].request_id for b in done], sample(logits, rows), strict=True))
