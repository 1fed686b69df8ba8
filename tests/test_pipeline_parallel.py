"""Pipeline parallelism: layers split into stages across ranks, activations point-to-point.

Ground truth: the same engine with PP=1 and HF transformers."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import hf_greedy
from live_server import tiny_llm
from parallel_checks import children_of, config_error, gone
from test_tensor_parallel import GREEDY, PROMPTS, SAMPLED, tokens

from pypto_serving.distributed import Group
from pypto_serving.errors import PyptoError
from pypto_serving.models.llama import stage_layers


@pytest.mark.parametrize("name", ["llama-gqa4-tied", "qwen3-hd8-untied"])
def test_pp2_gives_the_pp1_and_hf_tokens(tiny_model, name):
    """Tied embeddings (the last stage holds its own copy for the LM head) and untied."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [[hf_greedy(hf, p, GREEDY.max_tokens)] for p in PROMPTS]
    with tiny_llm(path) as one:
        sampled = tokens(one, SAMPLED)
    with tiny_llm(path, pipeline_parallel_size=2) as two:
        model = two.engine.model
        assert list(model.model.local) == [0] and model.lm_head is None  # stage 0 of 2
        pids = [w.pid for w in two.engine.workers]
        assert tokens(two, GREEDY) == expected
        assert tokens(two, SAMPLED) == sampled
    assert all(gone(pid) for pid in pids)


def test_pp2_compiled_without_recompilation(tiny_model):
    path = tiny_model("qwen2-gqa2")
    with tiny_llm(path) as one:
        expected = tokens(one, GREEDY)
    with tiny_llm(path, pipeline_parallel_size=2, enforce_eager=False) as two:
        assert tokens(two, GREEDY) == expected
        assert two.generate([[5] * 70], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert two.engine.executor.num_recompilations == 0


def test_more_stages_than_layers_is_refused(tiny_model):
    with pytest.raises(PyptoError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        tiny_llm(tiny_model("qwen2-gqa2"), pipeline_parallel_size=3)
    assert children_of(os.getpid()) == []


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1"),
        ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "together are not supported"),
        ({"pipeline_parallel_size": 2, "devices": "cpu"}, "pipeline_parallel_size 2 / nnodes 1"),
        (
            {"pipeline_parallel_size": 2, "quantization": "w8a8"},
            "w8a8 is not available with tensor",
        ),
    ],
)
def test_pipeline_config_errors(knobs, message):
    assert message in config_error(knobs)


def test_stages_split_layers_evenly_in_order():
    stages = [stage_layers(30, Group(r, 4)) for r in range(4)]
    assert [len(s) for s in stages] == [7, 8, 7, 8]
    assert [i for s in stages for i in s] == list(range(30))
