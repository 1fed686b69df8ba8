"""Sliding-window models (Mistral; Qwen3 and Qwen2 with `use_sliding_window`, windowed from
`max_window_layers` on; Gemma 3's local and global layers) against HF transformers on tiny
random checkpoints whose windows are shorter than the prompts: prompt logits within 1e-4 in
fp32 (whole and in chunks), and 32 greedy tokens equal to HF `generate` on four prompts longer
than the window, through the reference executor, the paged executor (its KV:
tests/test_sliding_window_kv.py), `pypto generate` and `pypto serve`."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from checkpoints import TINY_WINDOW, hf_expected, hf_greedy, hf_model, token_ids
from live_server import assert_served_as_offline, tiny_llm

from pypto_serving import LLM, SamplingParams
from pypto_serving.cli import main
from pypto_serving.kv.kinds import window
from pypto_serving.models.config import load_model_config
from pypto_serving.models.loader import load_model
from pypto_serving.models.windowed import WindowedCausalLM
from pypto_serving.ops.attention import DenseKV

NAMES = sorted(TINY_WINDOW)
PROMPTS = [list(range(40, 90)), [5, 17, 33, 90, 12] * 4, [7] * 9 + [250, 251] * 4, [200, 3] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model):
    """HF's greedy 32 tokens for each PROMPTS, per checkpoint."""
    return hf_expected(tiny_model, PROMPTS, GREEDY.max_tokens)


def test_config_reads_the_windowed_layers(tiny_model):
    found = {n: load_model_config(tiny_model(n)) for n in NAMES}
    assert found["mistral-window8"].window_layers == (0, 1)  # Mistral: every layer
    assert found["mistral-window8"].sliding_window == 8
    assert found["qwen3-window6-from1"].window_layers == (1, 2)  # from max_window_layers on
    assert found["qwen2-window11-from1"].window_layers == (1,)
    assert load_model_config(tiny_model("qwen2-gqa2")).window_layers == ()  # the switch off
    gemma = found["gemma3-local5-global"]
    assert gemma.window_layers == (0, 2) and gemma.gemma is not None and gemma.qk_norm
    assert gemma.gemma.query_scale == 24**-0.5 and gemma.gemma.final_logit_softcapping == 3.0
    assert gemma.gemma.local_inv_freq != gemma.rope_inv_freq  # each its own base
    oss = found["gptoss-window6-yarn"]
    assert oss.window_layers == (0, 2) and oss.gpt_oss is not None and not oss.gpt_oss.mxfp4
    assert oss.router == "topk_softmax" and oss.moe_layers == (0, 1, 2)
    assert oss.qkv_bias and oss.o_bias and oss.rope_scaling > 1  # YaRN's attention factor
    assert found["gptoss-full-first-mqa"].window_layers == (1,)
    groups = window.kv_groups(found["qwen3-window6-from1"], range(3), 4, torch.float32)
    assert [(g.name, g.spec.num_layers, g.keep) for g in groups] == [
        ("full", 1, None),
        ("sliding", 2, 5),  # the window's 6 tokens: the next one and 5 before it
    ]
    # a pipeline stage declares both groups, holding its own layers of each (maybe none)
    stages = [
        window.kv_groups(found["qwen3-window6-from1"], r, 4, torch.float32)
        for r in (range(1), range(1, 3))
    ]
    assert [[(g.name, g.spec.num_layers) for g in s] for s in stages] == [
        [("full", 1), ("sliding", 0)],
        [("full", 0), ("sliding", 2)],
    ]
    assert window.layer_groups(found["gemma3-local5-global"], range(1, 3)) == [
        ("full", 0),
        ("sliding", 0),  # checkpoint layer 2: the stage's first windowed layer
    ]
    assert found["mistral-window8"].parallel_shard(1, 2) == found["mistral-window8"]
    assert found["mistral-window8"].parallel_shard(2).num_kv_heads == 1
    assert found["qwen3-window6-from1"].parallel_shard(2).num_kv_heads == 1  # two groups too


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_match_hf(tiny_model, name):
    path = tiny_model(name)
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert isinstance(ours, WindowedCausalLM)
    ids = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        want = hf_model(path)(ids[None]).logits[0]
        whole = ours.logits(ours(ids, torch.arange(50), DenseKV(ours.cfg.num_layers)))
        kv = DenseKV(ours.cfg.num_layers)  # chunks shorter and longer than the window
        bounds = [0, 3, 14, 31, 50]
        hidden = [ours(ids[a:b], torch.arange(a, b), kv) for a, b in itertools.pairwise(bounds)]
        chunked = ours.logits(torch.cat(hidden))
        full = load_model(path, torch.float32, torch.device("cpu"))
        for layer in full.model.layers:
            layer.self_attn.window = None  # the window matters: without it the logits move
        unwindowed = full.logits(full(ids, torch.arange(50), DenseKV(full.cfg.num_layers)))
    assert (whole - want).abs().max().item() < 1e-4
    assert (chunked - want).abs().max().item() < 1e-4
    assert (unwindowed - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_reference_greedy_matches_hf_generate(tiny_model, expected, name):
    knobs = {"max_num_batched_tokens": 12, "long_prefill_token_threshold": 12}
    llm = LLM(str(tiny_model(name)), executor="reference", dtype="float32", **knobs)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)


PAGED = [(n, False) for n in NAMES] + [("qwen3-window6-from1", True)]  # both groups, eager


@pytest.mark.parametrize(("name", "eager"), PAGED, ids=[f"{n}-{e}" for n, e in PAGED])
def test_paged_greedy_matches_hf_generate(tiny_model, expected, name, eager):
    # pages of 4 (windows end inside pages), chunks of 12 tokens
    knobs = {"page_size": 4, "max_num_batched_tokens": 12, "long_prefill_token_threshold": 12}
    llm = LLM(str(tiny_model(name)), dtype="float32", enforce_eager=eager, **knobs)
    assert llm.engine.attention.compiled is not eager
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)
    assert llm.engine.executor.num_recompilations == 0


@pytest.mark.parametrize("name", NAMES)
def test_pypto_generate_matches_hf(tiny_model, tmp_path, name):
    from transformers import AutoTokenizer

    path = tiny_model(name)
    texts = ["hello world " * 4, "the quick brown fox " * 3, "what is the capital of france"]
    texts.append("paris is " * 6)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = hf_model(path)
    want = [hf_greedy(hf, tokenizer.encode(t), 32) for t in texts]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(path), "--prompts-file", str(prompts)]
    argv += ["--output", str(out), "--max-tokens", "32", "--temperature", "0"]
    assert main([*argv, "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == want


@pytest.mark.parametrize("name", NAMES)
def test_pypto_serve_matches_hf(tiny_model, expected, name):
    with tiny_llm(tiny_model(name)) as llm:
        # offline first: once served, the server's loop steps the same engine
        offline = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(offline) == expected(name)
        assert_served_as_offline(llm, PROMPTS, offline, 32)
