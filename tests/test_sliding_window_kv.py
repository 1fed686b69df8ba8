"""The sliding-window kind's KV on the paged executor (kv/kinds/window.py: a windowed group
that keeps the window's last tokens, and a full-attention group where the model has full
layers): the same greedy tokens as the reference executor whichever way the KV got there -
recomputed, a prefix hit inside the window and beyond it, loaded back from the CPU tier or the
SSD (also after a restart) or the shared pool, swapped out and in, recomputed after
preemption, under tensor and pipeline parallelism - and the window gives its pages back, so a
4,000-token generation holds a few pages at a time."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import pytest
from kv_costs import loads_always_pay
from live_server import free_port, tiny_llm
from mooncake_master import POOL_SECRET, mooncake_master

from pypto_serving import LLM, SamplingParams
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.kinds.window import FULL, SLIDING
from pypto_serving.kv.mooncake_pool import SECRET_ENV

HYBRID = "qwen3-window6-from1"  # layer 0 full, layers 1-2 a window of 6
ONLY = "mistral-window8"  # every layer a window of 8
GEMMA = "gemma3-local5-global"  # local (window 5), global, local
OSS = "gptoss-window6-yarn"  # sliding (window 6), full, sliding; sinks, experts
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
rng = random.Random(7)
PROMPTS = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]
SHARED = PROMPTS[0][:31]
FORKS = [SHARED + [rng.randrange(3, 320) for _ in range(n)] for n in (11, 3, 20)]
SHORT = PROMPTS[1][:7]  # shorter than either window
SHORT_FORKS = [SHORT + [rng.randrange(3, 320) for _ in range(n)] for n in (0, 5, 9)]


def reference(model: Path, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    llm = LLM(str(model), executor="reference", dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def one_by_one(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]


def store_of(llm: LLM, groups: list[str]) -> KVGroups:
    store = llm.engine.executor.kv
    assert isinstance(store, KVGroups) and [m.name for m in store.managers] == groups
    return store


GROUPS = {HYBRID: [FULL, SLIDING], ONLY: [SLIDING], GEMMA: [FULL, SLIDING], OSS: [FULL, SLIDING]}


@pytest.mark.parametrize("name", [HYBRID, ONLY, GEMMA, OSS])
def test_prefix_hits_inside_and_beyond_the_window_give_the_reference_tokens(tiny_model, name):
    """Pages of 4. A shared prefix of 31 tokens: a hit of 28, far beyond either window (the
    windowed group holds only the pages its window still reads; the full group all 7). A
    shared prefix of 7, shorter than either window: a hit of 4."""
    model = tiny_model(name)
    with tiny_llm(model, page_size=4) as llm:
        store_of(llm, GROUPS[name])
        outs = one_by_one(llm, FORKS)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, FORKS)
        assert [o.num_cached_tokens for o in outs] == [0, 28, 28]
        short = one_by_one(llm, SHORT_FORKS)
        assert [o.outputs[0].token_ids for o in short] == reference(model, SHORT_FORKS)
        assert [o.num_cached_tokens for o in short] == [0, 4, 4]


PATHS = {  # pages of 4; 12 full-group pages hold one 48-token request
    "recompute": ({"enable_prefix_caching": False}, None),
    "device": ({"num_kv_pages": 64}, "device"),
    "cpu": ({"num_kv_pages": 12, "kv_cpu_bytes": 1 << 20}, "cpu"),
    "ssd": ({"num_kv_pages": 12, "kv_cpu_bytes": 0}, "ssd"),
    "remote": ({"num_kv_pages": 12, "kv_cpu_bytes": 0, "kv_remote_bytes": 16 << 20}, "remote"),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_outputs_are_identical_on_every_kv_path(tiny_model, tmp_path, path, monkeypatch):
    """The hybrid model, one request at a time, then the first again: its prefix (36 tokens,
    9 pages) comes back from the tier the path names (the full group's every page, as
    reported; the windowed group's last 2)."""
    model = tiny_model(HYBRID)
    knobs, tier = PATHS[path]
    if path == "ssd":
        knobs = knobs | {"kv_ssd_dir": str(tmp_path)}
    with contextlib.ExitStack() as stack:
        if path == "remote":  # a pool of its own, on a real Mooncake master
            port = free_port()
            stack.enter_context(mooncake_master(port, free_port()))
            knobs = knobs | {"kv_remote": f"mooncake://127.0.0.1:{port}"}
            monkeypatch.setenv(SECRET_ENV, POOL_SECRET)
        llm = stack.enter_context(tiny_llm(model, page_size=4, max_num_seqs=2, **knobs))
        if path == "remote":  # it measures its recompute rate on the first prompts
            loads_always_pay(llm)
        store = store_of(llm, [FULL, SLIDING])
        outs = one_by_one(llm, PROMPTS)
        for group in store.managers:
            for lower in (group.pool.ssd, group.pool.remote):
                if lower is not None:
                    lower.flush()
        last = one_by_one(llm, PROMPTS[:1])[0]
        expected = reference(model, PROMPTS)
        assert [o.outputs[0].token_ids for o in [*outs, last]] == [*expected, expected[0]]
        assert last.cached_tokens_by_tier == ({tier: 36} if tier else {})


def test_pages_on_ssd_are_found_after_a_restart(tiny_model, tmp_path):
    model = tiny_model(ONLY)
    knobs = {"page_size": 4, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    with tiny_llm(model, **knobs) as first:
        one_by_one(first, PROMPTS[:2])
    with tiny_llm(model, **knobs) as second:
        ssd = store_of(second, [SLIDING]).manager(SLIDING).pool.ssd
        assert ssd is not None and ssd.num_found == 22  # 47 tokens computed: 11 full pages each
        outs = one_by_one(second, PROMPTS[:2])
        assert [o.outputs[0].token_ids for o in outs] == reference(model, PROMPTS[:2])
        assert [o.num_cached_tokens for o in outs] == [36, 36]
        assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 8}] * 2  # the window's pages


def test_gemma3_reloads_from_the_cpu_tier_and_swaps(tiny_model):
    """Gemma 3's local and global layers: the first prompt's prefix back from the CPU tier,
    then three requests on 16 pages, one preempted and swapped: the reference's tokens."""
    model = tiny_model(GEMMA)
    knobs = {"page_size": 4, "kv_cpu_bytes": 1 << 20, "max_num_seqs": 2}
    with tiny_llm(model, num_kv_pages=12, **knobs) as llm:
        store_of(llm, [FULL, SLIDING])
        outs = one_by_one(llm, [*PROMPTS, PROMPTS[0]])
        expected = reference(model, PROMPTS)
        assert [o.outputs[0].token_ids for o in outs] == [*expected, expected[0]]
        assert outs[-1].cached_tokens_by_tier == {"cpu": 36}
    short = [p[:30] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with tiny_llm(model, num_kv_pages=16, **knobs | {"max_num_seqs": 3}) as llm:
        outs = llm.generate(short, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, short, params)
        assert llm.engine.stats().num_swapped > 0


@pytest.mark.parametrize("cpu_bytes", [1 << 20, 0], ids=["swap", "recompute"])
@pytest.mark.parametrize("name", [HYBRID, OSS])
def test_preemption_by_swap_or_recompute_gives_identical_outputs(tiny_model, name, cpu_bytes):
    """A hybrid model's full group runs short (16 pages for three sequences of 42 tokens):
    a request is preempted, swapped out with its window's pages (or recomputed), and resumes
    to the reference's tokens."""
    model = tiny_model(name)
    short = [p[:30] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    knobs = {"page_size": 4, "num_kv_pages": 16, "kv_cpu_bytes": cpu_bytes}
    with tiny_llm(model, max_num_seqs=3, **knobs) as llm:
        outs = llm.generate(short, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, short, params)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and (stats.num_swapped > 0) == bool(cpu_bytes)


def test_a_window_only_model_never_runs_short_of_pages(tiny_model):
    """The window-only model's pool is sized for every running sequence's window and a step's
    chunk (executor/kv_stores.py), so the load that preempts the hybrid model preempts
    nothing here, whatever `num_kv_pages` says."""
    model = tiny_model(ONLY)
    short = [p[:30] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with tiny_llm(model, max_num_seqs=3, page_size=4, num_kv_pages=16) as llm:
        outs = llm.generate(short, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, short, params)
        assert llm.engine.stats().num_preemptions == 0


@pytest.mark.slow
def test_tensor_parallel_gives_the_reference_tokens(tiny_model):
    """The window-only model on two ranks, a KV head each: prefix hits beyond the window and
    pages loaded from the CPU tier on both ranks."""
    model = tiny_model(ONLY)
    knobs = {"page_size": 4, "kv_cpu_bytes": 1 << 20, "max_num_seqs": 1}
    knobs |= {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16}  # 8 pages
    with tiny_llm(model, tensor_parallel_size=2, **knobs) as llm:
        outs = one_by_one(llm, [*FORKS, *PROMPTS, FORKS[0]])
        assert [o.outputs[0].token_ids for o in outs] == reference(
            model, [*FORKS, *PROMPTS, FORKS[0]]
        )
        assert [o.num_cached_tokens for o in outs[:3]] == [0, 28, 28]
        assert outs[-1].cached_tokens_by_tier == {"cpu": 8}


def hits(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int, dict[str, int]]]:
    """Each prompt's greedy tokens and prefix hit (tokens, and per tier), one after another."""
    outs = one_by_one(llm, prompts)
    return [(o.outputs[0].token_ids, o.num_cached_tokens, o.cached_tokens_by_tier) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        (HYBRID, "tensor_parallel_size"),
        (GEMMA, "tensor_parallel_size"),
        (HYBRID, "pipeline_parallel_size"),  # stage 0: the full layer; 1: the windowed two
        (GEMMA, "pipeline_parallel_size"),  # stage 0: a local layer; 1: global and local
        (OSS, "tensor_parallel_size"),  # and its experts over the two ranks (EP)
    ],
)
def test_both_groups_on_two_ranks_hit_and_load_as_one_rank(tiny_model, tmp_path, name, parallel):
    """A model of full and windowed layers on two ranks: under TP a KV head of each group
    each, under PP each stage its layers of each group (none, for a stage without such
    layers; the same page ids). The step carries both groups' pages and both pools' moves,
    so prefix hits inside and beyond the window, CPU-tier loads, a swap, and after a restart
    the SSD tier's pages are those of one rank, with the reference's tokens."""
    model = tiny_model(name)
    prompts = [*FORKS, *PROMPTS, FORKS[0]]
    knobs = {"page_size": 4, "kv_cpu_bytes": 1 << 20, "num_kv_pages": 24, "max_num_seqs": 3}
    got = {}
    for size in (1, 2):
        ssd = {"kv_ssd_dir": str(tmp_path / f"{size}"), "kv_ssd_bytes": 8 << 20}
        # a mixture of experts (gpt-oss's) places its experts over the two ranks
        ssd |= {"enable_expert_parallel": True} if name == OSS and size == 2 else {}
        with tiny_llm(model, **{parallel: size}, **knobs, **ssd) as llm:
            runs = hits(llm, prompts)
            batch = llm.generate([p[:30] for p in PROMPTS], GREEDY, use_tqdm=False)
            runs.append(([o.outputs[0].token_ids for o in batch], llm.engine.stats().num_swapped))
        with tiny_llm(model, **{parallel: size}, **knobs, **ssd) as llm:
            runs += hits(llm, PROMPTS[:1])  # from the SSD pages the first engine left
        got[size] = runs
    assert got[2] == got[1]
    one = got[1]
    expected = reference(model, [*prompts, *[p[:30] for p in PROMPTS], PROMPTS[0]])
    assert [r[0] for r in one[:-2]] + one[-2][0] + [one[-1][0]] == expected
    assert [n for _, n, _ in one[:3]] == [0, 28, 28]  # the forks' shared 7 pages
    assert one[-3][2] == {"cpu": 40} and one[-2][1] > 0  # a CPU load (10 pages); a swap
    assert one[-1][2] == {"ssd": 36}  # after the restart


@pytest.mark.slow
def test_the_window_gives_pages_back_so_a_4000_token_generation_fits(tiny_model):
    """4,000 greedy tokens of the window-only model: its pool (sized for one window and a
    chunk) holds far less than 4,000 tokens of KV, and the request never holds more than the
    window's pages and the one being written. Tokens: the reference executor's."""
    model = tiny_model(ONLY)
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    prompt = PROMPTS[0][:20]
    knobs = {"max_num_seqs": 1, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 16}
    with tiny_llm(model, page_size=4, **knobs) as llm:
        sliding = store_of(llm, [SLIDING]).manager(SLIDING)
        full_kv_bytes = 4020 * sliding.pool.cache.spec.token_bytes_per_layer * 2  # 2 layers
        assert sliding.pool.num_pages * sliding.pool.page_bytes < full_kv_bytes / 50
        held: list[int] = []
        allocate = sliding.allocate

        def counted(request: Any, num_new_tokens: int) -> bool:
            ok = allocate(request, num_new_tokens)
            held.append(sliding.pool.num_pages - sliding.pool.num_free)
            return ok

        sliding.allocate = counted  # type: ignore[method-assign]
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4000
        assert llm.engine.stats().num_preemptions == 0
        # the prompt's 5 pages at first; then the window's 7 tokens before the next one reach
        # into 2 or 3 pages, and the one being written
        assert len(held) >= 4000 and max(held) <= 5 and max(held[10:]) <= 3
        assert sliding.pool.num_free == sliding.pool.num_pages  # all given back
    assert out.outputs[0].token_ids == reference(model, [prompt], params)[0]
