"""Tests for the KV page pool and its prefix cache (pure bookkeeping, milliseconds)."""

from collections import Counter

import hypothesis.strategies as st
import pytest
from checkpoints import hash_chain as chain
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pypto_serving.kv.page_pool import PagePool, hash_page

PS = 4  # page size used by the example-based tests


def cached_request(pool: PagePool, tokens: list[int], salt: str | None = None) -> list[int]:
    """Allocate pages for `tokens`, cache every full page, free them in reverse; return ids."""
    pages = pool.allocate(-(-len(tokens) // pool.page_size))
    for i, h in enumerate(chain(tokens, pool.page_size, salt)):
        pool.cache_page(pages[i], h, tokens[i * pool.page_size : (i + 1) * pool.page_size])
    pool.free(pages[::-1])
    return pages


def test_allocation_order_and_reuse_order() -> None:
    pool = PagePool(num_pages=6, page_size=PS)
    assert pool.free_page_ids() == [0, 1, 2, 3, 4, 5]
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 1
    pool.free([2, 0])
    pool.free([4, 1, 3])
    assert pool.free_page_ids() == [5, 2, 0, 4, 1, 3]
    assert [pool.ref_count(p) for p in range(6)] == [0] * 6
    assert pool.allocate(4) == [5, 2, 0, 4]
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.num_free == 2  # the failed allocate changed nothing
    assert pool.allocate(0) == []


def test_free_below_zero_raises_and_changes_nothing() -> None:
    pool = PagePool(num_pages=3, page_size=PS)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([2])
    with pytest.raises(ValueError):
        pool.free([0, 1, 0])
    assert [pool.ref_count(p) for p in range(3)] == [1, 1, 0]
    assert pool.free_page_ids() == [2]


def test_prefix_hit_acquire_salt_mismatch_and_partial_page() -> None:
    pool = PagePool(num_pages=8, page_size=PS)
    tokens = list(range(100, 114))  # 3 full pages + 2 tokens
    pages = cached_request(pool, tokens)
    assert pages == [0, 1, 2, 3]
    hashes = chain(tokens, PS)
    assert pool.free_page_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    assert pool.cached_hashes() == {hashes[0]: 0, hashes[1]: 1, hashes[2]: 2}

    assert pool.lookup(tokens) == ([0, 1, 2], hashes)
    assert pool.lookup(tokens[:12]) == ([0, 1, 2], hashes)
    assert pool.lookup(tokens[:11]) == ([0, 1], hashes[:2])  # partial last page never matches
    assert pool.lookup(tokens[:3]) == ([], [])
    assert pool.lookup(tokens, salt="lora-1") == ([], [])
    diverged = [*tokens[:4], 0, *tokens[5:]]
    assert pool.lookup(diverged) == ([0], hashes[:1])  # stops at the first mismatching page
    assert pool.free_page_ids() == [4, 5, 6, 7, 3, 2, 1, 0]  # lookup changes nothing

    pool.acquire([0, 1])
    assert pool.free_page_ids() == [4, 5, 6, 7, 3, 2]
    assert pool.ref_count(0) == pool.ref_count(1) == 1
    pool.acquire([0])
    assert pool.ref_count(0) == 2
    assert pool.lookup(tokens) == ([0, 1, 2], hashes)  # still cached while in use


def test_salted_chain_hits_with_same_salt() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    tokens = list(range(8))
    cached_request(pool, tokens, salt="a")
    assert pool.lookup(tokens, salt="a") == ([0, 1], chain(tokens, PS, "a"))
    assert pool.lookup(tokens) == ([], [])


def test_lazy_eviction_drops_only_reused_hashes() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    tokens = list(range(12))
    hashes = chain(tokens, PS)
    cached_request(pool, tokens)  # pages 0,1,2 cached; freed as 2,1,0
    assert pool.free_page_ids() == [3, 2, 1, 0]
    assert pool.num_evictions == 0
    assert len(pool.cached_hashes()) == 3  # freeing keeps them findable

    assert pool.allocate(1) == [3]  # uncached page: nothing evicted
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [2]  # the request's tail page goes first
    assert pool.num_evictions == 1
    assert pool.page_hash(2) is None
    assert pool.cached_hashes() == {hashes[0]: 0, hashes[1]: 1}
    assert pool.lookup(tokens) == ([0, 1], hashes[:2])


def test_hash_collision_never_serves_wrong_tokens() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    pages = pool.allocate(1)
    pool.cache_page(pages[0], hash_page(None, [1, 2, 3, 4]), [1, 2, 3, 4])
    # Forge a collision: the hash of [5, 6, 7, 8] now points at a page holding [1, 2, 3, 4].
    pool._index[hash_page(None, [5, 6, 7, 8])] = pool._pages[pages[0]]
    assert pool.lookup([5, 6, 7, 8]) == ([], [])
    assert pool.lookup([1, 2, 3, 4]) == (pages, [hash_page(None, [1, 2, 3, 4])])


def test_duplicate_cache_page_keeps_first_canonical() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    tokens = [9, 8, 7, 6]
    h = hash_page(None, tokens)
    a, b = pool.allocate(2)
    pool.cache_page(a, h, tokens)
    pool.cache_page(b, h, tokens)
    pool.cache_page(a, h, tokens)  # re-caching under its own hash is a no-op
    assert pool.cached_hashes() == {h: a}
    assert pool.page_hash(a) == h
    assert pool.page_hash(b) is None
    pool.free([b, a])
    assert pool.lookup(tokens) == ([a], [h])
    assert pool.allocate(3) == [2, 3, b]  # reusing the duplicate evicts nothing
    assert pool.num_evictions == 0
    assert pool.cached_hashes() == {h: a}


def test_cache_page_validation() -> None:
    pool = PagePool(num_pages=2, page_size=PS)
    (page,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.cache_page(page, b"x" * 16, [1, 2, 3])  # not a full page
    with pytest.raises(ValueError):
        pool.cache_page(1, b"x" * 16, [1, 2, 3, 4])  # free page
    pool.cache_page(page, b"x" * 16, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        pool.cache_page(page, b"y" * 16, [1, 2, 3, 4])  # already cached under another hash


def test_prefix_caching_disabled() -> None:
    pool = PagePool(num_pages=4, page_size=PS, enable_prefix_caching=False)
    tokens = list(range(8))
    cached_request(pool, tokens)
    assert pool.cached_hashes() == {}
    assert pool.lookup(tokens) == ([], [])
    assert pool.page_hash(0) is None


def test_hash_page_stability() -> None:
    h = hash_page(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 16
    assert hash_page(None, [1, 2, 3, 4]) == h
    assert hash_page(None, (1, 2, 3, 4)) == h
    distinct = {
        h,
        hash_page(h, [1, 2, 3, 4]),
        hash_page(b"", [1, 2, 3, 4]),
        hash_page(None, [1, 2, 3, 5]),
        hash_page(None, [1, 2, 3]),
        hash_page(None, [1, 2, 3, 4], salt="a"),
        hash_page(None, [1, 2, 3, 4], salt="b"),
        hash_page(None, [1, 2, 3, 4], salt=""),
        hash_page(None, [2**40, -1]),
    }
    assert len(distinct) == 9


class PagePoolMachine(RuleBasedStateMachine):
    """Requests each hold a list of pages; the pool's bookkeeping must match this model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(num_pages=1, page_size=1)
        self.requests: dict[int, dict] = {}  # id -> {"pages", "tokens", "salt", "hashes"}
        self.next_id = 0
        self.history: list[tuple[list[int], str | None]] = []  # (tokens, salt) of freed requests

    @initialize(
        num_pages=st.integers(1, 12),
        page_size=st.integers(1, 3),
        enabled=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_pages: int, page_size: int, enabled: bool) -> None:
        self.pool = PagePool(num_pages, page_size, enable_prefix_caching=enabled)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.page_size)

    def _allocate(self, n: int) -> list[int] | None:
        """Allocate, checking ValueError on shortage and the eviction count on success."""
        free = self.pool.free_page_ids()
        if n > len(free):
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            assert self.pool.free_page_ids() == free
            return None
        evicted = sum(self.pool.page_hash(p) is not None for p in free[:n])
        before = self.pool.num_evictions
        assert self.pool.allocate(n) == free[:n]
        assert self.pool.num_evictions == before + evicted
        return free[:n]

    def _add(self, pages: list[int], tokens: list[int], salt: str | None, hashes: list) -> None:
        self.requests[self.next_id] = {
            "pages": pages,
            "tokens": tokens,
            "salt": salt,
            "hashes": hashes,
        }
        self.next_id += 1

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8),
        salt=st.sampled_from([None, "s"]),
    )
    def new_request(self, tokens: list[int], salt: str | None) -> None:
        pages = self._allocate(self._pages_for(len(tokens)))
        if pages is not None:
            self._add(pages, tokens, salt, [])

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def extend_request(self, data: st.DataObject, extra: list[int]) -> None:
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        need = self._pages_for(len(req["tokens"]) + len(extra)) - len(req["pages"])
        pages = self._allocate(need)
        if pages is not None:
            req["pages"] += pages
            req["tokens"] += extra

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cache_full_pages(self, data: st.DataObject) -> None:
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        ps = self.pool.page_size
        hashes = chain(req["tokens"], ps, req["salt"])
        for i in range(len(req["hashes"]), len(hashes)):
            chunk = req["tokens"][i * ps : (i + 1) * ps]
            self.pool.cache_page(req["pages"][i], hashes[i], chunk)
            if self.pool.enable_prefix_caching:
                assert hashes[i] in self.pool.cached_hashes()
        req["hashes"] = hashes

    @precondition(lambda self: self.requests or self.history)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=5))
    def share_prefix(self, data: st.DataObject, suffix: list[int]) -> None:
        sources = [(r["tokens"], r["salt"]) for r in self.requests.values()] + self.history
        old_tokens, salt = data.draw(st.sampled_from(sources))
        keep = data.draw(st.one_of(st.just(len(old_tokens)), st.integers(0, len(old_tokens))))
        tokens = old_tokens[:keep] + suffix
        if not tokens:
            return
        expected_hashes = []
        index = self.pool.cached_hashes()
        for h in chain(tokens, self.pool.page_size, salt):
            if h not in index:
                break
            expected_hashes.append(h)
        hit_pages, hit_hashes = self.pool.lookup(tokens, salt)
        assert hit_hashes == expected_hashes
        assert hit_pages == [index[h] for h in expected_hashes]
        need = self._pages_for(len(tokens)) - len(hit_pages)
        revived = sum(self.pool.ref_count(p) == 0 for p in hit_pages)
        if need > self.pool.num_free - revived:
            return
        self.pool.acquire(hit_pages)
        assert all(p not in self.pool.free_page_ids() for p in hit_pages)
        pages = self._allocate(need)
        assert pages is not None
        self._add(hit_pages + pages, tokens, salt, hit_hashes)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        req = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
        index = self.pool.cached_hashes()
        self.pool.free(req["pages"][::-1])
        self.history.append((req["tokens"], req["salt"]))
        assert self.pool.cached_hashes() == index  # freeing never evicts

    @invariant()
    def bookkeeping_matches_model(self) -> None:
        pool = self.pool
        held = Counter(p for req in self.requests.values() for p in req["pages"])
        refs = [pool.ref_count(p) for p in range(pool.num_pages)]
        assert refs == [held[p] for p in range(pool.num_pages)]
        used = sum(r > 0 for r in refs)
        assert pool.num_free + used == pool.num_pages
        free = pool.free_page_ids()
        assert len(free) == len(set(free)) == pool.num_free
        assert set(free) == {p for p in range(pool.num_pages) if refs[p] == 0}
        for h, page_id in pool.cached_hashes().items():
            assert pool.page_hash(page_id) == h
        if not self.requests:
            assert pool.num_free == pool.num_pages

    def teardown(self) -> None:
        for req in list(self.requests.values()):
            self.pool.free(req["pages"][::-1])
        assert self.pool.num_free == self.pool.num_pages


PagePoolMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestPagePoolMachine = PagePoolMachine.TestCase
