"""DeepSeek-V4's KV on the paged executor (kv/kinds/compressed.py: two KV groups, its entries
and its windowed rows):
the same greedy tokens as the reference executor whichever way the KV got there - recomputed,
hit on the device at page boundaries that are and are not multiples of the compression
ratios, loaded back from the CPU tier or the SSD (also after a restart), swapped out and in,
or recomputed after preemption - and the sliding window gives its rows' pages back, so a long
generation fits a pool too small for the whole sequence's raw KV.

What a prefix hit restores (docs/attention_kinds.md): the entries of every window complete
before the hit (the whole pages), and the rows of its last `keep` tokens (the window's raw
rows, and the compressor inputs of the windows not pooled yet: with the previous window's
for CSA's overlap), from which the next token's compressor state is rebuilt.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_costs import loads_always_pay
from live_server import free_port, tiny_llm
from mooncake_master import POOL_SECRET, mooncake_master
from parallel_checks import MOE_PARALLEL

from pypto_serving import LLM, SamplingParams
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.kinds.compressed import ENTRIES, INPUTS, ROWS, kv_groups
from pypto_serving.kv.mooncake_pool import SECRET_ENV
from pypto_serving.models.config import load_model_config

NAME = "deepseekv4-swa-csa-hca-hash"  # window 8, CSA 4:1 (top 2), HCA 8:1
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
rng = random.Random(5)
PROMPTS = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]
SHARED = PROMPTS[0][:31]
FORKS = [SHARED + [rng.randrange(3, 320) for _ in range(n)] for n in (11, 3, 20)]


def reference(model: Path, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    llm = LLM(str(model), executor="reference", dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model(NAME)


@pytest.fixture(scope="module")
def expected(model: Path) -> list[list[int]]:
    return reference(model, PROMPTS)


def one_by_one(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]


def store_of(llm: LLM) -> KVGroups:
    store = llm.engine.executor.kv
    assert isinstance(store, KVGroups)
    assert [m.name for m in store.managers] == [ENTRIES, ROWS, INPUTS]
    return store


@pytest.mark.parametrize("page_size", [8, 6])
def test_prefix_hits_at_page_boundaries_give_the_reference_tokens(model, page_size):
    """A shared prefix of 31 tokens: with pages of 8 the hit is 24 tokens (whole windows of
    both ratios); with pages of 6 it is 30, a multiple of neither 4 nor 8: the next tokens
    pool the partial windows from the rows the hit kept."""
    with tiny_llm(model, page_size=page_size) as llm:
        outs = one_by_one(llm, FORKS)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, FORKS)
        hit = {8: 24, 6: 30}[page_size]
        assert [o.num_cached_tokens for o in outs] == [0, hit, hit]
        assert outs[1].cached_tokens_by_tier == {"device": hit}


PATHS = {  # six entry pages of 8 tokens hold one 48-token request
    "recompute": ({"enable_prefix_caching": False}, {}),
    "device": ({"num_kv_pages": 64}, {"device": 32}),
    "cpu": ({"num_kv_pages": 6, "kv_cpu_bytes": 1 << 20}, {"cpu": 32}),
    "ssd": ({"num_kv_pages": 6, "kv_cpu_bytes": 0}, {"ssd": 32}),
    "remote": ({"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_remote_bytes": 16 << 20}, {"remote": 32}),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_outputs_are_identical_on_every_kv_path(
    model, expected, tmp_path, path, monkeypatch
):
    knobs, by_tier = PATHS[path]
    if path == "ssd":
        knobs = knobs | {"kv_ssd_dir": str(tmp_path)}
    with contextlib.ExitStack() as stack:
        if path == "remote":  # a pool of its own, on a real Mooncake master
            port = free_port()
            stack.enter_context(mooncake_master(port, free_port()))
            knobs = knobs | {"kv_remote": f"mooncake://127.0.0.1:{port}"}
            monkeypatch.setenv(SECRET_ENV, POOL_SECRET)
        llm = stack.enter_context(tiny_llm(model, page_size=8, max_num_seqs=2, **knobs))
        if path == "remote":  # it measures its recompute rate on the first prompts
            loads_always_pay(llm)
        store = store_of(llm)
        outs = one_by_one(llm, PROMPTS)
        for group in store.managers:
            for tier in (group.pool.ssd, group.pool.remote):
                if tier is not None:
                    tier.flush()
        last = one_by_one(llm, PROMPTS[:1])[0]
        assert [o.outputs[0].token_ids for o in [*outs, last]] == [*expected, expected[0]]
        assert last.cached_tokens_by_tier == by_tier


def test_pages_on_ssd_are_found_after_a_restart(model, expected, tmp_path):
    knobs = {"page_size": 8, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    with tiny_llm(model, **knobs) as first:
        one_by_one(first, PROMPTS[:2])
    with tiny_llm(model, **knobs) as second:
        store = store_of(second)
        ssd = store.manager(ENTRIES).pool.ssd
        assert ssd is not None and ssd.num_found == 10  # 47 tokens computed: 5 full pages each
        outs = one_by_one(second, PROMPTS[:2])
        assert [o.outputs[0].token_ids for o in outs] == expected[:2]
        assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 32}] * 2


@pytest.mark.parametrize("cpu_bytes", [1 << 20, 0], ids=["swap", "recompute"])
def test_preemption_by_swap_or_recompute_gives_identical_outputs(model, cpu_bytes):
    short = [p[:30] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    knobs = {"page_size": 8, "num_kv_pages": 8, "kv_cpu_bytes": cpu_bytes}
    with tiny_llm(model, max_num_seqs=3, **knobs) as llm:
        outs = llm.generate(short, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, short, params)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and (stats.num_swapped > 0) == bool(cpu_bytes)


def test_csa_inputs_are_kept_for_their_own_span_on_every_stage(tiny_model):
    """Layers CSA 2:1, window only, HCA 8:1, CSA 2:1 with a window of 5: the rows keep 7
    tokens (HCA's window not pooled yet), CSA's inputs 3 (its window and the one before), on
    every pipeline stage whichever layers it holds; a model without CSA has no inputs."""
    cfg = load_model_config(tiny_model("deepseekv4-csa2-window5-2hash"))
    v4 = cfg.compressed
    assert v4 is not None
    dim, index_dim = cfg.head_dim, v4.index_head_dim
    for layers in (range(4), range(2), range(2, 4)):
        groups = kv_groups(cfg, layers, 6, torch.float32)
        assert [(g.name, g.keep) for g in groups] == [(ENTRIES, None), (ROWS, 7), (INPUTS, 3)]
        hca = 2 in layers  # its compressor's inputs beside the raw rows
        assert groups[1].spec.row == len(layers) * dim + (2 * dim if hca else 0)
        csa = sum(v4.indexed[i] for i in layers)
        assert groups[2].spec.row == csa * (4 * dim + 4 * index_dim)
    no_csa = replace(cfg, compressed=replace(v4, indexed=(False,) * 4))
    groups = kv_groups(no_csa, range(4), 6, torch.float32)
    assert [(g.name, g.keep) for g in groups] == [(ENTRIES, None), (ROWS, 7)]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", list(MOE_PARALLEL))
def test_under_tp_and_pp_swaps_and_cpu_reloads_give_the_reference_tokens(model, expected, parallel):
    """Every rank stores the same compressed KV (its KV head, compressors and indexers are
    whole on each), so rank 0's CPU tier keeps one copy, as MLA's latent: preemption by swap,
    then a prompt's pages pushed to the CPU tier and loaded back, give the reference tokens
    (each stage keeping its layers' rows and entries under PP)."""
    short = [p[:30] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    knobs = {"page_size": 8, "num_kv_pages": 8, "kv_cpu_bytes": 1 << 20, "max_num_seqs": 3}
    with tiny_llm(model, **knobs, **MOE_PARALLEL[parallel]) as llm:
        store = store_of(llm)
        outs = llm.generate(short, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, short, params)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_swapped > 0
        outs = one_by_one(llm, [*PROMPTS, PROMPTS[0]])
        assert [o.outputs[0].token_ids for o in outs] == [*expected, expected[0]]
        assert outs[-1].num_cached_tokens == 32 and outs[-1].cached_tokens_by_tier.get("cpu")
        assert all(m.pool.num_swap_ins > 0 for m in store.managers)


@pytest.mark.slow
def test_under_tp2_prefix_hits_and_ssd_pages_after_a_restart_give_the_reference_tokens(
    model, expected, tmp_path
):
    """TP=2: a prefix hit at a page boundary that is a multiple of neither ratio; each
    group's SSD pages kept once (rank 0's folder: rank 1 keeps none), found after a
    restart."""
    knobs = {"page_size": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    knobs |= MOE_PARALLEL["tp2"]
    with tiny_llm(model, **knobs) as first:
        outs = one_by_one(first, FORKS)
        assert [o.outputs[0].token_ids for o in outs] == reference(model, FORKS)
        assert [o.num_cached_tokens for o in outs] == [0, 30, 30]
        one_by_one(first, PROMPTS[:2])
    assert list(tmp_path.glob("*/rank0/*")) and not list(tmp_path.glob("*/rank1/*"))
    with tiny_llm(model, **knobs) as second:
        outs = one_by_one(second, PROMPTS[:2])
        assert [o.outputs[0].token_ids for o in outs] == expected[:2]
        assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 36}] * 2


@pytest.mark.slow
def test_the_window_gives_pages_back_so_a_long_generation_fits(model):
    """700 tokens on a pool whose bytes hold about 340 tokens of the raw KV a full cache
    would keep (every token's head_dim row in each of the 3 layers): the window's rows hold a
    few pages at any time, the entries a row per window. Tokens: the reference's."""
    params = SamplingParams(temperature=0, max_tokens=700, ignore_eos=True)
    prompt = PROMPTS[0][:20]
    full_kv_bytes = 3 * 32 * 4  # a token's raw rows in every layer, float32
    budget = 340 * full_kv_bytes
    knobs = {"num_kv_pages": None, "kv_device_bytes": budget, "max_num_seqs": 1}
    knobs |= {"max_num_batched_tokens": 32}
    with tiny_llm(model, page_size=8, **knobs) as llm:
        store = store_of(llm)
        rows = store.manager(ROWS)
        device = sum(m.pool.num_pages * m.pool.page_bytes for m in store.managers)
        assert device <= budget < 720 * full_kv_bytes
        held: list[int] = []
        allocate = rows.allocate

        def counted(request: Any, num_new_tokens: int) -> bool:
            ok = allocate(request, num_new_tokens)
            held.append(rows.pool.num_pages - rows.pool.num_free)
            return ok

        rows.allocate = counted  # type: ignore[method-assign]
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 700
        assert llm.engine.stats().num_preemptions == 0
        # the prompt's 3 pages at first, then the window's page and the one being written
        assert len(held) >= 700 and max(held) <= 3 and max(held[10:]) == 2
        assert rows.pool.num_free == rows.pool.num_pages  # all given back
        inputs = store.manager(INPUTS).pool
        assert inputs.num_free == inputs.num_pages  # CSA's inputs too
    assert out.outputs[0].token_ids == reference(model, [prompt], params)[0]
