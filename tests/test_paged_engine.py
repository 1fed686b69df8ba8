"""The paged engine against the reference executor and HF transformers (fp32, greedy)."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import hf_greedy

from pypto_serving import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MODELS = ["llama-gqa4-tied", "qwen3-hd32-gqa4"]


def mixed_prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference_tokens(tiny_model):
    """Greedy tokens of the reference executor for each (model, prompt set)."""
    cache: dict[tuple[str, int], list[list[int]]] = {}

    def get(name: str, prompts: list[list[int]]) -> list[list[int]]:
        key = (name, hash(str(prompts)))
        if key not in cache:
            llm = LLM(str(tiny_model(name)), executor="reference", dtype="float32")
            cache[key] = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        return cache[key]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_one_request_matches_hf(tiny_model, name):
    from transformers import AutoModelForCausalLM

    path = tiny_model(name)
    prompt = mixed_prompts(1, seed=3, lo=70, hi=71)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompt, 20)
    llm = LLM(str(path), dtype="float32", page_size=16)
    assert tokens(llm.generate([prompt], GREEDY)) == [expected]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "knobs",
    [
        {"page_size": 64},
        {"page_size": 16},
        {"page_size": 16, "max_num_batched_tokens": 48, "long_prefill_token_threshold": 32},
        {"page_size": 64, "max_num_seqs": 5},
    ],
    ids=["page64", "page16", "chunked-prefill", "max-seqs-5"],
)
def test_sixteen_mixed_requests_match_reference(tiny_model, reference_tokens, name, knobs):
    prompts = mixed_prompts(16)
    llm = LLM(str(tiny_model(name)), dtype="float32", **knobs)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference_tokens(name, prompts)


@pytest.mark.parametrize("name", MODELS)
def test_second_wave_hits_prefix_cache_with_same_outputs(tiny_model, reference_tokens, name):
    rng = random.Random(1)
    shared = [rng.randrange(3, 320) for _ in range(100)]
    first = [
        shared + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 30))] for _ in range(4)
    ]
    second = [
        shared + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 30))] for _ in range(8)
    ]
    llm = LLM(str(tiny_model(name)), dtype="float32", page_size=16)
    llm.generate(first, GREEDY, use_tqdm=False)
    wave = llm.generate(second, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 96 for o in wave)  # 6 full pages of the shared 100
    assert tokens(wave) == reference_tokens(name, second)
    assert llm.engine.scheduler.prefix_hits > 0


@pytest.mark.parametrize("name", MODELS)
def test_tiny_pool_preempts_with_same_outputs(tiny_model, reference_tokens, name):
    prompts = mixed_prompts(16)
    llm = LLM(str(tiny_model(name)), dtype="float32", page_size=16, num_kv_pages=12)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference_tokens(name, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.executor.kv.pool.num_free == 12  # nothing leaked


def test_abort_n3_while_samples_wait(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa4-tied")), dtype="float32", max_num_batched_tokens=16)
    family = llm.add(list(range(3, 60)), SamplingParams(n=3, max_tokens=4))
    llm.step()
    llm.abort(family)
    assert [c.finish_reason for c in family.children] == ["abort"] * 3
    assert not llm.engine.has_unfinished() and not llm._families


def test_n3_seeded_sampling_is_reproducible_and_shares_the_prompt(tiny_model):
    path = str(tiny_model("qwen3-hd32-gqa4"))
    prompt = mixed_prompts(1, seed=5, lo=80, hi=81)[0]
    params = SamplingParams(
        n=3, temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True
    )
    runs = []
    for _ in range(2):
        llm = LLM(path, dtype="float32", page_size=16)
        out = llm.generate([prompt], params)[0]
        runs.append([o.token_ids for o in out.outputs])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3  # three different samples
    # samples 2 and 3 found 4 of the prompt's 5 full pages (the last token is recomputed)
    assert llm.engine.scheduler.prefix_hits == 2 * 64


def test_seeded_request_same_alone_or_in_batch_of_16(tiny_model):
    path = str(tiny_model("llama-gqa4-tied"))
    prompts = mixed_prompts(16, seed=9)
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)
    llm = LLM(path, dtype="float32", page_size=16)
    alone = tokens(llm.generate([prompts[7]], params))
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts, [params if i == 7 else others for i in range(16)], use_tqdm=False)
    assert tokens(batch)[7] == alone[0]


def test_abort_frees_everything_at_any_stage(tiny_model):
    llm = LLM(
        str(tiny_model("llama-gqa4-tied")), dtype="float32", page_size=16, max_num_batched_tokens=32
    )
    families = [llm.add(p, GREEDY) for p in mixed_prompts(6, seed=2, lo=40, hi=100)]
    llm.step()  # some requests are mid-prefill, some still waiting
    core = llm.engine
    for f in families:
        llm.abort(f)
    assert not core.has_unfinished() and not core.scheduler.requests and not llm._families
    kv = core.executor.kv
    assert kv.pool.num_free == kv.num_pages and not kv.managers[0].tables
    assert all(f.children[0].finish_reason == "abort" for f in families)


def test_context_clamp_stops_at_max_model_len(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa4-tied")), dtype="float32", max_model_len=40)
    out = llm.generate(
        [list(range(3, 33))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_stop_strings_and_text(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa4-tied")), dtype="float32")
    full = llm.generate(
        ["hello world"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0].outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[5:8]
    if not stop.strip():
        pytest.skip("degenerate random text")
    cut = llm.generate(
        ["hello world"], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]


def test_priority_orders_admission(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa4-tied")), dtype="float32", max_num_seqs=1)
    finished: list[str] = []
    families = [
        llm.add([5, 6, 7 + i], SamplingParams(temperature=0, max_tokens=2), priority=p)
        for i, p in enumerate([2, 0, 1])
    ]
    while llm.engine.has_unfinished():
        finished += [f.request_id for f in llm.step() if f.output().finished]
    assert finished == [families[1].request_id, families[2].request_id, families[0].request_id]


def test_logprobs_match_the_reference(tiny_model):
    path = str(tiny_model("qwen3-hd32-gqa4"))
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    got, ref = (
        LLM(path, dtype="float32", executor=e).generate([[9, 8, 7, 6]], params)[0]
        for e in ("paged", "reference")
    )
    for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and list(a.top_logprobs) == list(b.top_logprobs)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert max(a.top_logprobs.values()) == pytest.approx(a.logprob, abs=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_paged_close_to_fp32_reference(tiny_model, name):
    """bf16 greedy tokens equal fp32's, or at the first divergence each side's token is in the
    other's top-5 logprobs."""
    path = str(tiny_model(name))
    prompts = mixed_prompts(8, seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    ref = LLM(path, executor="reference", dtype="float32").generate(prompts, params)
    got = LLM(path, dtype="bfloat16", page_size=16).generate(prompts, params)
    for a, b in zip(got, ref, strict=True):
        a_out, b_out = a.outputs[0], b.outputs[0]
        for i, (x, y) in enumerate(zip(a_out.token_ids, b_out.token_ids, strict=True)):
            if x != y:
                assert x in b_out.logprobs[i].top_logprobs
                assert y in a_out.logprobs[i].top_logprobs
                break
