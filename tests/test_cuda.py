"""The CUDA path, against HF transformers on the same GPU. These tests need a GPU: CI's
machines have none, so there they do not run (each session lent a GPU runs them:
`python -m pytest tests/test_cuda.py`, see docs/reliability.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from checkpoints import assert_top5_rule, token_ids

from pypto_serving import LLM, SamplingParams
from pypto_serving.errors import PyptoError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[(5 * i + 7 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(5)]
MODELS = ["llama-gqa4-tied", "qwen3-hd32-gqa4", "qwen3moe-e4-top2", "deepseekv3-qlora-yarn"]
COMPILES = hasattr(torch.compile(lambda x: x), "aot_compile")
"""The compiled executor needs dynamo's aot_compile (the pinned torch has it); a GPU machine
with an older torch checks the paged executor eagerly."""
EXECUTORS = {
    "compiled": {"executor": "paged"},
    "eager": {"executor": "paged", "enforce_eager": True},
    "reference": {"executor": "reference"},
}
KNOBS = {"device": "cuda", "enforce_eager": not COMPILES}


def hf_greedy_cuda(path: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        gen = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_float32_greedy_on_cuda_is_hf_on_cuda(tiny_model, name, executor):
    """The paged executor, compiled and eager, and the reference oracle on the GPU: HF's
    greedy tokens."""
    if executor == "compiled" and not COMPILES:
        pytest.skip(f"torch {torch.__version__} has no aot_compile (the pin is 2.13)")
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_model(name)
    expected = hf_greedy_cuda(path, PROMPTS, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device="cuda", dtype="float32", **EXECUTORS[executor]) as llm:
        assert llm.engine.device.type == "cuda"
        got = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert got == expected


@pytest.mark.parametrize("name", MODELS[:2])
def test_bf16_on_cuda_follows_float32(tiny_model, name):
    path = tiny_model(name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    with LLM(str(path), **KNOBS, dtype="float32") as llm:
        expected = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(str(path), **KNOBS, dtype="bfloat16") as llm:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_top5_rule(expected, got)


def test_prefix_hits_and_preemption_on_cuda_change_no_token(tiny_model):
    """A shared prefix (hits in the device pool) and a pool too small for all at once
    (preemption, recompute): each sequence as it is alone."""
    path = tiny_model("llama-gqa4-tied")
    system = [(11 * j) % 300 + 3 for j in range(40)]
    prompts = [[*system, 7 + i, 9 + i, 13] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    knobs = KNOBS | {"dtype": "float32", "page_size": 16}
    with LLM(str(path), **knobs, num_kv_pages=64) as llm:
        alone = [token_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    with LLM(str(path), **knobs, num_kv_pages=12) as llm:
        together = token_ids(llm.generate(prompts, params, use_tqdm=False))
        stats = llm.engine.stats()
    assert together == alone
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0


def test_cpu_only_features_on_cuda_are_clear_errors(tiny_model):
    path = tiny_model("llama-gqa4-tied")
    with pytest.raises(PyptoError, match="quantization"):
        LLM(str(path), device="cuda", quantization="int4")
