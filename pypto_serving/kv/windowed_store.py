"""A KV of two page groups over the same tokens (`WindowedKVStore`): the scheduler's store for
an attention kind that keeps per-token rows only for a sliding window of recent tokens, and
other pages whole (DeepSeek-V4's compressed attention: its raw rows and compressor inputs
for the window; its compressed entries for the whole sequence).

Each group is a `PagedKVStore` of its own: its page pool, prefix index (the same hash chain:
page i of both covers tokens [i * page_size, (i + 1) * page_size)), CPU and SSD tiers and
swaps. This class answers the scheduler's four questions for both at once:

    rows   ░░░░░░░░░░░░░░░░░░░░░░▓▓▓▓▓▓     pages wholly before the window: given back
    pages  ▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓     (still cached: a later prompt may hit them)

- a prefix hit needs the whole pages of the prefix and only the rows of its last `keep`
  tokens (the rows before may have been evicted long ago): the pages' claim first, then the
  rows' up to it, with gaps before the window (`PagedKVStore.num_cached_tokens(window=)`),
  the pages' cut back if the rows reach less far;
- `allocate` takes pages from both or neither; preemption swaps both or neither;
- after each step (`cache_full_pages`) the rows' pages that the window has passed are given
  back (`PagedKVStore.release_before`): a long generation holds a bounded number of them.

The kind says how many tokens before the next one its rows must keep (`keep`): the window
and what its compressors still read.
"""

from __future__ import annotations

from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.store import PagedKVStore
from pypto_serving.kv.tier import TierStats, merge_tier_stats
from pypto_serving.request import Request


class WindowedKVStore:
    """`rows`: the per-token rows, of which the last `keep` tokens' are kept; `pages`: the
    pages kept whole. Both have the same page size."""

    journal = None
    """Never under tensor or pipeline parallelism (no journal of page moves)."""
    ssd = None
    """The groups' SSD tiers are their own (no agreed loads: one rank)."""

    def __init__(self, rows: PagedKVStore, pages: PagedKVStore, keep: int) -> None:
        assert rows.page_size == pages.page_size
        self.rows, self.pages_store, self.keep = rows, pages, keep
        self.page_size = pages.page_size

    @property
    def cache(self) -> PagedCache:
        """The pages kept whole (the rows' cache is `rows.cache`)."""
        return self.pages_store.cache

    @property
    def num_pages(self) -> int:
        return self.pages_store.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.pages_store.capacity_tokens

    def usage(self) -> float:
        return max(self.rows.usage(), self.pages_store.usage())

    def describe(self) -> str:
        return (
            f"window rows ({self.keep} tokens kept): {self.rows.describe()}; "
            f"whole pages: {self.pages_store.describe()}"
        )

    def tier_stats(self) -> list[TierStats]:
        """Both groups' counters, summed per tier."""
        merged: dict[str, TierStats] = {}
        for t in [*self.pages_store.tier_stats(), *self.rows.tier_stats()]:
            merged[t.name] = merge_tier_stats(merged[t.name], t) if t.name in merged else t
        return list(merged.values())

    def close(self) -> None:
        self.rows.close()
        self.pages_store.close()

    def keep_on_ssd(self) -> None:
        self.rows.keep_on_ssd()
        self.pages_store.keep_on_ssd()

    # --- the scheduler's questions -----------------------------------------------------------

    def num_cached_tokens(self, request: Request) -> int | None:
        rows, pages, rid = self.rows, self.pages_store, request.request_id
        if rid in rows.swapped or rid in pages.swapped:
            return self._swap_in(request)
        hit = pages.num_cached_tokens(request)
        assert hit is not None
        by_tier = request.cached_tokens_by_tier  # the whole pages' are what users see
        hit_rows = rows.num_cached_tokens(request, limit=hit, window=self.keep)
        assert hit_rows is not None
        request.cached_tokens_by_tier = by_tier
        if hit_rows < hit:
            pages.trim(request, hit_rows)
        rows.release_before(request, hit_rows - self.keep)
        return hit_rows

    def _swap_in(self, request: Request) -> int | None:
        rows, pages, rid = self.rows, self.pages_store, request.request_id
        if rid not in rows.swapped or rid not in pages.swapped:  # one group only: recompute
            rows.drop_swap(request)
            pages.drop_swap(request)
            return self.num_cached_tokens(request)
        if not (rows.swap_in_fits(request) and pages.swap_in_fits(request)):
            return None
        got = rows.num_cached_tokens(request), pages.num_cached_tokens(request)
        assert got[0] is not None and got[0] == got[1]
        return got[0]

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        for store in (self.rows, self.pages_store):
            if store.pages_needed(request, num_new_tokens) > store.pool.num_free:
                return False
        return self.rows.allocate(request, num_new_tokens) and self.pages_store.allocate(
            request, num_new_tokens
        )

    def free(self, request: Request) -> None:
        self.rows.free(request)
        self.pages_store.free(request)

    def preempt(self, request: Request) -> bool:
        swapped = self.rows.preempt(request), self.pages_store.preempt(request)
        if swapped[0] != swapped[1]:  # both or neither: the one that swapped forgets it
            self.rows.drop_swap(request)
            self.pages_store.drop_swap(request)
            return False
        return swapped[0]

    # --- the executor's side -----------------------------------------------------------------

    def cache_full_pages(self, request: Request, num_computed_tokens: int) -> None:
        """Index both groups' newly full pages; give back the rows the window has passed."""
        self.rows.cache_full_pages(request, num_computed_tokens)
        self.pages_store.cache_full_pages(request, num_computed_tokens)
        self.rows.release_before(request, num_computed_tokens - self.keep)

    def pages(self, request_ids: list[str]) -> list[list[int]]:
        """The whole pages' lists (the rows': `row_pages`)."""
        return self.pages_store.pages(request_ids)

    def row_pages(self, request_ids: list[str]) -> list[list[int]]:
        """The rows' page lists, -1 where a page was given back."""
        return self.rows.pages(request_ids)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        self.rows.observe_compute(num_tokens, seconds)
        self.pages_store.observe_compute(num_tokens, seconds)
