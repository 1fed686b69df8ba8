"""Greedy outputs are the same whichever way the KV got there: recomputed, hit on the device,
loaded back from the CPU tier or from SSD, swapped out and in, or recomputed after preemption.

Each test forces one path with tiny budgets and asserts through the counters that the path
was taken. Tiny llama (fp32, eager), pages of 16 tokens of 4096 bytes each.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import serving, tiny_llm
from patience import patience
from read_only import read_only

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
        if store.pool.ssd is not None:
            store.pool.ssd.flush()  # so the hit reads the files, not the write queue
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
            assert llm.engine.executor.kv.pool.num_swap_ins == stats.num_swapped
        else:
            assert stats.num_swapped == 0
        store = llm.engine.executor.kv
        assert store.managers[0].swapped == {} and store.pool.num_free == store.num_pages


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
        store.pool.ssd.flush()
        files = sorted(store.pool.ssd.dir.glob("*" + SUFFIX))
        assert len(files) == 2  # prompt 0's two full pages
        _damage(files)
        out = one_by_one(llm, [0])[0]
        assert out.outputs[0].token_ids == expected[0]
        assert out.cached_tokens_by_tier == {}
        assert store.pool.ssd.num_unreadable == 1  # the first page; the chain stops there
        store.pool.ssd.flush()  # the rest of the chain goes too (deleted by the writer)
        assert not any(f.exists() for f in files)


def _complete(url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=patience(60))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    ("cpu_pages", "closed_by"),
    [(64, "close"), (64, "server"), (0, "close")],
    ids=["cpu-close", "cpu-server-stop", "no-cpu-tier"],
)
def test_a_clean_restart_finds_every_cached_prefix(
    tiny_model, tmp_path: Path, expected, cpu_pages: int, closed_by: str
) -> None:
    """Prompt 0's pages are pushed off the device (into the CPU tier, or without one onto
    SSD), prompts 1 and 2 stay cached on the device. A clean shutdown (LLM.close, or the
    server stopping: the end of a SIGTERM drain) keeps the CPU tier's and the device's pages
    on SSD, so a restart on the same directory finds all three prefixes."""
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": cpu_pages * PAGE_BYTES, "kv_ssd_dir": str(tmp_path)}
    first = tiny_llm(tiny_model(MODEL), **knobs)
    if closed_by == "server":
        with serving(first) as live:
            for i in (0, 1, 2):
                _complete(live.url, PROMPTS[i])
    else:
        with first:
            got = [o.outputs[0].token_ids for o in one_by_one(first, [0, 1, 2])]
            store = first.engine.executor.kv
            where = "cpu" if cpu_pages else "ssd"
            # prompt 0's two full pages; with a CPU tier also its copies of prompts 1 and
            # 2's, made as they were freed (the device keeps those: one file each at close)
            assert tier_stats(first)[where].used == (6 if cpu_pages else 2)
            assert len(store.pool.device.cached_pages()) == 4  # prompts 1 and 2's
        assert got == expected[:3]
    with tiny_llm(tiny_model(MODEL), **knobs) as second:
        assert second.engine.executor.kv.pool.ssd.num_found == 6
        outs = one_by_one(second, [0, 1, 2])
        assert [o.outputs[0].token_ids for o in outs] == expected[:3]
        assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 32}] * 3
        assert [o.num_cached_tokens for o in outs] == [32] * 3
        assert tier_stats(second)["ssd"].hits == 6


def test_pypto_generate_keeps_its_cached_prefix_for_the_next_run(tiny_model, tmp_path: Path):
    """`pypto generate` closes its engine at exit: the second run finds the first's pages."""
    from pypto_serving.models.loader import load_tokenizer

    model = tiny_model(MODEL)
    text = " ".join(f"word{i}" for i in range(60))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": text}) + "\n")
    argv = [sys.executable, "-m", "pypto_serving.cli", "generate", "--model", str(model)]
    argv += ["--prompts-file", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    argv += ["--max-tokens", "4", "--temperature", "0", "--dtype", "float32"]
    argv += ["--enforce-eager", "--page-size", "16", "--kv-ssd-dir", str(tmp_path / "ssd")]
    rows = []
    for _ in range(2):
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        rows.append(json.loads((tmp_path / "o.jsonl").read_text()))
    n = len(load_tokenizer(model).encode(text))
    assert n > 32
    assert [r["num_cached_tokens"] for r in rows] == [0, (n - 1) // 16 * 16]
    assert rows[1]["cached_tokens_by_tier"] == {"ssd": (n - 1) // 16 * 16}
    assert rows[0]["token_ids"] == rows[1]["token_ids"]


def test_a_read_only_ssd_tier_serves_its_pages_and_never_fails_a_step(
    tiny_model, tmp_path: Path, expected
) -> None:
    """On a read-only SSD directory (a read-only bind mount as root; injected EROFS where
    mounting is not allowed) pages are read and served though their files cannot be deleted,
    pages pushed down cannot be written: each such error is counted and costs that page only."""
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    with tiny_llm(tiny_model(MODEL), **knobs) as first:
        one_by_one(first, [0, 1, 2])  # closing keeps all three prompts' pages on SSD
    with read_only(tmp_path) as how, tiny_llm(tiny_model(MODEL), **knobs) as second:
        store = second.engine.executor.kv
        assert store.pool.ssd.num_found == 6 and store.pool.ssd.off is None, how
        outs = one_by_one(second, [0, 1, 2, 3])
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [o.num_cached_tokens for o in outs] == [32, 32, 32, 0]
        store.pool.ssd.flush()
        # 6 files loaded and not deleted; 0's and 1's pages pushed off the device, not written
        assert tier_stats(second)["ssd"].errors == 6 + 4
        assert len(list(store.pool.ssd.dir.glob("*" + SUFFIX))) == 6
    assert second.engine.executor.kv.pool.ssd.num_errors == 6 + 4 + 4  # close: 2's and 3's pages


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
            "cached_tokens_per_tier": {"device": 0, "cpu": 16, "ssd": 16, "remote": 0},
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
        assert metrics["pypto_kv_tier_errors_total", "ssd", None] == 0
        assert metrics["pypto_kv_tier_rejected_pages_total", "ssd", None] == 0
