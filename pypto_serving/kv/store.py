"""The paged KV store: KV tensors, per-request page tables, prefix reuse, capacity answers.

It owns everything about where KV lives. The scheduler asks it capacity questions
(`num_cached_tokens`, `allocate`, `free`); the executor asks it for the attention operator
of a step (`attention`), which writes the step's new K/V into their slots and reads pages.

Page lifecycle (prefix caching on):

    free (LRU) ──allocate──▶ owned by a request ──filled──▶ full page: hashed, indexed
        ▲                                                         │ other requests with the
        │  evicted lazily: its hash is dropped only when          │ same prefix acquire it
        │  allocate reuses the page                               ▼ (ref count > 1)
        └───────────────── ref count reaches 0: back to the LRU tail, still indexed
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pypto_serving.kv.page_pool import PagePool, hash_page
from pypto_serving.request import Request


@dataclass(slots=True)
class PageTable:
    """A request's pages, and the hash chain of its leading full pages that are cached."""

    pages: list[int]
    hashes: list[bytes]


class PagedKVStore:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.pool = PagePool(num_pages, page_size, enable_prefix_caching)
        self.page_size = page_size
        # head-major: a page of one head is a contiguous [page_size, head_dim] block, so a
        # sequence's keys gather page by page straight into the layout attention reads
        shape = (num_layers, num_kv_heads, num_pages * page_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.tables: dict[str, PageTable] = {}

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def usage(self) -> float:
        """Fraction of pages held by requests (cached-free pages count as free)."""
        return 1.0 - self.pool.num_free / max(self.pool.num_pages, 1)

    # --- capacity questions from the scheduler -------------------------------------------

    def num_cached_tokens(self, request: Request) -> int:
        """Claim the longest cached prefix of the request's tokens, leaving at least the last
        token to compute (its logits are needed). Returns the number of tokens covered."""
        tokens = request.token_ids
        pages, hashes = self.pool.lookup(tokens[: len(tokens) - 1], request.cache_salt)
        self.pool.acquire(pages)
        self.tables[request.request_id] = PageTable(pages, hashes)
        return len(pages) * self.page_size

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request pages for `num_new_tokens` more tokens; False if there are too few."""
        table = self.tables.get(request.request_id) or PageTable([], [])
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // self.page_size) - len(table.pages)
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            table.pages += self.pool.allocate(needed)
        self.tables[request.request_id] = table
        return True

    def free(self, request: Request) -> None:
        table = self.tables.pop(request.request_id, None)
        if table is not None:  # tail pages first into the LRU, so they are evicted first
            self.pool.free(table.pages[::-1])

    # --- the executor's side ---------------------------------------------------------------

    def cache_full_pages(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's pages that became full (their K/V are now written)."""
        table = self.tables[request.request_id]
        num_full = num_computed_tokens // self.page_size
        if not self.pool.enable_prefix_caching or len(table.hashes) >= num_full:
            return
        tokens = request.token_ids
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), num_full):
            chunk = tokens[i * self.page_size : (i + 1) * self.page_size]
            parent = hash_page(parent, chunk, request.cache_salt)
            self.pool.cache_page(table.pages[i], parent, chunk)
            table.hashes.append(parent)

    def block_table(self, request_ids: list[str]) -> torch.Tensor:
        """[B, max_pages] page ids of each request, padded with 0."""
        tables = [self.tables[r].pages for r in request_ids]
        width = max(len(t) for t in tables)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.long, device=self.k_cache.device)
