"""Qwen3-MoE (our own model code) and expert parallelism across the tensor-parallel ranks.

Ground truth: HF transformers' Qwen3MoeForCausalLM. The tiny checkpoint has 4 experts, top-2
routing with renormalised weights, a mixture-of-experts layer and a dense one."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import hf_greedy
from live_server import tiny_llm
from parallel_checks import children_of, config_error
from test_tensor_parallel import GREEDY, PROMPTS, tokens

from pypto_serving.errors import PyptoError
from pypto_serving.ops.moe import expert_placement

MOE = "qwen3moe-e4-top2"


@pytest.fixture(scope="module")
def expected(tiny_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model(MOE), dtype=torch.float32)
    return [[hf_greedy(hf, p, GREEDY.max_tokens)] for p in PROMPTS]


def test_moe_without_expert_parallel_matches_hf(tiny_model, expected):
    with tiny_llm(tiny_model(MOE)) as llm:
        assert llm.engine.model.model.layers[0].mlp.held == [0, 1, 2, 3]
        assert tokens(llm, GREEDY) == expected


@pytest.mark.parametrize(("strategy", "held"), [("linear", [0, 1]), ("round_robin", [0, 2])])
def test_ep2_matches_hf(tiny_model, expected, strategy, held):
    knobs = {"enable_expert_parallel": True, "expert_placement_strategy": strategy}
    with tiny_llm(tiny_model(MOE), tensor_parallel_size=2, **knobs) as llm:
        assert llm.engine.model.model.layers[0].mlp.held == held  # rank 0's share
        assert tokens(llm, GREEDY) == expected


def test_ep2_compiled_without_recompilation(tiny_model, expected):
    knobs = {"enable_expert_parallel": True, "enforce_eager": False}
    with tiny_llm(tiny_model(MOE), tensor_parallel_size=2, **knobs) as llm:
        assert tokens(llm, GREEDY) == expected
        assert llm.engine.executor.num_recompilations == 0


@pytest.mark.parametrize(
    ("model", "knobs", "message"),
    [
        ("qwen2-gqa2", {"tensor_parallel_size": 2, "enable_expert_parallel": True}, "is dense"),
        (MOE, {"tensor_parallel_size": 2}, "needs enable_expert_parallel"),
    ],
)
def test_expert_parallel_model_errors(tiny_model, model, knobs, message):
    with pytest.raises(PyptoError, match=message):
        tiny_llm(tiny_model(model), **knobs)
    assert children_of(os.getpid()) == []  # refused before any rank started


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"enable_expert_parallel": True}, "set tensor_parallel_size > 1"),
        ({"expert_placement_strategy": "random"}, "expert_placement_strategy must be one of"),
    ],
)
def test_expert_parallel_config_errors(knobs, message):
    assert message in config_error(knobs)


def test_placements_cover_every_expert_once():
    for strategy in ("linear", "round_robin"):
        for size in (1, 2, 3):
            held = [expert_placement(8, r, size, strategy) for r in range(size)]
            assert sorted(e for h in held for e in h) == list(range(8))
    assert expert_placement(8, 1, 3, "linear") == [2, 3, 4]
    assert expert_placement(8, 1, 3, "round_robin") == [1, 4, 7]
