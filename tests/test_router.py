"""The DP router: least pending tokens, prefix-cache discount, exact load accounting."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pypto_serving.engine.router import Router
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

PAGE = 16


def req(rid: str, prompt: list[int], max_tokens: int = 10, salt: str | None = None) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
    r.max_model_len = 1024
    return r


def router(n: int = 2, policy: str = "least_pending_tokens", capacity: int = 100) -> Router:
    return Router(n, PAGE, [capacity] * n, policy)


def test_pending_counts_prompt_then_remaining_output():
    rt = router()
    assert rt.route(req("a", list(range(30)), max_tokens=10)) == 0
    assert rt.pending == [40, 0]  # 30 prompt + 10 output, counted at once (no report needed)
    rt.progress("a", 1)
    assert rt.pending == [9, 0]  # the prompt is done; 9 outputs to come
    rt.progress("a", 4)
    assert rt.pending == [6, 0]
    rt.finish("a")
    assert rt.pending == [0, 0]
    rt.finish("a")  # twice (finished, then an abort that crossed it) counts once
    assert rt.pending == [0, 0]


def test_no_max_tokens_counts_the_context_left():
    rt = router()
    r = Request("a", list(range(24)), SamplingParams(max_tokens=None))
    r.max_model_len = 100
    rt.route(r)
    assert rt.pending == [100, 0]


def test_new_requests_go_to_the_least_loaded_replica():
    rt = router(3)
    rt.route(req("big", list(range(200)), 100))  # -> 0
    rt.route(req("mid", list(range(50)), 20))  # -> 1
    assert rt.pending == [300, 70, 0]
    assert rt.route(req("x", [7] * 5, 5)) == 2
    assert rt.route(req("y", [8] * 5, 5)) == 2  # 10 < 70
    assert rt.route(req("z", [9] * 100, 5)) == 2  # 20 < 70
    assert rt.pending == [300, 70, 125]
    assert rt.route(req("w", [9] * 5, 5)) == 1


def test_a_cached_prefix_attracts_its_request_when_loads_are_close():
    rt = router()
    system = list(range(100, 164))  # 4 full pages
    rt.route(req("first", [*system, 1, 2], 4))  # -> 0, which now holds the prefix
    rt.route(req("other", [5] * 60, 4))  # -> 1 (less loaded)
    assert rt.pending == [70, 64]
    # replica 1 has fewer pending tokens, but replica 0 holds 64 of the prompt's tokens
    assert rt.route(req("second", [*system, 3, 4], 4)) == 0


def test_a_cached_prefix_does_not_win_against_a_much_heavier_load():
    rt = router()
    system = list(range(100, 132))  # 2 full pages
    rt.route(req("first", [*system, 1], 500))  # -> 0, heavily loaded
    assert rt.route(req("second", [*system, 2], 4)) == 1  # 32 cached tokens < 533 pending


def test_salted_prefixes_do_not_match():
    rt = router()
    system = list(range(100, 164))
    rt.route(req("first", [*system, 1], 4, salt="tenant-a"))
    rt.route(req("other", [5] * 60, 4))
    assert rt.route(req("second", [*system, 2], 4, salt="tenant-b")) == 1


def test_prefix_estimate_is_bounded_by_the_replica_capacity():
    rt = router(capacity=2)
    rt.route(req("a", list(range(64)), 1))  # 4 pages sent; only the last 2 remembered
    again = req("b", list(range(64)), 1)
    assert rt.cached_tokens(0, again, rt.prompt_hashes(again)) == 0  # its first pages are gone


def test_reported_evictions_leave_the_estimate_and_reported_pages_join_it():
    """The replicas' KV events (what they publish for outside routers) correct the guess
    made from what was routed: a page removed from every tier is no longer counted, a page
    stored (say, by a request routed before a restart of the estimate) is."""
    rt = router()
    system = list(range(100, 164))  # 4 full pages
    first = req("first", [*system, 1], 4)
    rt.route(first)  # -> 0
    hashes = rt.prompt_hashes(first)
    probe = req("probe", [*system, 2], 4)
    assert rt.cached_tokens(0, probe, hashes) == 64
    rt.observe(0, [(True, "device", h) for h in hashes])  # computed: on the device
    rt.observe(0, [(True, "cpu", hashes[2]), (False, "device", hashes[2])])  # moved down
    assert rt.cached_tokens(0, probe, hashes) == 64  # still held, by the CPU tier
    rt.observe(0, [(False, "cpu", hashes[2])])  # evicted from its last tier
    assert rt.cached_tokens(0, probe, hashes) == 32  # the chain breaks at page 2
    assert rt.cached_tokens(1, probe, hashes) == 0
    rt.observe(1, [(True, "ssd", h) for h in hashes[:3]])  # replica 1 found them (its SSD)
    assert rt.cached_tokens(1, probe, hashes) == 48


def test_with_a_shared_pool_a_page_stored_by_one_replica_counts_for_all():
    rt = Router(2, PAGE, [100, 100], pool_pages=3)
    prompt = req("a", list(range(200, 280)), 4)  # 5 full pages
    hashes = rt.prompt_hashes(prompt)
    rt.observe(0, [(True, "device", h) for h in hashes])
    assert rt.cached_tokens(1, prompt, hashes) == 0  # the pool remembers only 3: the last 3
    rt.observe(0, [(True, "device", h) for h in hashes[:3]])  # stored again: the most recent
    assert rt.cached_tokens(1, prompt, hashes) == 48
    plain = router()
    plain.observe(0, [(True, "device", h) for h in hashes])
    assert plain.cached_tokens(1, prompt, hashes) == 0  # no pool: replica 0's alone


def test_round_robin_ignores_load():
    rt = router(3, "round_robin")
    assert [rt.route(req(str(i), [1] * (100 if i == 0 else 5), 5)) for i in range(6)] == [
        0, 1, 2, 0, 1, 2,
    ]  # fmt: skip


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_load_accounting_returns_to_zero(seed, replicas):
    """Random arrivals, progress, finishes and aborts: pending always equals the sum of the
    live requests' pending tokens, never negative, and zero once all are done."""
    rng = random.Random(seed)
    rt = router(replicas)
    live: dict[str, tuple[int, int, int]] = {}  # rid -> (prompt, max_tokens, produced)
    for step in range(60):
        action = rng.random()
        if action < 0.4 or not live:
            rid = f"r{step}"
            prompt, max_tokens = rng.randint(1, 80), rng.randint(1, 20)
            rt.route(req(rid, [rng.randint(0, 5) for _ in range(prompt)], max_tokens))
            live[rid] = (prompt, max_tokens, 0)
        elif action < 0.8:
            rid = rng.choice(sorted(live))
            prompt, max_tokens, produced = live[rid]
            produced = min(produced + rng.randint(1, 3), max_tokens)
            rt.progress(rid, produced)
            live[rid] = (prompt, max_tokens, produced)
        else:
            rid = rng.choice(sorted(live))
            del live[rid]
            rt.finish(rid)
        expected = [0] * replicas
        for rid, (prompt, max_tokens, produced) in live.items():
            replica = rt.replica_of(rid)
            assert replica is not None
            expected[replica] += (prompt if produced == 0 else 0) + max_tokens - produced
        assert rt.pending == expected
    for rid in list(live):
        rt.finish(rid)
    assert rt.pending == [0] * replicas
