"""The int8 KV cache (`kv_cache_dtype="int8"`): the engine against its bf16 self, pages that
go down to the CPU tier and back unchanged, the pool it sizes, and the errors. The kernels
themselves are tested in test_native_attention.py."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import assert_top5_rule
from live_server import tiny_llm

from pypto_serving import SamplingParams
from pypto_serving.errors import PyptoError

MODEL = "qwen3-hd32-gqa4"  # head_dim 32: the native kernels' shapes (the tier tests' has 8)
rng = random.Random(11)
PROMPTS = [[rng.randrange(3, 320) for _ in range(5 + 23 * i)] for i in range(4)]


def test_the_int8_kv_engine_follows_the_bf16_one(tiny_model):
    """Greedy tokens where each side's token is in the other's top-5 (the rule of the bf16
    equality tests), compiled, with 0 recompilations after warm-up."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    knobs = {"dtype": "bfloat16", "enforce_eager": False}
    with tiny_llm(tiny_model(MODEL), **knobs) as plain:
        expected = plain.generate(PROMPTS, params, use_tqdm=False)
    with tiny_llm(tiny_model(MODEL), kv_cache_dtype="int8", **knobs) as int8:
        got = int8.generate(PROMPTS, params, use_tqdm=False)
        assert int8.engine.stats().num_recompilations == 0
        assert int8.engine.executor.kv.pool.cache.k_cache.dtype == torch.int8
    # int8 rounding moves a few tokens, not every sequence
    assert assert_top5_rule(expected, got) < len(PROMPTS)


def test_int8_pages_come_back_from_the_cpu_tier_unchanged(tiny_model):
    """Six device pages of 16 tokens: the later prompts push the first one's cached pages to
    the CPU tier; generating it again loads them back and gives the same tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 1 << 20, "kv_cache_dtype": "int8"}
    with tiny_llm(tiny_model(MODEL), **knobs) as llm:
        first = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
        again = llm.generate([prompts[0]], greedy, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
        assert again.cached_tokens_by_tier == {"cpu": 32}


def test_an_int8_pool_holds_more_pages_in_the_same_bytes(tiny_model):
    budget = {"num_kv_pages": None, "kv_device_bytes": 1 << 20, "kv_cpu_bytes": 0}
    with tiny_llm(tiny_model(MODEL), dtype="bfloat16", **budget) as plain:
        bf16 = plain.engine.executor.kv
        pages, page_bytes = bf16.num_pages, bf16.pool.page_bytes
    with tiny_llm(tiny_model(MODEL), dtype="bfloat16", kv_cache_dtype="int8", **budget) as int8:
        store = int8.engine.executor.kv
        # a row of 32 bf16 values (64 bytes) becomes 32 int8 values and a float32 scale
        assert store.pool.page_bytes * 64 == page_bytes * 36
        assert store.num_pages == (1 << 20) // store.pool.page_bytes > pages
        assert store.pool.cache.k_cache.shape[-1] == 36


def test_kv_cache_dtype_errors(tiny_model):
    with pytest.raises(PyptoError, match="kv_cache_dtype must be one of"):
        tiny_llm(tiny_model(MODEL), kv_cache_dtype="fp8")
    with pytest.raises(PyptoError, match="kv_cache_dtype int8 needs the native CPU attention"):
        tiny_llm(tiny_model(MODEL), kv_cache_dtype="int8", native_attention=False)
