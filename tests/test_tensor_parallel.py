"""Tensor parallelism over torch.distributed (separate processes on this machine: their
collectives through shared memory, gloo for the rest; two "nodes" on loopback below).

Ground truth: the same engine with TP=1, and HF transformers. Every rank holds its share of
the heads, KV heads, MLP columns and vocabulary; greedy tokens must not change.
"""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import assert_top5_rule, hf_greedy
from live_server import serving, tiny_llm
from parallel_checks import children_of, config_error, gone
from patience import patience

from pypto_serving.distributed import Group, collectives_transport
from pypto_serving.errors import PyptoError
from pypto_serving.models.loader import tensor_parallel_slice
from pypto_serving.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=30, max_tokens=6, seed=3, n=2)
PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 13 * i)] for i in range(6)]


def tokens(llm, params: SamplingParams) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["llama-gqa4-tied", "qwen2-gqa2", "qwen3-hd32-gqa4"])
def test_tp2_gives_the_tp1_and_hf_tokens(tiny_model, name):
    """GQA, tied and untied heads, q/k/v biases, qk-norm: TP=2 equals TP=1 equals HF."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [[hf_greedy(hf, p, GREEDY.max_tokens)] for p in PROMPTS]
    with tiny_llm(path) as one:
        assert tokens(one, GREEDY) == expected
        sampled = tokens(one, SAMPLED)
    cores = os.sched_getaffinity(0)
    with tiny_llm(path, tensor_parallel_size=2) as two:
        workers = [w.pid for w in two.engine.workers]
        if len(cores) >= 2:  # a rank's share of the threads, any of the engine's cores
            assert os.sched_getaffinity(workers[0]) == os.sched_getaffinity(0) == cores
            assert torch.get_num_threads() == len(cores) // 2
        assert (
            len(workers) == 1
            and two.engine.model.cfg.num_kv_heads * 2 == hf.config.num_key_value_heads
        )
        assert collectives_transport() == "shm"  # both ranks on this machine
        assert tokens(two, GREEDY) == expected
        assert tokens(two, SAMPLED) == sampled
    assert all(gone(pid) for pid in workers)


@pytest.mark.parametrize("name", ["qwen3-hd32-gqa4", "qwen2-gqa2"])
def test_tp2_native_decode_step_follows_tp1(tiny_model, name):
    """bf16: every rank runs its share of the native decode step, its all-reduces and the
    logits' all-gather called from C++ through shared memory; greedy tokens follow TP=1's
    native step by the bf16 rule (the partial sums add in another order)."""
    path = tiny_model(name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    with tiny_llm(path, dtype="bfloat16") as one:
        assert one.engine.executor.native is not None
        expected = one.generate(PROMPTS, params, use_tqdm=False)
    with tiny_llm(path, dtype="bfloat16", tensor_parallel_size=2) as two:
        native = two.engine.executor.native
        assert native is not None and native.comm is not None
        calls: list[int] = []
        logits = native.logits
        native.logits = lambda *a: calls.append(len(a[0])) or logits(*a)
        got = two.generate(PROMPTS, params, use_tqdm=False)
        assert len(PROMPTS) in calls
    assert_top5_rule(expected, got)


def test_tp2_compiled_without_recompilation(tiny_model):
    """The collectives are opaque custom ops: the compiled forward works on every rank and
    varied batches compile nothing after warm-up."""
    path = tiny_model("llama-mha-untied")
    with tiny_llm(path) as one:
        expected = tokens(one, GREEDY)
    with tiny_llm(path, tensor_parallel_size=2, enforce_eager=False) as two:
        assert collectives_transport() == "shm"
        assert tokens(two, GREEDY) == expected
        assert two.generate([[5] * 70], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert two.engine.executor.num_recompilations == 0


def test_tp2_server_and_dp2_x_tp2(tiny_model):
    import httpx

    path = tiny_model("qwen3-hd32-gqa4")
    with tiny_llm(path) as one:
        expected = [o.outputs[0].text for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with serving(tiny_llm(path, tensor_parallel_size=2)) as live:
        for prompt, text in zip(PROMPTS, expected, strict=True):
            body = {"model": live.model, "prompt": prompt, "max_tokens": 10, "temperature": 0}
            r = httpx.post(f"{live.url}/v1/completions", json=body | {"ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    with tiny_llm(path, data_parallel_size=2, tensor_parallel_size=2) as four:
        got = [o.outputs[0].text for o in four.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
    assert children_of(os.getpid()) == []


def test_tp_must_divide_the_kv_heads(tiny_model):
    with pytest.raises(
        PyptoError, match=r"tensor_parallel_size 2 does not divide the model's KV heads \(1\)"
    ):
        tiny_llm(tiny_model("qwen3-hd8-untied"), tensor_parallel_size=2)
    assert children_of(os.getpid()) == []  # refused before any rank started


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"distributed_backend": "mpi"}, "distributed_backend must be one of gloo, nccl"),
        (
            {"tensor_parallel_size": 2, "devices": "cpu"},
            "tensor_parallel_size 2 x pipeline_parallel_size 1 / nnodes 1); give one",
        ),
        ({"tensor_parallel_size": 2, "quantization": "w8a8"}, "w8a8 is not available with tensor"),
        ({"tensor_parallel_size": 2, "executor": "reference"}, "need the paged executor"),
    ],
)
def test_tensor_parallel_config_errors(knobs, message):
    assert message in config_error(knobs)


def test_checkpoint_slices_per_rank():
    w = torch.arange(5 * 2).view(5, 2)  # a vocabulary of 5 rows over 2 ranks: 3 + 2 (+1 pad)
    first, second = (
        tensor_parallel_slice("model.embed_tokens.weight", w, Group(r, 2)) for r in (0, 1)
    )
    assert first.tolist() == w[:3].tolist()
    assert second.tolist() == [*w[3:].tolist(), [0, 0]]
    q = torch.arange(8 * 4).view(8, 4)
    assert torch.equal(
        tensor_parallel_slice("layers.0.self_attn.q_proj.weight", q, Group(1, 2)), q[4:]
    )
    assert torch.equal(
        tensor_parallel_slice("layers.0.self_attn.o_proj.weight", q, Group(1, 2)), q[:, 2:]
    )
    assert torch.equal(tensor_parallel_slice("layers.0.self_attn.o_proj.bias", q, Group(1, 2)), q)
    assert torch.equal(tensor_parallel_slice("layers.0.input_layernorm.weight", q, Group(1, 2)), q)


@pytest.mark.parametrize("dimension", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_nodes_on_loopback(tiny_model, dimension):
    """Node 1 is a separate `pypto serve --node-rank 1` process hosting rank 1 (a TP share or
    the second pipeline stage); node 0 (this process) runs rank 0 and the engine; they
    rendezvous on 127.0.0.1 like two machines."""
    import subprocess
    import sys

    from live_server import FAST_KNOBS, free_port

    path = tiny_model("qwen2-gqa2")
    with tiny_llm(path) as one:
        expected = tokens(one, GREEDY)
    port = free_port()
    flag = "--" + dimension.replace("_", "-")
    flags = [flag, "2", "--nnodes", "2", "--master-port", str(port)]
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if k != "enforce_eager"]
    serve = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(path)]
    node1 = subprocess.Popen([*serve, "--enforce-eager", *knobs, *flags, "--node-rank", "1"])
    try:
        with tiny_llm(path, nnodes=2, master_port=port, **{dimension: 2}) as node0:
            assert node0.engine.workers == []  # rank 1 lives on "the other machine"
            assert tokens(node0, GREEDY) == expected
        assert node1.wait(timeout=patience(30)) == 0  # rank 0's stop ends node 1
    finally:
        node1.kill()


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"tensor_parallel_size": 2, "nnodes": 2}, "nnodes > 1 needs master_port"),
        (
            {"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1234},
            "must be a multiple of nnodes",
        ),
        ({"nnodes": 2, "node_rank": 2, "master_port": 1234}, "node_rank must be below nnodes (2)"),
        (
            {"data_parallel_size": 3, "nnodes": 2, "master_port": 1},
            "data_parallel_size (3) must be a multiple of nnodes 2 (as many replicas",
        ),
        (
            {"data_parallel_size": 2, "enable_expert_parallel": True, "nnodes": 2},
            "nnodes > 1 needs master_port",
        ),
        (
            {"data_parallel_size": 2, "enable_expert_parallel": True, "nnodes": 2}
            | {"master_port": 65535},
            "DP attention + EP on several nodes also listens on master_port + 1",
        ),
        ({"master_port": 70000}, "master_port must be in [1, 65535]"),
        ({"headless": True}, "headless is for nodes other than 0"),
    ],
)
def test_multi_node_config_errors(knobs, message):
    assert message in config_error(knobs)


def test_a_rank_that_fails_to_start_is_named_and_nothing_waits(tiny_model, monkeypatch):
    """A rank failing before the rendezvous is reported at once (rank 0 never waits for it
    in init_process_group) and no process is left behind."""
    import time

    from fault_injection import FAIL_RANK_START, inject

    inject(monkeypatch, FAIL_RANK_START, "1")
    start = time.monotonic()
    with pytest.raises(
        PyptoError, match=r"rank 1 \(pid \d+\) failed to start: RuntimeError: injected"
    ):
        tiny_llm(tiny_model("qwen2-gqa2"), tensor_parallel_size=2)
    assert time.monotonic() - start < min(patience(60), 290)  # not the 300 s rendezvous timeout
    assert children_of(os.getpid()) == []
