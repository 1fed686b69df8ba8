"""Our model code + reference executor against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_greedy

from pypto_serving import LLM, SamplingParams
from pypto_serving.models.loader import load_model
from pypto_serving.ops.attention import DenseKV

PROMPTS = [[5, 17, 33, 90, 12], [200, 3, 4], list(range(40, 90)), [7] * 9 + [250, 251]]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_prompt_logits_match_hf(tiny_model, tiny_name):
    path = tiny_model(tiny_name)
    ours = load_model(path, torch.float32, torch.device("cpu"))
    hf = hf_model(path)
    ids = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        kv = DenseKV(ours.cfg.num_layers)  # in two chunks: the second attends to the cache
        got = ours.logits(
            torch.cat(
                [
                    ours(ids[:30], torch.arange(30), kv),
                    ours(ids[30:], torch.arange(30, len(ids)), kv),
                ]
            )
        )
    assert (got - expected).abs().max().item() < 1e-4


def test_greedy_tokens_match_hf_generate(tiny_model, tiny_name):
    path = tiny_model(tiny_name)
    hf = hf_model(path)
    llm = LLM(str(path), executor="reference", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = hf_greedy(hf, prompt, 32)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("name", ["llama-gqa4-tied"])
def test_bf16_loads_and_generates(tiny_model, name):
    llm = LLM(str(tiny_model(name)), executor="reference", dtype="bfloat16")
    assert llm.engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
