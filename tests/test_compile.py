"""Compile once, execute many: no recompilation after warm-up, whatever the batch."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from live_server import tiny_llm
from patience import patience

from pypto_serving import LLM, SamplingParams
from pypto_serving.device import cpu_isa
from pypto_serving.executor import compiled
from pypto_serving.executor.compiled import (
    COUNTER,
    CompiledLayers,
    LayerGraph,
    trust_cpu_vector_isa,
)
from pypto_serving.kv.paged_attention import PagedKV
from pypto_serving.models.llama import MLP, DecoderLayer


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """These tests count compiles: graphs another test in this worker compiled (a bf16
    SmolLM2, say) must not be served from dynamo's in-process caches instead."""
    torch._dynamo.reset()


def kinds(graphs: dict) -> set[tuple]:
    """Each captured graph's key as (layer class, its MLP's class, KV class, step class)."""
    by_name = {MLP.__qualname__: MLP}
    return {(cls, by_name.get(dict(made)["mlp"]), kv, c) for cls, made, kv, c in graphs}


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
    # at most one graph, none if another engine of this architecture compiled it: the
    # layers share it, and it serves every step (a decode of one too)
    assert executor.model.cfg.num_layers >= 2  # so that a graph per layer would show
    assert COUNTER.num_compiles - before <= 1
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
    llm = LLM(path, dtype="float32")
    # one graph for every step, captured: the layers call it directly
    assert kinds(llm.engine.executor.run_layer.graphs) == {(DecoderLayer, MLP, PagedKV, 0)}
    compiled = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in eager] == [o.outputs[0].token_ids for o in compiled]


def test_a_second_engine_of_an_architecture_serves_every_step(tiny_model):
    """The second engine finds the first one's graph kept on disk: it compiles nothing, and
    its layers call the graph directly for every step, a decode of one too."""
    path = str(tiny_model("llama-gqa4-tied"))
    prompts = [[3 + i] * (5 + 7 * i) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = LLM(path, dtype="float32")
    expected = first.generate(prompts, greedy, use_tqdm=False)
    compiles = COUNTER.num_compiles
    second = LLM(path, dtype="float32")
    assert COUNTER.num_compiles == compiles
    assert kinds(second.engine.executor.run_layer.graphs) == {(DecoderLayer, MLP, PagedKV, 0)}
    got = second.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert second.engine.executor.num_recompilations == 0


def test_kept_graphs_are_loaded_and_a_damaged_one_compiled_again(tiny_model, tmp_path, monkeypatch):
    """A fresh cache directory: the first engine compiles and keeps its graph, a restart
    loads it (0 compilations) and generates the same tokens; a damaged file is compiled
    again, and replaced."""
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    path = str(tiny_model("qwen3-hd32-gqa4"))
    prompts = [[4 + i] * (3 + 11 * i) for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    compiles = COUNTER.num_compiles
    expected = LLM(path, dtype="float32").generate(prompts, greedy, use_tqdm=False)
    assert COUNTER.num_compiles == compiles + 1
    (kept,) = (tmp_path / "graphs").glob("*.bin")
    for damage in (None, b"not a graph"):
        if damage is not None:
            kept.write_bytes(damage)
        compiles = COUNTER.num_compiles
        llm = LLM(path, dtype="float32")
        assert COUNTER.num_compiles == compiles + (damage is not None)
        assert kinds(llm.engine.executor.run_layer.graphs) == {(DecoderLayer, MLP, PagedKV, 0)}
        got = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert kept.stat().st_size > 1000  # rewritten


def test_a_background_compile_serves_eagerly_until_its_graph_is_ready(
    tiny_model, tmp_path, monkeypatch
):
    """With background_compile the engine is ready before its graph: while the compile is
    held back, requests are served eagerly (no graph, the tokens of an eager engine) beside
    it; once it is done the graph serves, with the same tokens and no recompilation. A
    graph compiled by the warm-up's thread never runs the serving thread's attention."""
    from pypto_serving.executor import compiled

    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))  # nothing kept: it must compile
    path = str(tiny_model("llama-gqa4-tied"))
    prompts = [[4 + i] * (3 + 9 * i) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eager = LLM(path, dtype="float32", enforce_eager=True).generate(prompts, greedy)
    tokens = [o.outputs[0].token_ids for o in eager]
    release, graph_path = threading.Event(), compiled.graph_path

    def held(*args: object) -> object:
        assert threading.current_thread().name == "pypto-compile"
        assert release.wait(patience(120))
        return graph_path(*args)

    monkeypatch.setattr(compiled, "graph_path", held)
    compiles = COUNTER.num_compiles
    llm = LLM(path, dtype="float32", background_compile=True)
    executor = llm.engine.executor
    try:
        assert llm.engine.stats().compiling and not executor.run_layer.graphs
        got = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == tokens
        assert llm.engine.stats().compiling and COUNTER.num_compiles == compiles
    finally:
        release.set()
    assert executor.wait_compiled(patience(120))
    assert not llm.engine.stats().compiling and executor.run_layer.compiler is None
    assert kinds(executor.run_layer.graphs) == {(DecoderLayer, MLP, PagedKV, 0)}
    assert COUNTER.num_compiles == compiles + 1
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == tokens
    assert llm.engine.stats().num_recompilations == 0
    llm.close()


def test_the_active_step_is_per_thread(monkeypatch):
    """The attention op reads the step its own thread made active: a background warm-up's
    steps and the serving thread's never see each other's metadata."""
    from pypto_serving.kv import paged_attention as pa
    from pypto_serving.kv.kinds import gqa

    class Marked:
        def __init__(self, value: float) -> None:
            self.value = value

    def attend(step: Marked, layer: int, q: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return torch.full_like(q, step.value)

    monkeypatch.setattr(gqa, "paged_attend", attend)  # what the op runs on the active step
    q, kv, layer = torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.tensor(0)
    inside, read = threading.Event(), threading.Event()
    seen: list[torch.Tensor] = []

    def other() -> None:
        with pa.active_step(Marked(2.0)):  # type: ignore[arg-type]
            inside.set()
            assert read.wait(patience(30))
            seen.append(gqa.paged_attention(q, kv, kv, layer))

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(patience(30))
    with pa.active_step(Marked(1.0)):  # type: ignore[arg-type]
        mine = gqa.paged_attention(q, kv, kv, layer)
        read.set()
        thread.join(patience(30))
    assert mine.eq(1).all() and seen[0].eq(2).all()


def test_closing_an_engine_stops_its_background_compile(tiny_model, tmp_path, monkeypatch):
    """close() while the warm-up compiles in the background: it stops after the graph at
    hand and close returns, with nothing left running."""
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_model("qwen3-hd32-gqa4")), dtype="float32", background_compile=True)
    executor = llm.engine.executor
    llm.close()
    assert not executor.compiling


def test_kept_graphs_are_keyed_by_what_they_are_made_of(tiny_model):
    """Layers whose tensors differ (another dtype), or steps of another class, get other
    files; the same layer and class, the same file."""
    from pypto_serving.executor.compiled import graph_path

    path = tiny_model("llama-gqa4-tied")
    paths = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(path), dtype=dtype, enforce_eager=True)
        layer = llm.engine.model.model.layers[0]
        width = llm.engine.model_config.hidden_size
        x = torch.zeros(3, width)
        half = torch.zeros(3, llm.engine.model_config.head_dim, dtype=llm.engine.dtype)
        kv = PagedKV()
        paths += [graph_path(layer, x, half, half, kv, c) for c in (0, 1)]
        assert graph_path(layer, x, half, half, kv, 0) == paths[-2]
    assert len(set(paths)) == 4


def test_quantized_layers_get_a_graph_of_their_own_for_a_decode_of_one(tiny_model):
    """A quantized linear calls its one-row kernel directly, a branch taken when traced, so
    quantized layers get a second graph, static, for a decode of one token."""
    knobs = {"dtype": "bfloat16", "quantization": "int8", "enforce_eager": False}
    with tiny_llm(tiny_model("llama-gqa4-tied"), **knobs) as llm:
        assert kinds(llm.engine.executor.run_layer.graphs) == {
            (DecoderLayer, MLP, PagedKV, 1),
            (DecoderLayer, MLP, PagedKV, 0),
        }
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate([[5, 6, 7], [8] * 20], greedy, use_tqdm=False)
        assert llm.engine.stats().num_recompilations == 0


def test_the_cpu_vector_isa_is_the_one_inductor_probes(monkeypatch):
    """Trusting the CPU's flags picks the ISA Inductor's own probes pick; a compiler that
    does not take the ISA's flags leaves the probing to Inductor."""
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    def picked(vec_isa_ok: bool | None) -> str:
        config.cpp.vec_isa_ok = vec_isa_ok
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        return str(cpu_vec_isa.pick_vec_isa())

    def no_second_compiler_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the compiler ran again for flags it took before")

    # torch's own patch restores the config on exit, an exception passing or not; the probes
    # pick at the width trusting caps Inductor at (device.cpu_isa)
    simdlen = 256 if cpu_isa() == "avx2" else None
    with config.patch({"cpp.vec_isa_ok": None, "cpp.simdlen": simdlen}):
        try:
            probed = picked(None)
            assert trust_cpu_vector_isa()
            assert config.cpp.vec_isa_ok is True
            assert str(cpu_vec_isa.pick_vec_isa()) == probed
            assert not trust_cpu_vector_isa()  # already decided: left as it is
            config.cpp.vec_isa_ok = None  # the next engine's start, in this process
            monkeypatch.setattr(compiled.subprocess, "run", no_second_compiler_run)
            assert trust_cpu_vector_isa() and config.cpp.vec_isa_ok is True
            monkeypatch.undo()
            for compiler in ("false", "/nonexistent/g++"):
                monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda c=compiler: c)
                picked(None)
                assert not trust_cpu_vector_isa()
                assert config.cpp.vec_isa_ok is None
        finally:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_a_failing_isa_check_leaves_inductor_config_as_it_was(monkeypatch):
    """Whatever goes wrong while trusting the ISA, Inductor's (process-wide, per-thread)
    config is left as it was: a check that fails is a no, an exception passes unchanged."""
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    def no_compiler() -> str:
        raise ValueError("cpp.cxx names no compiler")

    def crashed() -> object:
        raise RuntimeError("the ISA pick crashed")

    with config.patch({"cpp.vec_isa_ok": None, "cpp.simdlen": None}):
        try:
            monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
            assert not trust_cpu_vector_isa()
            assert config.cpp.vec_isa_ok is None
            monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", crashed)
            with pytest.raises(RuntimeError, match="crashed"):
                trust_cpu_vector_isa()
            assert config.cpp.vec_isa_ok is None
        finally:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_a_captured_layer_graph_is_checked_against_each_layer():
    """A layer whose tensors differ from the captured ones' (here: another shape) is not
    given the graph: its inputs are checked once, and it goes through dynamo instead."""
    graph = LayerGraph(
        fn=lambda *args: (args[0],),
        plan=["x", ("input_layernorm", "_parameters", "weight")],
        metas=[None, ((4,), (1,), "torch.float32", "cpu")],
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
