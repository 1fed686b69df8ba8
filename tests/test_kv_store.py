"""Tests for the KV's capacity API and prefix reuse: one full-attention group, a manager over
a pool (no model, milliseconds each).

Page size 4 throughout. A fresh pool hands out page ids in order; freed pages join the LRU
tail (a request's pages in reverse, so its tail pages are reused first).
"""

from collections.abc import Sequence

import pytest
from checkpoints import fake_kv_store, hash_chain

from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.manager import PageTable
from pypto_serving.kv.paged_cache import block_table
from pypto_serving.ops.sampler import Sampled
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

PS = 4


def make_store(num_pages: int = 8, enable_prefix_caching: bool = True) -> KVGroups:
    return fake_kv_store(num_pages, PS, enable_prefix_caching=enable_prefix_caching)


def make_request(request_id: str, prompt: list[int], salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return Request(request_id, prompt, params, arrival=0, cache_salt=salt)


def chain(token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
    return hash_chain(list(token_ids), PS, salt)


def admit(store: KVGroups, req: Request) -> list[int]:
    """What the scheduler and executor do for a whole prompt: claim the prefix hit, allocate the
    rest, compute it, index its full pages. Returns the request's page ids."""
    req.num_computed_tokens = store.num_cached_tokens(req)
    assert store.allocate(req, req.num_tokens - req.num_computed_tokens)
    store.cache_full_pages(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    return store.managers[0].tables[req.request_id].pages


def pages_of(store: KVGroups, request_id: str) -> list[int]:
    return store.managers[0].tables[request_id].pages


def test_fresh_pool_hands_out_pages_in_order() -> None:
    store = make_store()
    a = make_request("a", list(range(10)))
    assert store.num_cached_tokens(a) == 0
    assert store.managers[0].tables["a"] == PageTable([], [])
    assert store.allocate(a, 10)
    assert pages_of(store, "a") == [0, 1, 2]
    b = make_request("b", list(range(100, 105)))
    assert store.num_cached_tokens(b) == 0
    assert store.allocate(b, 5)
    assert pages_of(store, "b") == [3, 4]
    assert store.pool.device.free_page_ids() == [5, 6, 7]
    assert [store.pool.device.ref_count(p) for p in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert store.usage() == pytest.approx(5 / 8)
    assert store.capacity_tokens == 32
    assert (
        store.pool.cache.k_cache.shape == store.pool.cache.v_cache.shape == (1, 1, 32, 2)
    )  # [layer, head, slot, dim]


def test_chunked_prefill_allocates_only_what_the_chunk_needs() -> None:
    store = make_store()
    a = make_request("a", list(range(10)))
    store.num_cached_tokens(a)
    assert store.allocate(a, 3)
    assert pages_of(store, "a") == [0]
    a.num_computed_tokens = 3
    assert store.allocate(a, 1)  # tokens 0..3 still fit page 0
    assert pages_of(store, "a") == [0]
    a.num_computed_tokens = 4
    assert store.allocate(a, 6)  # tokens 4..9 need two more pages
    assert pages_of(store, "a") == [0, 1, 2]
    assert store.allocate(a, 6)  # asking again for the same tokens allocates nothing
    assert pages_of(store, "a") == [0, 1, 2]


def test_decode_allocates_a_page_exactly_when_crossing_a_page_boundary() -> None:
    store = make_store()
    a = make_request("a", list(range(7)))
    admit(store, a)
    assert pages_of(store, "a") == [0, 1]
    history = []
    for token in range(8):  # each iteration: sample a token, then compute it (a decode step)
        a.append(Sampled(token_id=50 + token, logprob=0.0, top_logprobs=None))
        assert store.allocate(a, 1)
        a.num_computed_tokens += 1
        history.append((a.num_computed_tokens, list(pages_of(store, "a"))))
    assert history == [
        (8, [0, 1]),
        (9, [0, 1, 2]),  # token 8 is the first of a new page
        (10, [0, 1, 2]),
        (11, [0, 1, 2]),
        (12, [0, 1, 2]),
        (13, [0, 1, 2, 3]),
        (14, [0, 1, 2, 3]),
        (15, [0, 1, 2, 3]),
    ]


def test_allocate_fails_without_changing_pages_when_pages_are_short() -> None:
    store = make_store(num_pages=4)
    a = make_request("a", list(range(12)))
    admit(store, a)
    assert pages_of(store, "a") == [0, 1, 2]
    free_before = store.pool.device.free_page_ids()
    hashes_before = list(store.managers[0].tables["a"].hashes)

    b = make_request("b", list(range(100, 108)))  # needs 2 pages, 1 is free
    assert not store.allocate(b, 8)
    # The store may leave `b` an empty table; the scheduler frees it either way.
    assert store.managers[0].tables.get("b", PageTable([], [])) == PageTable([], [])
    assert not store.allocate(a, 5)  # 17 tokens need 5 pages: 2 more, 1 free
    assert store.managers[0].tables["a"] == PageTable([0, 1, 2], hashes_before)
    assert store.pool.device.free_page_ids() == free_before == [3]
    assert [store.pool.device.ref_count(p) for p in range(4)] == [1, 1, 1, 0]

    assert store.allocate(a, 4)  # 16 tokens fit exactly in the whole pool
    assert pages_of(store, "a") == [0, 1, 2, 3]
    assert store.pool.num_free == 0


def test_free_returns_pages_to_the_lru_tail_in_reverse() -> None:
    store = make_store()
    a, b = make_request("a", list(range(10))), make_request("b", list(range(100, 105)))
    assert admit(store, a) == [0, 1, 2]
    assert admit(store, b) == [3, 4]
    store.free(a)
    assert "a" not in store.managers[0].tables
    assert store.pool.device.free_page_ids() == [5, 6, 7, 2, 1, 0]
    store.free(b)
    assert store.pool.device.free_page_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert store.managers[0].tables == {}
    store.free(b)  # freeing a request without pages is a no-op
    assert store.pool.device.free_page_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert store.usage() == 0.0


def test_cache_full_pages_indexes_only_full_pages_incrementally() -> None:
    store = make_store()
    tokens = list(range(10, 20))
    hashes = chain(tokens)
    a = make_request("a", tokens)
    store.num_cached_tokens(a)
    assert store.allocate(a, 10)
    store.cache_full_pages(a, 3)  # no page full yet
    assert store.managers[0].tables["a"].hashes == []
    assert store.pool.device.cached_hashes() == {}
    store.cache_full_pages(a, 6)
    assert store.managers[0].tables["a"].hashes == hashes[:1]
    assert store.pool.device.cached_hashes() == {hashes[0]: 0}
    store.cache_full_pages(a, 10)
    store.cache_full_pages(a, 10)  # idempotent
    assert store.managers[0].tables["a"].hashes == hashes
    assert store.pool.device.cached_hashes() == {hashes[0]: 0, hashes[1]: 1}
    assert store.pool.device.page_hash(2) is None  # the partial last page is never cached


def test_prefix_hit_shares_the_cached_pages() -> None:
    store = make_store()
    a_tokens = list(range(10, 20))
    a = make_request("a", a_tokens)
    assert admit(store, a) == [0, 1, 2]
    assert store.managers[0].tables["a"].hashes == chain(a_tokens)

    b = make_request("b", [*a_tokens[:9], 90, 91])  # same first 9 tokens: 2 full pages match
    assert store.num_cached_tokens(b) == 8
    assert store.managers[0].tables["b"] == PageTable([0, 1], chain(a_tokens)[:2])
    assert [store.pool.device.ref_count(p) for p in (0, 1, 2)] == [2, 2, 1]
    b.num_computed_tokens = 8
    assert store.allocate(b, 3)
    assert pages_of(store, "b") == [0, 1, 3]
    store.cache_full_pages(b, 11)  # no new full page
    assert store.managers[0].tables["b"].hashes == chain(a_tokens)[:2]

    store.free(a)
    assert [store.pool.device.ref_count(p) for p in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert store.pool.device.free_page_ids() == [4, 5, 6, 7, 2]
    store.free(b)
    assert store.pool.device.free_page_ids() == [4, 5, 6, 7, 2, 3, 1, 0]


def test_whole_prompt_hit_still_leaves_the_last_token_to_compute() -> None:
    store = make_store()
    tokens = list(range(20, 28))  # exactly 2 full pages
    assert admit(store, make_request("a", tokens)) == [0, 1]
    assert len(store.pool.device.cached_hashes()) == 2

    same = make_request("same", tokens)
    assert store.num_cached_tokens(same) == 4  # 8 cached would leave nothing to compute
    assert store.managers[0].tables["same"] == PageTable([0], chain(tokens)[:1])
    assert store.pool.device.ref_count(1) == 1  # the second page is not claimed

    longer = make_request("longer", [*tokens, 99])
    assert store.num_cached_tokens(longer) == 8
    assert store.managers[0].tables["longer"].pages == [0, 1]
    assert [store.pool.device.ref_count(p) for p in (0, 1)] == [3, 2]


def test_resumed_request_hits_pages_holding_its_own_outputs() -> None:
    store = make_store()
    a = make_request("a", list(range(6)))
    admit(store, a)
    for token in (60, 61, 62):  # decode to 9 tokens: page 1 becomes full and cached
        a.append(Sampled(token_id=token, logprob=0.0, top_logprobs=None))
        assert store.allocate(a, 1)
        store.cache_full_pages(a, a.num_computed_tokens + 1)
        a.num_computed_tokens += 1
    assert store.managers[0].tables["a"].hashes == chain([0, 1, 2, 3, 4, 5, 60, 61])
    store.free(a)  # preempted
    a.num_computed_tokens = 0
    assert store.num_cached_tokens(a) == 8
    assert store.managers[0].tables["a"].pages == [0, 1]


def test_cache_salt_isolates_prefixes() -> None:
    store = make_store()
    tokens = list(range(30, 40))
    admit(store, make_request("plain", tokens))
    assert store.num_cached_tokens(make_request("salted", tokens, salt="tenant-1")) == 0
    admit(store, make_request("salted2", tokens, salt="tenant-1"))
    assert store.num_cached_tokens(make_request("same-salt", tokens, salt="tenant-1")) == 8
    assert (
        store.managers[0].tables["same-salt"].pages == store.managers[0].tables["salted2"].pages[:2]
    )
    assert store.num_cached_tokens(make_request("other-salt", tokens, salt="tenant-2")) == 0
    assert store.num_cached_tokens(make_request("no-salt", tokens)) == 8
    assert store.managers[0].tables["no-salt"].pages == [0, 1]


def test_eviction_reuses_lru_head_pages_and_drops_exactly_their_hashes() -> None:
    store = make_store(num_pages=6)
    a_tokens, b_tokens = list(range(40, 48)), list(range(50, 58))
    a, b = make_request("a", a_tokens), make_request("b", b_tokens)
    assert admit(store, a) == [0, 1]
    assert admit(store, b) == [2, 3]
    ha, hb = chain(a_tokens), chain(b_tokens)
    store.free(a)
    store.free(b)
    assert store.pool.device.free_page_ids() == [4, 5, 1, 0, 3, 2]
    assert store.pool.device.cached_hashes() == {ha[0]: 0, ha[1]: 1, hb[0]: 2, hb[1]: 3}
    assert store.pool.device.num_evictions == 0

    c = make_request("c", list(range(60, 73)))  # 13 tokens: 4 pages, nothing cached
    assert admit(store, c) == [4, 5, 1, 0]  # uncached pages first, then a's (tail first)
    assert store.pool.device.num_evictions == 2
    hc = chain(list(range(60, 73)))
    assert store.pool.device.cached_hashes() == {hb[0]: 2, hb[1]: 3, hc[0]: 4, hc[1]: 5, hc[2]: 1}
    assert store.pool.device.free_page_ids() == [3, 2]

    assert store.num_cached_tokens(make_request("a2", [*a_tokens, 1])) == 0  # a was evicted
    b2 = make_request("b2", [*b_tokens, 1])
    assert store.num_cached_tokens(b2) == 8  # b survived
    assert store.managers[0].tables["b2"].pages == [2, 3]
    assert store.pool.device.free_page_ids() == []


def test_prefix_caching_disabled_never_hits() -> None:
    store = make_store(enable_prefix_caching=False)
    tokens = list(range(10, 20))
    assert admit(store, make_request("a", tokens)) == [0, 1, 2]
    assert store.managers[0].tables["a"].hashes == []
    assert store.pool.device.cached_hashes() == {}
    b = make_request("b", [*tokens, 5])
    assert store.num_cached_tokens(b) == 0
    assert store.managers[0].tables["b"] == PageTable([], [])
    assert store.allocate(b, 11)
    assert pages_of(store, "b") == [3, 4, 5]


def test_duplicate_prefix_computed_concurrently_keeps_the_first_page_canonical() -> None:
    store = make_store()
    tokens = list(range(10, 19))
    a, b = make_request("a", tokens), make_request("b", tokens)
    for req in (a, b):  # both admitted before either computed anything: no hit for b
        assert store.num_cached_tokens(req) == 0
        assert store.allocate(req, 9)
    assert pages_of(store, "a") == [0, 1, 2]
    assert pages_of(store, "b") == [3, 4, 5]
    store.cache_full_pages(a, 9)
    store.cache_full_pages(b, 9)
    h = chain(tokens)
    assert store.managers[0].tables["a"].hashes == store.managers[0].tables["b"].hashes == h
    assert store.pool.device.cached_hashes() == {h[0]: 0, h[1]: 1}
    assert store.pool.device.page_hash(3) is None and store.pool.device.page_hash(4) is None


def test_block_table_pads_with_zero() -> None:
    store = make_store()
    admit(store, make_request("a", list(range(10))))
    admit(store, make_request("b", list(range(100, 103))))
    pages = store.managers[0].pages(["b", "a"])
    table = block_table(pages, store.pool.cache.device)  # the operator's
    assert table.tolist() == [[3, 0, 0], [0, 1, 2]]
