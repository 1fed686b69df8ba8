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

from pypto_serving.distributed import Group, shm_group
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


def test_dp2_pp2_gives_the_tokens_of_one_rank(tiny_model):
    """Two data-parallel replicas, each a pipeline of two stages (four processes): the
    requests split between the replicas, each stage's activations passed on inside its
    replica, the greedy and seeded tokens of one rank."""
    path = tiny_model("llama-gqa4-tied")
    with tiny_llm(path) as one:
        greedy, sampled = tokens(one, GREEDY), tokens(one, SAMPLED)
    with tiny_llm(path, data_parallel_size=2, pipeline_parallel_size=2) as four:
        assert tokens(four, GREEDY) == greedy
        assert tokens(four, SAMPLED) == sampled
        pids = children_of(os.getpid())
        assert len(pids) >= 2  # the replicas (each starting its second stage)
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize(
    ("name", "knobs"),
    [("llama-gqa4-tied", {}), ("qwen3moe-e4-top2", {"enable_expert_parallel": True})],
)
def test_tp2_pp2_gives_the_tp1_and_hf_tokens(tiny_model, name, knobs):
    """Four ranks: 2 stages of 2 TP ranks each, their TP collectives in their stage's own
    sub-group, a stage's activations to the next stage's rank of the same TP index, the
    last stage's logits to rank 0. Dense, and a MoE (layer 0's experts over stage 0's TP
    ranks, layer 1 dense on stage 1)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [[hf_greedy(hf, p, GREEDY.max_tokens)] for p in PROMPTS]
    with tiny_llm(path) as one:
        sampled = tokens(one, SAMPLED)
    with tiny_llm(path, tensor_parallel_size=2, pipeline_parallel_size=2, **knobs) as four:
        model, groups = four.engine.model, four.engine.model.groups
        assert (groups.tp, groups.pp) == (Group(0, 2), Group(0, 2))
        assert list(model.model.local) == [0] and model.lm_head is None  # stage 0's layer
        assert model.cfg.num_heads * 2 == hf.config.num_attention_heads  # its TP share
        pids = [w.pid for w in four.engine.workers]
        assert len(pids) == 3
        assert shm_group() is not None and shm_group().world == 2  # stage 0's own segment
        assert tokens(four, GREEDY) == expected
        assert tokens(four, SAMPLED) == sampled
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("tp", [1, 2])
def test_pp2_compiled_without_recompilation(tiny_model, tp):
    path = tiny_model("qwen2-gqa2")
    with tiny_llm(path) as one:
        expected = tokens(one, GREEDY)
    knobs = {"tensor_parallel_size": tp, "enforce_eager": False}
    with tiny_llm(path, pipeline_parallel_size=2, **knobs) as two:
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
