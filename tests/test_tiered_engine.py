"""Greedy outputs are the same whichever way the KV got there: recomputed, hit on the device,
loaded back from the CPU tier or from SSD, swapped out and in, or recomputed after preemption.

Each test forces one path with tiny budgets and asserts through the counters that the path
was taken. Tiny llama (fp32, eager), pages of 16 tokens of 4096 bytes each.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from live_server import tiny_llm

from pypto_serving import LLM, SamplingParams
from pypto_serving.kv.disk_tier import SUFFIX

MODEL = "llama-gqa4-tied"
PAGE_BYTES = 2 * 2 * 16 * 2 * 8 * 4  # K and V x 2 layers x 16 tokens x 2 heads x dim 8 x fp32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
rng = random.Random(7)
PROMPTS = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(4)]  # 2 full pages + 8


SHORT = [p[:30] for p in PROMPTS]  # 2 pages, and a third once 2 tokens are generated


def reference(tiny_model, prompts: list[list[int]]) -> list[list[int]]:
    """The reference executor's greedy tokens for each prompt (the oracle)."""
    llm = LLM(str(tiny_model(MODEL)), executor="reference", dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    return reference(tiny_model, PROMPTS)


def one_by_one(llm: LLM, order: list[int]) -> list[Any]:
    """Generate the prompts in `order`, one at a time (each waits for the previous)."""
    return [llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False)[0] for i in order]


def tier_stats(llm: LLM) -> dict[str, Any]:
    return {t.name: t for t in llm.engine.stats().tiers}


# Six device pages hold two 48-token requests: running prompts 1 and 2 after 0 reuses the
# slots of 0's cached pages, which go to the next tier (or are dropped without one).
PATHS = {
    "recompute": ({"enable_prefix_caching": False}, {}),
    "device": ({"num_kv_pages": 64}, {"device": 32}),
    "cpu": ({"num_kv_pages": 6, "kv_cpu_bytes": 64 * PAGE_BYTES}, {"cpu": 32}),
    "ssd": ({"num_kv_pages": 6, "kv_cpu_bytes": 0}, {"ssd": 32}),
    "cpu+ssd": ({"num_kv_pages": 6, "kv_cpu_bytes": PAGE_BYTES}, {"cpu": 16, "ssd": 16}),
    "dropped": ({"num_kv_pages": 6, "kv_cpu_bytes": 0}, {}),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_outputs_are_identical_on_every_kv_path(
    tiny_model, tmp_path: Path, expected, path: str
) -> None:
    knobs, by_tier = PATHS[path]
    if path in ("ssd", "cpu+ssd"):
        knobs = knobs | {"kv_ssd_dir": str(tmp_path)}
    with tiny_llm(tiny_model(MODEL), **knobs) as llm:
        outs = one_by_one(llm, [0, 1, 2])
        store = llm.engine.executor.kv
        if store.ssd is not None:
            store.ssd.flush()  # so the hit reads the files, not the write queue
        last = one_by_one(llm, [0])[0]
        assert [o.outputs[0].token_ids for o in [*outs, last]] == [*expected[:3], expected[0]]
        assert last.cached_tokens_by_tier == by_tier
        assert last.num_cached_tokens == sum(by_tier.values())
        stats = tier_stats(llm)
        for tier, tokens in by_tier.items():
            assert stats[tier].hits == tokens // 16
            if tier != "device":
                assert stats[tier].loaded == tokens // 16


def test_a_prefix_split_between_device_and_cpu(tiny_model, expected) -> None:
    """Tail pages are evicted first, so a prefix often starts on the device and goes on in a
    lower tier: both parts are used, in order."""
    with tiny_llm(tiny_model(MODEL), num_kv_pages=6, kv_cpu_bytes=64 * PAGE_BYTES) as llm:
        one_by_one(llm, [0, 1])  # 0 on pages 0-2, 1 on the fresh pages 3-5
        short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([PROMPTS[3][:20]], short, use_tqdm=False)  # 2 pages: 0's tail ones
        out = one_by_one(llm, [0])[0]
        assert out.outputs[0].token_ids == expected[0]
        assert out.cached_tokens_by_tier == {"device": 16, "cpu": 16}


@pytest.mark.parametrize("cpu_pages", [64, 0], ids=["swap", "recompute"])
def test_preemption_by_swap_or_recompute_gives_identical_outputs(tiny_model, cpu_pages) -> None:
    # three 30-token prompts fit 6 of the 7 pages; each needs a third page after 2 tokens
    knobs = {"num_kv_pages": 7, "kv_cpu_bytes": cpu_pages * PAGE_BYTES, "max_num_seqs": 4}
    with tiny_llm(tiny_model(MODEL), **knobs) as llm:
        outs = llm.generate(SHORT, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(tiny_model, SHORT)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        if cpu_pages:
            assert stats.num_swapped > 0
            assert llm.engine.executor.kv.num_swap_ins == stats.num_swapped
        else:
            assert stats.num_swapped == 0
        store = llm.engine.executor.kv
        assert store.swapped == {} and store.pool.num_free == store.num_pages


def _damage(files: list[Path]) -> None:
    for i, f in enumerate(files):
        data = f.read_bytes()
        f.write_bytes(data[:-7] if i % 2 else data[:-9] + bytes(b ^ 0x5A for b in data[-9:]))


def test_corrupted_ssd_pages_are_misses_and_the_output_is_unchanged(
    tiny_model, tmp_path: Path, expected
) -> None:
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    with tiny_llm(tiny_model(MODEL), **knobs) as llm:
        one_by_one(llm, [0, 1, 2])
        store = llm.engine.executor.kv
        store.ssd.flush()
        files = sorted(store.ssd.dir.glob("*" + SUFFIX))
        assert len(files) == 2  # prompt 0's two full pages
        _damage(files)
        out = one_by_one(llm, [0])[0]
        assert out.outputs[0].token_ids == expected[0]
        assert out.cached_tokens_by_tier == {}
        assert store.ssd.num_unreadable == 1  # the first page; the chain stops there
        assert not files[0].exists()


def test_restart_with_the_same_ssd_dir_reuses_pages(tiny_model, tmp_path: Path, expected) -> None:
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    with tiny_llm(tiny_model(MODEL), **knobs) as first:
        one_by_one(first, [0, 1, 2])
    # close() waited for the writes; a new engine finds them
    with tiny_llm(tiny_model(MODEL), **knobs) as second:
        assert second.engine.executor.kv.ssd.num_found == 2
        out = one_by_one(second, [0])[0]
        assert out.outputs[0].token_ids == expected[0]
        assert out.cached_tokens_by_tier == {"ssd": 32}
        assert tier_stats(second)["ssd"].hits == 2


def test_server_reports_cached_tokens_per_tier_and_tier_metrics(tiny_model, tmp_path) -> None:
    import httpx
    from live_server import serving
    from prometheus_client.parser import text_string_to_metric_families

    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": PAGE_BYTES, "kv_ssd_dir": str(tmp_path)}
    with serving(tiny_llm(tiny_model(MODEL), **knobs)) as live:
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for i in (0, 1, 2, 0):
            r = httpx.post(live.url + "/v1/completions", json=body | {"prompt": PROMPTS[i]})
            assert r.status_code == 200, r.text
        details = r.json()["usage"]["prompt_tokens_details"]
        assert details == {
            "cached_tokens": 32,
            "cached_tokens_per_tier": {"device": 0, "cpu": 16, "ssd": 16},
        }
        metrics = {
            (s.name, s.labels.get("tier"), s.labels.get("le")): s.value
            for family in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)
            for s in family.samples
        }
        assert metrics["pypto_kv_tier_hits_total", "cpu", None] == 1
        assert metrics["pypto_kv_tier_hits_total", "ssd", None] == 1
        assert metrics["pypto_kv_tier_loaded_bytes_total", "ssd", None] == PAGE_BYTES
        assert metrics["pypto_kv_tier_capacity_pages", "device", None] == 6
        assert metrics["pypto_kv_tier_capacity_pages", "cpu", None] == 1
        assert metrics["pypto_kv_tier_used_pages", "cpu", None] == 1
        assert metrics["pypto_kv_tier_evicted_pages_total", "device", None] >= 2
        assert metrics["pypto_kv_tier_load_seconds_count", "ssd", None] == 1
        assert metrics["pypto_kv_tier_load_seconds_bucket", "ssd", "+Inf"] == 1
        assert metrics["pypto_num_preemptions_swapped_total", None, None] == 0
