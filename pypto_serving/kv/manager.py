"""A KV group's manager: the logical side of one attention kind's KV over its physical pool.

An attention kind declares its groups of layers (`spec.KVGroup`: a page layout and a rule),
and each group gets a manager over a pool of its own page geometry (`pool.KVPool`). The
manager does everything logical, the pool carries it out:

- the per-request page table (the pages the operator computes its block table and slot
  mapping from), and which tier each page of an admission's claim came from;
- allocating pages for N new tokens and freeing them (the only caller of the pool's
  `allocate` and `free`);
- deciding a prefix hit by the kind's rule over the pool's index: full attention claims the
  longest run of cached pages from the start; a kind that reads only the last `keep` tokens
  before the next one (a sliding window; DeepSeek-V4's rows) needs only the pages of its
  window, with gaps before it, and claims only those;
- releasing the pages a window has passed while a request runs;
- preemption: swapping a request's pages out to CPU slots when that costs less than
  recomputing them, and back when it resumes.

    full   ▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓     every page of the prefix, from the start
    window ░░░░░░░░░░░░░░░░░░░░░░▓▓▓▓▓▓     pages wholly before the window: given back
                                            (still cached: a later prompt may hit them)
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from pypto_serving.kv.handoff import GroupKV
from pypto_serving.kv.page_pool import hash_page
from pypto_serving.kv.pool import Hit, KVPool
from pypto_serving.kv.tier import PageKV
from pypto_serving.request import Request

Tokens = tuple[int, ...]


@dataclass(slots=True)
class PageTable:
    """A request's pages, and the hash chain of its leading full pages that are cached. A
    windowed group leaves -1 in place of the leading pages it gave back (`released`)."""

    pages: list[int]
    hashes: list[bytes]
    released: int = 0
    sources: list[str] = field(default_factory=list, compare=False)
    """Where each page of the admission's prefix claim came from ("device", "cpu", "ssd";
    "" for a page left out)."""
    received: int = field(default=0, compare=False)
    """Tokens whose KV another server computed and handed over (a handoff's admission:
    `receive`), counted as the "handoff" source."""


@dataclass(slots=True)
class _Swapped:
    """A request preempted by swap: the key its pages are held under in the pool, its computed
    tokens, full pages' hashes, and how many leading pages it had released (held as -1, not
    swapped)."""

    key: str
    num_tokens: int
    hashes: list[bytes]
    released: int = 0
    received: list[PageKV] | None = None
    """Pages another server sent (`receive`), held here rather than in the CPU tier."""


def window_end(hits: list[Hit], span: int) -> int:
    """The longest prefix of `hits` whose last `span` pages are all held somewhere: what a
    window of `span` pages needs of a prefix."""
    end = len(hits)
    while end > 0 and any(h.gap for h in hits[max(end - span, 0) : end]):
        end -= 1
    return end


class KVManager:
    """The pages one group holds for each request, by its kind's rule: `keep` None reads
    every token before the next one (full attention); else only the last `keep`."""

    def __init__(self, name: str, pool: KVPool, keep: int | None = None) -> None:
        self.name, self.pool, self.keep = name, pool, keep
        self.page_size = pool.page_size
        self.tables: dict[str, PageTable] = {}
        self.swapped: dict[str, _Swapped] = {}
        self.reserved: dict[str, list[int]] = {}
        """Device pages taken for KV another server is sending a request (`reserve`), which
        it is admitted into."""
        self._lookups: dict[str, Counter[tuple[str, str]]] = {}
        """Hits and misses of a claim, counted once its request is admitted (allocate)."""
        self._swaps = itertools.count()
        """Numbers the keys swapped pages are held under (the pool knows no requests)."""

    @property
    def span(self) -> int | None:
        """The pages a window of `keep` tokens reaches into (None: full attention)."""
        return None if self.keep is None else -(-self.keep // self.page_size)

    # --- prefix hits -----------------------------------------------------------------------

    def claim(self, request: Request, limit: int | None = None) -> int | None:
        """Claim the longest prefix of the request's tokens whose KV this group's rule can
        serve from the pool (loading lower-tier pages into the device), leaving at least the
        last token to compute (its logits are needed), and at most `limit` tokens; a request
        preempted by swap gets its KV back. Returns the tokens covered, or None when a
        swapped request's KV does not fit the device yet."""
        if request.request_id in self.swapped:
            return self._swap_in(request)
        span = self.span
        hits, counts = self.pool.locate(self._chain(request, limit), gaps=span is not None)
        self._lookups[request.request_id] = counts
        if span is not None:  # the window's pages, and gaps (page_id -1, no tier) before it
            end = window_end(hits, span)
            gaps = [Hit(h.page_hash, h.token_ids, None) for h in hits[: max(end - span, 0)]]
            hits = gaps + hits[len(gaps) : end]
        if not self.pool.loads_pay(hits, self.page_size):  # recompute from the first load
            hits = hits[: next(i for i, h in enumerate(hits) if h.tier is not None)]
        self.pool.acquire([h.page_id for h in hits if h.tier is None and h.page_id >= 0])
        lower = [i for i, h in enumerate(hits) if h.tier is not None]
        if len(lower) > self.pool.num_free:  # no room to load them all: keep what fits
            hits = self._cut(hits, lower[self.pool.num_free])
        hits = self._load(hits)
        if span is not None:  # a cut above may have left a gap inside the window
            end = window_end(hits, span)
            self.pool.free([h.page_id for h in reversed(hits[end:]) if h.page_id >= 0])
            hits = hits[:end]
        released = sum(h.gap for h in hits)
        sources = [""] * released + [
            h.tier.name if h.tier is not None else "device" for h in hits[released:]
        ]
        table = PageTable([h.page_id for h in hits], [h.page_hash for h in hits], released, sources)
        self.tables[request.request_id] = table
        return len(hits) * self.page_size

    def _chain(self, request: Request, limit: int | None) -> Iterator[tuple[bytes, Tokens]]:
        """The prompt's full pages and their chain hashes, hashed as the walk asks: none
        holding the last token, nor past `limit` tokens."""
        tokens, ps = request.token_ids, self.page_size
        end = len(tokens) - ps if limit is None else min(len(tokens) - ps, limit - ps + 1)
        parent = None
        for start in range(0, end, ps):
            chunk = tuple(tokens[start : start + ps])
            parent = hash_page(parent, chunk, request.cache_salt)
            yield parent, chunk

    def _cut(self, hits: list[Hit], end: int) -> list[Hit]:
        """Keep hits[:end]; release the device pages acquired beyond it."""
        self.pool.free(
            [h.page_id for h in reversed(hits[end:]) if h.tier is None and h.page_id >= 0]
        )
        return hits[:end]

    def _load(self, hits: list[Hit]) -> list[Hit]:
        """Read the lower-tier hits back into fresh device pages (stopping at an unreadable
        page: a miss from there on)."""
        lower = [i for i, h in enumerate(hits) if h.tier is not None]
        if not lower:
            return hits
        read = self.pool.read(hits)
        if len(read.hits) < len(lower):
            hits = self._cut(hits, lower[len(read.hits)])
        parents = {h.page_hash: p.page_hash for p, h in itertools.pairwise(hits)}
        self.pool.write(read, self.pool.allocate(len(read.hits)), parents)
        return hits

    def by_tier(self, request: Request) -> dict[str, int]:
        """Tokens of the request's claim per tier they came from ("handoff": another server's,
        handed over)."""
        table = self.tables.get(request.request_id)
        counts = Counter(name for name in (table.sources if table else []) if name)
        out = {name: n * self.page_size for name, n in counts.items()}
        if table is not None and table.received:
            out["handoff"] = table.received
        return out

    def settle(self, request: Request, num_tokens: int) -> int:
        """Cut the request's claim back to its first `num_tokens` tokens (what every group
        serves); returns what it covers then: less only if the cut leaves a gap in the window
        (the window then claims again, up to `num_tokens`)."""
        table = self.tables[request.request_id]
        keep = num_tokens // self.page_size
        self.pool.free([p for p in table.pages[keep:][::-1] if p >= 0])
        del table.pages[keep:], table.hashes[keep:], table.sources[keep:]
        if self.keep is None:
            return num_tokens
        span = self.span or 0
        if any(p < 0 for p in table.pages[max(keep - span, 0) :]):
            self.free(request)
            got = self.claim(request, num_tokens)
            assert got is not None, "a request swapped in is never settled"
            return got
        self.release_before(request, num_tokens - self.keep)
        return num_tokens

    # --- allocation ------------------------------------------------------------------------

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        """Device pages `allocate(request, num_new_tokens)` would take."""
        table = self.tables.get(request.request_id)
        total = request.num_computed_tokens + num_new_tokens
        return max(-(-total // self.page_size) - (len(table.pages) if table else 0), 0)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request pages for `num_new_tokens` more tokens; False if there are too few."""
        table = self.tables.get(request.request_id) or PageTable([], [])
        needed = self.pages_needed(request, num_new_tokens)
        if needed > self.pool.num_free:
            return False
        table.pages += self.pool.allocate(needed)
        self.tables[request.request_id] = table
        self.pool.count(self._lookups.pop(request.request_id, Counter()))
        return True

    def free(self, request: Request) -> None:
        """Release the request's device pages; a finished request's swapped KV goes too."""
        self._lookups.pop(request.request_id, None)
        table = self.tables.pop(request.request_id, None)
        if table is not None:  # tail pages first into the LRU, so they are evicted first
            self.pool.free(table.pages[table.released :][::-1])
        if request.finished:
            self.drop_swap(request)  # (and any pages reserved for it)

    def drop_swap(self, request: Request) -> None:
        """Forget the request's swapped KV (if any): it recomputes instead."""
        entry = self.swapped.pop(request.request_id, None)
        if entry is not None and entry.received is None:
            self.pool.drop_held(entry.key)
        elif entry is not None:
            self.pool.drop_received(entry.key)
        self.unreserve(request.request_id)

    def release_before(self, request: Request, num_tokens: int) -> None:
        """Give back the request's full pages that lie wholly before token `num_tokens` (the
        window moved past them): they stay cached, to the LRU like a freed page's."""
        table = self.tables.get(request.request_id)
        end = min(num_tokens // self.page_size, len(table.pages)) if table else 0
        if table is None or end <= table.released:
            return
        self.pool.free(table.pages[table.released : end])
        table.pages[table.released : end] = [-1] * (end - table.released)
        table.released = end

    # --- preemption by swap -----------------------------------------------------------------

    def preempt(self, request: Request) -> bool:
        """Release a preempted request's device pages. Its computed KV moves to CPU slots
        (swap) when the pool has room and moving it out and back costs less than recomputing
        it; returns True if it did."""
        table = self.tables.get(request.request_id)
        num_tokens = request.num_computed_tokens
        released = table.released if table is not None else 0
        num_pages = -(-num_tokens // self.page_size) - released
        swap = (
            table is not None
            and num_tokens > 0
            and self.pool.can_hold(num_pages)
            and self.pool.swap_pays(num_pages, num_tokens)
        )
        if swap:
            assert table is not None
            key = f"{self.name}/{next(self._swaps)}"
            self.pool.hold(key, table.pages[released : released + num_pages])
            full = num_tokens // self.page_size
            entry = _Swapped(key, num_tokens, table.hashes[:full], released)
            self.swapped[request.request_id] = entry
        self.free(request)
        return swap

    def swap_in_fits(self, request: Request) -> bool:
        """Whether a swapped request's KV and its next token fit the device now (beside the
        pages reserved for it)."""
        entry = self.swapped[request.request_id]
        pages = -(-(entry.num_tokens + 1) // self.page_size) - entry.released
        return pages - len(self.reserved.get(request.request_id, ())) <= self.pool.num_free

    def _swap_in(self, request: Request) -> int | None:
        entry = self.swapped[request.request_id]
        num_pages = -(-entry.num_tokens // self.page_size) - entry.released
        if not self.swap_in_fits(request):
            return None  # wait until it and its next token fit
        start = time.perf_counter()
        del self.swapped[request.request_id]
        reserved = self.reserved.pop(request.request_id, None)
        assert reserved is None or len(reserved) == num_pages, "reserved for other KV"
        page_ids = [-1] * entry.released + (reserved or self.pool.allocate(num_pages))
        if entry.received is not None:
            self.pool.write_received(entry.key, entry.received, page_ids[entry.released :])
        else:
            self.pool.write_held(self.pool.take_held(entry.key), page_ids[entry.released :], start)
        tokens = request.token_ids
        for i, page_hash in enumerate(entry.hashes[entry.released :], entry.released):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            parent = entry.hashes[i - 1] if i > 0 else None
            self.pool.index(page_ids[i], page_hash, chunk, parent)
        received = entry.num_tokens if entry.received is not None else 0
        table = PageTable(page_ids, list(entry.hashes), entry.released, received=received)
        self.tables[request.request_id] = table
        return entry.num_tokens

    # --- handing a request's KV to another server (disaggregated prefill and decode) --------

    def export(self, request: Request, num_tokens: int) -> GroupKV:
        """The pages that hold the request's first `num_tokens` tokens (those its window still
        holds), as views of the device pages (to be copied before they are freed): what
        `receive` takes on another server."""
        released, page_ids = self.export_pages(request, num_tokens)
        pages = [self.pool.cache.read_page(p) for p in page_ids]
        return GroupKV(self.name, num_tokens, released, pages)

    def export_pages(self, request: Request, num_tokens: int) -> tuple[int, list[int]]:
        """The leading pages of the request's first `num_tokens` tokens its window gave
        back, and the ids of the device pages after them that hold the rest."""
        table = self.tables[request.request_id]
        end = -(-num_tokens // self.page_size)
        assert len(table.pages) >= end, "the request's pages hold fewer tokens"
        return min(table.released, end), table.pages[table.released : end]

    def reserve(self, request_id: str, num_pages: int) -> bool:
        """Take `num_pages` device pages for the KV another server is about to send a
        request (admitted into them: `receive`, then its swap-in); False, taking none, when
        the pool has not that many free."""
        if num_pages > self.pool.num_free:
            return False
        self.reserved[request_id] = self.pool.allocate(num_pages)
        return True

    def unreserve(self, request_id: str) -> None:
        """Give back the pages reserved for a request (its KV did not come, or it ended)."""
        pages = self.reserved.pop(request_id, None)
        if pages:
            self.pool.free(pages)

    def receive(self, request: Request, group: GroupKV) -> str:
        """Hold the KV another server computed for the request (`export` there), to be
        written into device pages when the request is admitted, as a swapped request's;
        returns the key it is held under (other ranks hold their shares under it)."""
        hashes = [page_hash for page_hash, _ in self._chain(request, group.num_tokens)]
        key = f"{self.name}/received/{request.request_id}"
        entry = _Swapped(key, group.num_tokens, hashes, group.released, group.pages)
        self.swapped[request.request_id] = entry
        return key

    # --- the executor's side ---------------------------------------------------------------

    def cache_full_pages(
        self, request: Request, num_computed_tokens: int, tokens: list[int] | None = None
    ) -> None:
        """Index the request's pages that became full (their KV is written now); a window
        gives back the pages it has passed. tokens: the request's tokens with those computed
        that are not its own yet (speculative drafts the step kept), else its own."""
        table = self.tables[request.request_id]
        num_full = num_computed_tokens // self.page_size
        if self.pool.prefix_caching and len(table.hashes) < num_full:
            tokens = request.token_ids if tokens is None else tokens
            parent = table.hashes[-1] if table.hashes else None
            for i in range(len(table.hashes), num_full):
                chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
                page_hash = hash_page(parent, chunk, request.cache_salt)
                if table.pages[i] >= 0:
                    self.pool.index(table.pages[i], page_hash, chunk, parent)
                table.hashes.append(page_hash)
                parent = page_hash
        if self.keep is not None:
            self.release_before(request, num_computed_tokens - self.keep)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's pages wholly past its first `num_tokens` tokens: a step
        wrote keys there for speculative drafts it then rejected (never indexed: a later
        token writes its own)."""
        table = self.tables[request.request_id]
        keep = -(-num_tokens // self.page_size)
        if len(table.pages) > keep:
            self.pool.free(table.pages[keep:][::-1])
            del table.pages[keep:]

    def pages(self, request_ids: list[str]) -> list[list[int]]:
        """The requests' page lists (-1 where a window gave a page back): what the attention
        operator computes its block table and slot mapping from."""
        return [self.tables[r].pages for r in request_ids]
