"""Compile once, execute many: no recompilation after warm-up, whatever the batch."""

from __future__ import annotations

import random

import torch

from pypto_serving import LLM, SamplingParams
from pypto_serving.executor.compiled import COUNTER, CompiledLayers, LayerGraph
from pypto_serving.kv.paged_attention import PagedKV
from pypto_serving.models.llama import MLP


def test_no_recompilation_after_warmup_across_batch_compositions(tiny_model):
    before = COUNTER.num_compiles
    llm = LLM(
        str(tiny_model("qwen3-hd32-gqa4")),
        dtype="float32",
        page_size=16,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=48,
        num_kv_pages=40,
    )
    executor = llm.engine.executor
    assert isinstance(executor.run_layer, CompiledLayers)  # compiled, no eager fallback
    assert executor.num_recompilations == 0
    # at most two graphs (the layer's for a decode of one, for the rest), none if another
    # engine of this architecture compiled them: the layers share them
    assert executor.model.cfg.num_layers >= 2  # so that a graph per layer would show
    assert COUNTER.num_compiles - before <= 2
    compiles = COUNTER.num_compiles
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    workloads = [
        [[5, 6, 7]],  # one short request: prefill then decode of one
        [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 120))] for _ in range(16)],
        [[*shared, i] for i in range(3, 9)],  # prefix hits
        [[*shared, i, i] for i in range(3, 9)],
        [[9] * 150, [8] * 2],  # chunked prefill beside a decode
    ]
    for prompts in workloads:
        llm.generate(prompts, greedy, use_tqdm=False)
    llm.generate([[4] * 30], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5))
    assert llm.engine.scheduler.num_preemptions > 0  # the small pool forced some
    assert executor.num_recompilations == 0
    assert COUNTER.num_compiles == compiles


def test_eager_and_compiled_paths_agree(tiny_model):
    path = str(tiny_model("llama-gqa4-tied"))
    prompts = [[3 + i] * (5 + 7 * i) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eager = LLM(path, dtype="float32", enforce_eager=True).generate(prompts, greedy)
    torch._dynamo.reset()  # so that this engine compiles, and captures, its own layer graphs
    llm = LLM(path, dtype="float32")
    # both graphs (decode of one; any other step) captured: the layers call them directly
    assert set(llm.engine.executor.run_layer.graphs) == {
        (MLP, PagedKV, True),
        (MLP, PagedKV, False),
    }
    compiled = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in eager] == [o.outputs[0].token_ids for o in compiled]


def test_a_captured_layer_graph_is_checked_against_each_layer():
    """A layer whose tensors differ from the captured ones' (here: another shape) is not
    given the graph: its inputs are checked once, and it goes through dynamo instead."""
    graph = LayerGraph(
        fn=lambda *args: (args[0],),
        examples=[torch.zeros(2, 4), torch.zeros(4)],
        plan=["x", ("input_layernorm", "_parameters", "weight")],
    )
    cfg_layer = torch.nn.Module()
    cfg_layer.input_layernorm = torch.nn.Module()
    cfg_layer.input_layernorm.weight = torch.nn.Parameter(torch.ones(4))
    x = torch.ones(2, 4)
    assert graph(cfg_layer, x, x, x) is x  # type: ignore[arg-type]
    other = torch.nn.Module()
    other.input_layernorm = torch.nn.Module()
    other.input_layernorm.weight = torch.nn.Parameter(torch.ones(8))
    assert graph(other, x, x, x) is None  # type: ignore[arg-type]


def test_compile_failure_falls_back_to_eager(tiny_model, monkeypatch, caplog):
    """Where torch.compile cannot work (no C++ compiler, say) the engine still serves."""
    from torch._inductor.exc import InductorError

    from pypto_serving.executor import paged

    def broken(*args, **kwargs):
        raise InductorError(RuntimeError("no C++ compiler"), "")

    monkeypatch.setattr(paged, "CompiledLayers", lambda: broken)
    llm = LLM(str(tiny_model("llama-gqa4-tied")), dtype="float32")
    assert llm.engine.executor.run_layer is None
    assert "serving eagerly" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.executor.kv.pool.num_free == llm.engine.executor.kv.num_pages
