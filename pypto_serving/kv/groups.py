"""The KV the scheduler and the executor see: every group of a model's attention layers,
each a manager over its pool (`KVGroups`).

A model declares, through its attention kind, its groups (`spec.KVGroup`): GQA and MLA have
one, of full attention; DeepSeek-V4's compressed attention two (its entries, kept whole, and
its rows, kept for a window). Each group has its own page geometry, so its own pool and page
ids. The scheduler's questions are answered by asking every group:

- a prefix hit is the longest length every group can serve: each claims by its own rule up
  to what the groups before it claimed, then every claim is settled to the shortest (a
  window whose settled claim leaves a gap claims again, and the others follow it down);
- an admission (`allocate`) needs every group, and takes pages from all or none;
- preemption swaps every group's pages or none.

Nothing here names a kind or a page id: the groups' managers hold the page tables.
"""

from __future__ import annotations

from pypto_serving.kv.events import KVEvent
from pypto_serving.kv.handoff import GroupKV, PageGeometry
from pypto_serving.kv.manager import KVManager
from pypto_serving.kv.pool import KVPool
from pypto_serving.kv.tier import TierStats, merge_tier_stats
from pypto_serving.request import Request


class KVGroups:
    """The managers of a model's groups, in the order its kind declares them (the first is
    the one whose pages events report and `cached_tokens_by_tier` counts: a full-attention
    group's, where there is one)."""

    def __init__(self, managers: list[KVManager]) -> None:
        assert managers and len({m.page_size for m in managers}) == 1
        self.managers = managers
        self.pool: KVPool = managers[0].pool
        """The first group's pool (whose events are reported)."""
        self.page_size = managers[0].page_size

    def manager(self, name: str) -> KVManager:
        return next(m for m in self.managers if m.name == name)

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the device pages can hold: what the full-attention groups'
        pages hold (a window's pages are reused as it moves)."""
        full = [m.pool.num_pages * m.page_size for m in self.managers if m.keep is None]
        return min(full) if full else 2**62

    def usage(self) -> float:
        """The fullest group's share of device pages held."""
        return max(m.pool.usage() for m in self.managers)

    def describe(self) -> str:
        """The groups' pools and tiers, for the start-up log."""
        if len(self.managers) == 1:
            return f"KV tiers: {self.pool.describe()}"
        parts = [
            f"{m.name} ({'every token' if m.keep is None else f'{m.keep} tokens kept'}): "
            f"{m.pool.describe()}"
            for m in self.managers
        ]
        return f"KV groups: {'; '.join(parts)}"

    def tier_stats(self) -> list[TierStats]:
        """Every group's counters, summed per tier."""
        merged: dict[str, TierStats] = {}
        for m in self.managers:
            for t in m.pool.tier_stats():
                merged[t.name] = merge_tier_stats(merged[t.name], t) if t.name in merged else t
        return list(merged.values())

    def events_taken(self) -> list[KVEvent]:
        """The first group's KV events since the last call (none where nobody listens)."""
        events = self.pool.events
        return events.take() if events is not None else []

    def close(self) -> None:
        for m in self.managers:
            m.pool.close()

    def keep_on_ssd(self) -> None:
        for m in self.managers:
            m.pool.keep_on_ssd()

    # --- the scheduler's questions -----------------------------------------------------------

    def num_cached_tokens(self, request: Request, limit: int | None = None) -> int | None:
        """Claim the longest prefix every group serves (at most `limit` tokens), or a swapped
        request's KV; None while a swapped request's KV does not fit yet."""
        rid = request.request_id
        swapped = [rid in m.swapped for m in self.managers]
        if any(swapped) and not all(swapped):  # one group only: recompute
            for m in self.managers:
                m.drop_swap(request)
        elif all(swapped):
            if not all(m.swap_in_fits(request) for m in self.managers):
                return None
            got = [m.claim(request) for m in self.managers]
            assert all(n == got[0] for n in got)
            return got[0]
        hit = limit
        for m in self.managers:
            n = m.claim(request, hit)
            assert n is not None
            hit = n if hit is None else min(hit, n)
        assert hit is not None
        while (settled := min(m.settle(request, hit) for m in self.managers)) < hit:
            hit = settled
        return hit

    def cached_tokens_by_tier(self, request: Request) -> dict[str, int]:
        """The tokens of the request's claim per tier they came from (the first group's)."""
        return self.managers[0].by_tier(request)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Pages for `num_new_tokens` more tokens in every group, or (False) in none."""
        if any(m.pages_needed(request, num_new_tokens) > m.pool.num_free for m in self.managers):
            return False
        return all([m.allocate(request, num_new_tokens) for m in self.managers])

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)

    def preempt(self, request: Request) -> bool:
        """Every group's pages swapped out, or (False: it recomputes) none."""
        swapped = [m.preempt(request) for m in self.managers]
        if not all(swapped):
            for m in self.managers:  # the ones that swapped forget it
                m.drop_swap(request)
            return False
        return True

    # --- handoffs between servers (disaggregated prefill and decode) --------------------------

    @property
    def layout_digest(self) -> str:
        """Identifies the groups' model, configuration and page layouts: a handoff moves only
        between servers of the same digest."""
        return "+".join(f"{m.name}:{m.pool.layout_digest}" for m in self.managers)

    def geometry(self) -> list[PageGeometry]:
        """How each group's page reads, in order (what a handoff's bytes are cut by)."""
        out = []
        for m in self.managers:
            page = m.pool.cache.read_page(0)
            out.append(PageGeometry(m.name, tuple(tuple(t.shape) for t in page), page[0].dtype))
        return out

    def export(self, request: Request, num_tokens: int) -> list[GroupKV]:
        """Every group's pages of the request's first `num_tokens` tokens (views of the
        device pages: copy them before the request is freed)."""
        return [m.export(request, num_tokens) for m in self.managers]

    def export_pages(self, request: Request, num_tokens: int) -> list[list[int]]:
        """Every group's device page ids that `export` reads (other ranks read their shares
        of the same pages)."""
        return [m.export_pages(request, num_tokens)[1] for m in self.managers]

    def reserve(self, request_id: str, pages: list[int]) -> bool:
        """Take each group's `pages` device pages for KV another server is about to send
        the request, or (False) none: the pool has not the room now."""
        done: list[KVManager] = []
        for m, n in zip(self.managers, pages, strict=True):
            if not m.reserve(request_id, n):
                for other in done:
                    other.unreserve(request_id)
                return False
            done.append(m)
        return True

    def unreserve(self, request_id: str) -> None:
        for m in self.managers:
            m.unreserve(request_id)

    def receive(self, request: Request, groups: list[GroupKV]) -> list[str]:
        """Hold KV another server computed for the request, every group's (`export` there):
        it is admitted as a swapped request is, its KV written into device pages then.
        Returns each group's key for it (other ranks hold their shares under them)."""
        assert [g.name for g in groups] == [m.name for m in self.managers]
        return [m.receive(request, g) for m, g in zip(self.managers, groups, strict=True)]

    # --- the executor's side -----------------------------------------------------------------

    def cache_full_pages(
        self, request: Request, num_computed_tokens: int, tokens: list[int] | None = None
    ) -> None:
        """Index every group's newly full pages; windows give back the pages they passed
        (tokens: as `KVManager.cache_full_pages` takes them)."""
        for m in self.managers:
            m.cache_full_pages(request, num_computed_tokens, tokens)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Every group gives back the request's pages past its first `num_tokens` tokens
        (the KV of rejected speculative drafts)."""
        for m in self.managers:
            m.trim(request, num_tokens)

    def pages(self, request_ids: list[str]) -> dict[str, list[list[int]]]:
        """The requests' page lists in each group (by name): what a step's batch carries."""
        return {m.name: m.pages(request_ids) for m in self.managers}

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        for m in self.managers:
            m.pool.observe_compute(num_tokens, seconds)
