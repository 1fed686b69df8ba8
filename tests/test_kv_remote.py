"""The remote KV tier (issue 28, item 1): pages in a pool shared through a real Mooncake master.

Ground truth: the reference is a fresh computation of the same prompt (greedy tokens must be
identical), and the tier breakdown names exactly the pages that came from the pool: a prompt
of 100 tokens in pages of 16 has 6 full pages before its last token (96 tokens).

Issue 42, item 3: every member is given the pool's secret (`PYPTO_POOL_SECRET`), signs the
pages it writes and checks the pages it reads; a page signed without it is a miss, counted."""

from __future__ import annotations

import time

import pytest
import torch
from checkpoints import hash_chain
from kv_costs import loads_always_pay
from live_server import free_port, generate_salted, tiny_llm
from mooncake_master import POOL_SECRET, mooncake_master
from patience import patience

from pypto_serving.config import MOONCAKE_MIN_SEGMENT_BYTES
from pypto_serving.engine.metrics import EngineMetrics
from pypto_serving.errors import PyptoError
from pypto_serving.kv.mooncake_pool import SECRET_ENV, connect, join, leave, pool_key
from pypto_serving.kv.remote_tier import RemoteTier
from pypto_serving.kv.tier import TierStats, merge_tier_stats
from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"
PAGE = 16
SEGMENT = 64 << 20
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def prompt(i: int, n: int = 100) -> list[int]:
    return [(11 * i + 5 * j) % 290 + 7 for j in range(n)]


@pytest.fixture(autouse=True)
def pool_secret(monkeypatch):
    """Every member of the tests' pools knows its secret (unless a test says otherwise)."""
    monkeypatch.setenv(SECRET_ENV, POOL_SECRET)


@pytest.fixture
def master_url():
    port = free_port()
    with mooncake_master(port, free_port()) as proc:
        yield f"mooncake://127.0.0.1:{port}", proc


def remote_llm(model, url: str, **knobs):
    remote = {"page_size": PAGE, "kv_cpu_bytes": 0, "kv_remote": url, "kv_remote_bytes": SEGMENT}
    return tiny_llm(model, **(remote | knobs))


def remote_tier(llm) -> RemoteTier:
    tier = llm.engine.executor.kv.pool.remote
    assert isinstance(tier, RemoteTier)
    return tier


def test_a_prefix_computed_by_one_engine_is_a_remote_hit_for_another(tiny_model, master_url):
    url, _ = master_url
    model, p = tiny_model(MODEL), prompt(0)
    with tiny_llm(model, page_size=PAGE) as alone:
        expected = alone.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with remote_llm(model, url) as a, remote_llm(model, url) as b:
        first = a.generate([p], GREEDY, use_tqdm=False)[0]
        assert first.cached_tokens_by_tier == {}
        remote_tier(a).flush()
        assert remote_tier(a).num_written == 6  # the prompt's full pages (the 7th is partial)
        out = b.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.cached_tokens_by_tier == {"remote": 96}
        assert out.outputs[0].token_ids == first.outputs[0].token_ids == expected
        stats = {s.name: s for s in b.engine.executor.kv.tier_stats()}["remote"]
        assert (stats.hits, stats.loaded, stats.rejected, stats.errors) == (6, 6, 0, 0)
        # shared: B knows the 6 pages A wrote, and lends its own segment; no fraction in use
        assert (stats.shared, stats.used, stats.usage) == (True, 6, None)
        assert stats.capacity == SEGMENT // stats.page_bytes
        metrics = {
            (s.name, s.labels["tier"]): s.value
            for family in EngineMetrics(b.engine.stats, "m").registry.collect()
            for s in family.samples
            if "tier" in s.labels
        }
        assert metrics["pypto_kv_tier_used_pages", "remote"] == 6
        assert ("pypto_kv_tier_usage_perc", "remote") not in metrics
        assert ("pypto_kv_tier_usage_perc", "device") in metrics
        again = b.generate([p], GREEDY, use_tqdm=False)[0]  # now on B's device
        assert again.cached_tokens_by_tier == {"device": 96}
        remote_tier(b).flush()
        assert remote_tier(b).num_written == 0  # the pool had every page B filled


def test_a_corrupted_or_foreign_remote_page_is_a_miss(tiny_model, master_url):
    url, _ = master_url
    model, p = tiny_model(MODEL), prompt(1)
    pool = join(url, SEGMENT)  # the pool's pages live in its members' segments: stay in
    try:
        with remote_llm(model, url) as a:
            expected = a.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            tier = remote_tier(a)
            tier.flush()
            keys = [tier.key(h) for h in hash_chain(p, PAGE)[:6]]
        damaged = bytearray(pool.get(keys[3]))
        damaged[len(damaged) // 2] ^= 0xFF  # a bit flipped inside the payload
        assert pool.upsert(keys[3], bytes(damaged)) == 0
        with remote_llm(model, url) as b:
            out = b.generate([p], GREEDY, use_tqdm=False)[0]
            assert out.cached_tokens_by_tier == {"remote": 3 * PAGE}  # up to the damaged page
            assert out.outputs[0].token_ids == expected
            assert remote_tier(b).num_rejected == 1
            remote_tier(b).flush()  # B computed the damaged page again: it replaced it
        # another page's value under a page's key (the right size, other tokens)
        assert pool.upsert(keys[2], pool.get(keys[1])) == 0
        with remote_llm(model, url) as c:
            out = c.generate([p], GREEDY, use_tqdm=False)[0]
            assert out.cached_tokens_by_tier == {"remote": 2 * PAGE}
            assert out.outputs[0].token_ids == expected
            assert remote_tier(c).num_rejected == 1
            remote_tier(c).flush()
        with remote_llm(model, url) as d:  # both put right: the whole prefix is a hit again
            out = d.generate([p], GREEDY, use_tqdm=False)[0]
            assert out.cached_tokens_by_tier == {"remote": 6 * PAGE}
            assert out.outputs[0].token_ids == expected
    finally:
        leave(pool)


def test_joining_the_pool_needs_its_secret(tiny_model, master_url, monkeypatch):
    url, _ = master_url
    model = tiny_model(MODEL)
    for secret in (None, "too-short"):
        if secret is None:
            monkeypatch.delenv(SECRET_ENV)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        with pytest.raises(PyptoError, match="set PYPTO_POOL_SECRET to the same secret of at"):
            remote_llm(model, url)


def test_a_page_signed_without_the_pools_secret_is_a_miss_and_counted(
    tiny_model, master_url, monkeypatch
):
    """Issue 42's attack: a member without the secret (Mooncake lets anyone who reaches the
    master join and write) rebuilds pages' keys, zeroes their KV, signs them with the secret
    it has and upserts them. The victim serves the genuine pages before them and computes the
    rest: the right tokens, each forged page it tried counted as rejected."""
    url, _ = master_url
    model, p = tiny_model(MODEL), prompt(8)
    with remote_llm(model, url) as a:
        expected = a.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        tier = remote_tier(a)
        tier.flush()
        layout = (tier.page_shape, tier.dtype, tier.digest, tier.num_tensors)
        monkeypatch.setenv(SECRET_ENV, "not-the-pools-secret")
        forger = RemoteTier(join(url, SEGMENT), 1, *layout, pool_key())
        monkeypatch.setenv(SECRET_ENV, POOL_SECRET)
        try:
            zeros = tuple(torch.zeros(tier.page_shape, dtype=tier.dtype) for _ in range(2))
            for i, h in enumerate(hash_chain(p, PAGE)[2:6], start=2):
                forged = forger.encode(h, tuple(p[i * PAGE : (i + 1) * PAGE]), zeros)
                assert forger.pool.upsert(tier.key(h), forged) == 0
            with remote_llm(model, url) as b:  # a victim with nothing on its own device
                out = b.generate([p], GREEDY, use_tqdm=False)[0]
                assert out.cached_tokens_by_tier == {"remote": 2 * PAGE}  # up to the first forgery
                assert out.outputs[0].token_ids == expected
                stats = {s.name: s for s in b.engine.executor.kv.tier_stats()}["remote"]
                assert (stats.rejected, remote_tier(b).num_rejected) == (1, 1)
                metrics = {
                    (s.name, s.labels.get("tier")): s.value
                    for family in EngineMetrics(b.engine.stats, "m").registry.collect()
                    for s in family.samples
                }
                assert metrics["pypto_kv_tier_rejected_pages_total", "remote"] == 1
        finally:
            forger.close()


def test_cache_salt_namespaces_the_pools_keys(tiny_model, master_url):
    """A salted request's pages sit under keys of their own: found in the pool only by
    requests of the same salt."""
    url, _ = master_url
    model, p = tiny_model(MODEL), prompt(9)
    with remote_llm(model, url) as a, remote_llm(model, url) as b:
        first = generate_salted(a, p, GREEDY, "tenant-a")
        remote_tier(a).flush()
        keys = {
            salt: {remote_tier(a).key(h) for h in hash_chain(p, PAGE, salt)[:6]}
            for salt in (None, "tenant-a", "tenant-b")
        }
        assert sum(len(k) for k in keys.values()) == len(set().union(*keys.values())) == 18
        assert b.generate([p], GREEDY, use_tqdm=False)[0].cached_tokens_by_tier == {}
        assert generate_salted(b, p, GREEDY, "tenant-b").cached_tokens_by_tier == {}
        loads_always_pay(b)  # B has measured its recompute rate by now (kv_costs.py)
        out = generate_salted(b, p, GREEDY, "tenant-a")
        assert out.cached_tokens_by_tier == {"remote": 96}
        assert out.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_master_that_dies_mid_run_costs_recompute_not_requests(tiny_model, master_url):
    url, proc = master_url
    model = tiny_model(MODEL)
    prompts = [prompt(i) for i in range(2, 6)]
    with tiny_llm(model, page_size=PAGE) as alone:
        expected = [o.outputs[0].token_ids for o in alone.generate(prompts, GREEDY, use_tqdm=False)]
    with remote_llm(model, url) as a:
        a.generate(prompts[:2], GREEDY, use_tqdm=False)
        remote_tier(a).flush()
        proc.kill()
        proc.wait()
        outs = a.generate(prompts[2:], GREEDY, use_tqdm=False)  # writes and lookups fail
        assert [o.outputs[0].token_ids for o in outs] == expected[2:]
        remote_tier(a).flush()
        assert remote_tier(a).num_errors >= 1
        stats = {s.name: s for s in a.engine.executor.kv.tier_stats()}["remote"]
        assert stats.errors == remote_tier(a).num_errors


def test_bad_remote_settings_are_clear_errors(tiny_model):
    model = tiny_model(MODEL)
    with pytest.raises(PyptoError, match="kv_remote must look like mooncake://HOST:PORT"):
        tiny_llm(model, kv_remote="redis://127.0.0.1:1")
    port = free_port()
    with pytest.raises(PyptoError, match=f"Mooncake master at 127.0.0.1:{port} does not answer"):
        tiny_llm(model, kv_remote=f"mooncake://127.0.0.1:{port}")
    url = f"mooncake://127.0.0.1:{port}"
    with pytest.raises(PyptoError, match="kv_remote needs the paged executor"):
        tiny_llm(model, kv_remote=url, executor="reference")
    with pytest.raises(PyptoError, match="kv_remote runs with tensor_parallel_size and pipe"):
        tiny_llm(model, kv_remote=url, tensor_parallel_size=2)
    for small in (1000, "1MiB"):  # refused by the flag, not by a failed join
        with pytest.raises(PyptoError, match=r"--kv-remote-bytes\) must be at least 16MiB"):
            tiny_llm(model, kv_remote=url, kv_remote_bytes=small)


def test_the_least_kv_remote_bytes_is_the_least_mooncake_takes(master_url):
    """The minimum the config checks is Mooncake's own: one byte less and it refuses to join
    (-600), so a value the config takes never fails the join for its size."""
    url, _ = master_url
    connect(url, MOONCAKE_MIN_SEGMENT_BYTES).close()
    with pytest.raises(PyptoError, match="cannot join the Mooncake master"):
        connect(url, MOONCAKE_MIN_SEGMENT_BYTES - 1)


def test_two_data_parallel_replicas_share_the_pool(tiny_model, master_url):
    """Round robin sends the second request to the other replica: a remote-tier hit there."""
    url, _ = master_url
    model, p = tiny_model(MODEL), prompt(7)
    knobs = {"data_parallel_size": 2, "data_parallel_load_balance": "round_robin"}
    with remote_llm(model, url, **knobs) as llm:
        first = llm.generate([p], GREEDY, use_tqdm=False)[0]
        time.sleep(patience(2.0))  # replica 0 writes its pages from a background thread
        second = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert second.cached_tokens_by_tier == {"remote": 96}
        assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_replicas_add_their_own_tiers_but_not_the_shared_pools_pages():
    cpu = merge_tier_stats(TierStats("cpu", 10, 1, used=6), TierStats("cpu", 10, 1, used=4))
    assert (cpu.capacity, cpu.used, cpu.usage) == (20, 10, 0.5)
    a, b = (TierStats("remote", 10, 1, used=n, shared=True) for n in (6, 4))
    pool = merge_tier_stats(a, b)  # both know pages of the same pool: at least 6 are there
    assert (pool.capacity, pool.used, pool.usage, pool.shared) == (20, 6, None, True)
