"""The native decode step (native/decode.cpp, executor/native_decode.py).

The packed matmuls are held to the exact product of the quantized activations and the
dequantized weights, in the AVX512-VNNI build, the portable one and the AVX2 (x86-64-v3) one.
The whole step is held to the compiled graphs of the same engine, step by step: on a checkpoint
whose weights lie on int4's grid the Q4 records hold them exactly, so the two paths differ only
by the step's int8 activations. Then the engine against its bf16 self (the equality rule of the
bf16 tests), and where the step applies.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import assert_top5_rule, build_checkpoint, build_tokenizer, dequantize
from live_server import tiny_llm

from pypto_serving import native
from pypto_serving.config import EngineConfig
from pypto_serving.device import cpu_flags, cpu_isa, cpu_march
from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.engine.plan import plan_attention, plan_run
from pypto_serving.executor import native_decode
from pypto_serving.models.config import load_model_config
from pypto_serving.native import Matrix
from pypto_serving.ops.linear import (
    NATIVE_BF16,
    NATIVE_Q4,
    NATIVE_Q8,
    Linear,
    pack_q4,
    pack_q8,
)
from pypto_serving.sampling import SamplingParams

ELIGIBLE = ["llama-mha-untied", "qwen2-gqa2", "qwen3-hd32-gqa4"]
"""Tiny checkpoints the step takes (head_dim a multiple of 16): linear RoPE scaling and an
untied head, q/k/v biases, q/k norms and a tied head."""


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the step quantizes it: int8 per group of 32 with a scale of its largest / 127."""
    g = x.double().reshape(len(x), -1, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127
    return (torch.where(scale > 0, g / scale, 0).round() * scale).reshape(x.shape)


AVX2_BUILDS = {
    "avx2": (),
    "avx2-vnni": ("-mavxvnni",),
    "avx2-vnni-emulated": ("-DPYPTO_EMULATE_AVX_VNNI",),
}
"""The AVX2 builds (PYPTO_CPU_ISA=avx2: -march=x86-64-v3), and their extra flags: as an AVX2
CPU builds it, as one with AVX-VNNI does (the real vpdpbusd), and that path on AVX2
instructions (its vpdpbusd emulated exactly)."""


@pytest.fixture(
    scope="module", params=["vnni", "portable", "avx2", "avx2-vnni", "avx2-vnni-emulated"]
)
def products(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The product over records (records.h, exported by the shape-free library of gemm.cpp)
    with VNNI and BF16 dot products, without, and the AVX2 builds of AVX2_BUILDS: every
    x86-64-v3 machine tests "avx2" and "avx2-vnni-emulated"; "avx2-vnni" runs the real
    AVX-VNNI instruction where the CPU has it (AMX Xeons, Intel's AVX2 cores) and is skipped,
    saying so, elsewhere."""
    if request.param == "vnni" and "avx512_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-VNNI")  # the portable builds still run
    if request.param == "avx2-vnni" and "avx_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI: its path runs emulated (avx2-vnni-emulated)")
    flags = AVX2_BUILDS.get(request.param, ())
    if request.param == "portable":
        flags = ("-mno-avx512vnni", "-mno-avx512bf16")
    with pytest.MonkeyPatch.context() as mp:
        if request.param.startswith("avx2"):
            mp.setenv("PYPTO_CPU_ISA", "avx2")
        path = native.build_gemm(tmp_path_factory.mktemp("gemm"), extra_flags=flags)
    assert path is not None, "the kernels must build here (g++ is what Inductor uses too)"
    lib = native.load_gemm(path)
    assert lib is not None
    return lib


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the code")
@pytest.mark.parametrize("build", ["avx2-vnni", "avx2-vnni-emulated"])
def test_the_avx_vnni_build_holds_vpdpbusd_and_its_emulation_does_not(tmp_path, monkeypatch, build):
    """What the "avx2-vnni" products run where the CPU has AVX-VNNI is the instruction
    itself: its build holds vpdpbusd on ymm registers (VEX, no AVX-512), the emulated one
    none."""
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    path = native.build_gemm(tmp_path, extra_flags=AVX2_BUILDS[build])
    assert path is not None
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True
    ).stdout
    real = re.search(r"vpdpbusd\s+%ymm", code) is not None
    assert real == (build == "avx2-vnni"), build
    assert "%zmm" not in code


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_bf16_products_are_exact_over_the_bf16_operands(products, rows):
    torch.manual_seed(rows)
    n, k = 40, 96
    weight = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    x, out = torch.randn(rows, k), torch.empty(rows, n)
    w = Matrix(weight.data_ptr(), bias.data_ptr(), n, k, NATIVE_BF16)
    assert (
        products.pypto_packed_product(ctypes.byref(w), x.data_ptr(), rows, out.data_ptr(), 2) == 0
    )
    expected = x.bfloat16().double() @ weight.double().T + bias.double()
    assert relative_error(out, expected) < 1e-6


@pytest.mark.parametrize("fmt", [NATIVE_Q4, NATIVE_Q8])
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 9, 13, 18])  # 6, 13: a last block run whole,
# padded; 9, 18: the last rows joining the block before them (records.h's WIDE_ROWS)
def test_packed_products_are_the_quantized_products(products, fmt, rows):
    torch.manual_seed(rows)
    n, k = 40, 96  # a block of 16 rows cut short, three groups of inputs
    weight = torch.randn(n, k) * torch.rand(n, 1) * 3
    weight[:, :32] *= 50  # a loud group must not cost the others their precision
    bias = torch.randn(n).to(torch.bfloat16)
    records = (pack_q4 if fmt == NATIVE_Q4 else pack_q8)(weight)
    x = torch.randn(rows, k)
    out = torch.empty(rows, n)
    w = Matrix(records.data_ptr(), bias.data_ptr(), n, k, fmt)
    assert (
        products.pypto_packed_product(ctypes.byref(w), x.data_ptr(), rows, out.data_ptr(), 2) == 0
    )
    dequantized = dequantize(records, fmt, n, k)
    expected = quantized_rows(x) @ dequantized.T + bias.double()
    assert relative_error(out, expected) < 1e-5
    # and the formats are what they say: 4 bits cost ~10 % of a gaussian, 8 bits under 1 %
    exact = x.double() @ weight.double().T + bias.double()
    assert relative_error(out, exact) < (0.15 if fmt == NATIVE_Q4 else 0.01)
    assert relative_error(dequantized, weight) < (0.15 if fmt == NATIVE_Q4 else 0.01)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_activations_are_quantized_with_ties_to_even(products, rows):
    """Each group of 32 inputs becomes round(x * 127 / max |x|), halves to even (Q8_1), in
    every build: with a group's largest value 127 the int8 values are x rounded, read back
    through an identity weight in Q8 (one 127 a row: the products are 127 q times its
    scale, q recovered to well within a half)."""
    torch.manual_seed(rows)
    k = 96
    halves = torch.randint(-127, 127, (rows, k)) + 0.5  # every value a tie
    x = torch.where(torch.rand(rows, k) < 0.5, halves, torch.rand(rows, k) * 252 - 126)
    x[:, ::32] = 127.0  # each group's largest
    records = pack_q8(torch.eye(k))
    out = torch.empty(rows, k)
    w = Matrix(records.data_ptr(), None, k, k, NATIVE_Q8)
    assert (
        products.pypto_packed_product(ctypes.byref(w), x.data_ptr(), rows, out.data_ptr(), 2) == 0
    )
    assert torch.equal(out.round(), torch.round(x)), "ties go to the even neighbour"
    assert (out - out.round()).abs().max() < 0.05


@pytest.mark.parametrize("fmt", [NATIVE_Q4, NATIVE_Q8])
def test_avx2_and_avx512_give_the_same_packed_products(tmp_path, monkeypatch, fmt):
    """The integer sums are exact on both (vpmaddubsw/vpmaddwd, or VNNI) and the float steps
    the same: the two builds agree bit for bit, so a model's output does not depend on which
    CPU it ran on. The AVX-VNNI variant of the AVX2 build (Intel's AVX2 cores) is built too,
    and run where the CPU has it; built with its vpdpbusd emulated, its code runs anywhere."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU cannot run the AVX-512 build")
    wide = native.build_gemm(tmp_path / "wide")
    variants = [
        ((), "avx2"),
        (("-mavxvnni",), "avx_vnni"),
        (("-DPYPTO_EMULATE_AVX_VNNI",), "avx2"),  # AVX-VNNI's path, on AVX2 instructions
    ]
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    builds = [
        (native.build_gemm(tmp_path / f"v{i}", extra_flags=f), flag)
        for i, (f, flag) in enumerate(variants)
    ]
    monkeypatch.delenv("PYPTO_CPU_ISA")
    assert wide is not None and all(path is not None for path, _ in builds)
    torch.manual_seed(fmt)
    n, k, rows = 48, 128, 5
    weight = torch.randn(n, k) * torch.rand(n, 1) * 3
    records = (pack_q4 if fmt == NATIVE_Q4 else pack_q8)(weight)
    w = Matrix(records.data_ptr(), None, n, k, fmt)
    x = torch.randn(rows, k) * 4

    def product(path: Path) -> torch.Tensor:
        lib, out = native.load_gemm(path), torch.empty(rows, n)
        assert lib is not None
        assert lib.pypto_packed_product(ctypes.byref(w), x.data_ptr(), rows, out.data_ptr(), 2) == 0
        return out

    expected = product(wide)
    for path, flag in builds:
        assert path is not None
        if flag in cpu_flags() or flag == "avx2":
            assert torch.equal(product(path), expected), flag


def test_packing_keeps_values_on_the_int4_grid_exactly():
    step = 2.0**-6  # q * step - 8 * step: exact in bf16, fp16 and float32
    q = torch.randint(0, 16, (32, 64))
    q[:, ::32], q[:, 1::32] = 0, 15  # each group spans the grid
    weight = (q - 8) * step
    assert torch.equal(dequantize(pack_q4(weight), NATIVE_Q4, 32, 64), weight.double())


@pytest.mark.parametrize("fmt", [NATIVE_Q4, NATIVE_Q8, NATIVE_BF16])
def test_a_rows_product_is_the_same_bits_among_any_rows(products, fmt):
    """Any number of rows, BLOCK_ROWS at a time over each block of the weight: a row's result
    does not depend on how many rows came with it or where it stood among them (what
    --batch-invariant's quantized matmuls rest on, and speculative decoding's verify rows:
    a bf16 model's too, whose AVX2 build once summed a row in fewer chains among more rows)."""
    torch.manual_seed(fmt)
    n, k = 40, 96
    weight = torch.randn(n, k)
    if fmt == NATIVE_BF16:
        records = weight.bfloat16()
    else:
        records = (pack_q4 if fmt == NATIVE_Q4 else pack_q8)(weight)
    w = Matrix(records.data_ptr(), None, n, k, fmt)
    x = torch.randn(21, k) * 3

    def product(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.contiguous()
        out = torch.empty(len(rows), n)
        assert (
            products.pypto_packed_product(
                ctypes.byref(w), rows.data_ptr(), len(rows), out.data_ptr(), 2
            )
            == 0
        )
        return out

    together = product(x)
    for start, count in ((0, 1), (5, 1), (20, 1), (3, 7), (9, 12), (2, 9), (11, 10), (1, 17)):
        assert torch.equal(product(x[start : start + count]), together[start : start + count])
    assert torch.equal(product(x.flip(0)), together.flip(0))
    bad = Matrix(records.data_ptr(), None, n, k - 16, fmt)  # inputs not in groups of 32
    assert (
        products.pypto_packed_product(ctypes.byref(bad), x.data_ptr(), 3, together.data_ptr(), 1)
        == 1
    )


def test_the_step_takes_up_to_max_rows_and_says_its_widest_block(tmp_path):
    """MAX_ROWS rows a step; a last block of 10 rows in one pass with AVX512-VNNI (the drafts
    the scheduler adds fill it), of ROW_BLOCK without."""
    path = native.build(2, 16, tmp_path / "native")
    lib = None if path is None else native.load(path)
    assert lib is not None
    assert lib.pypto_native_max_rows() == native_decode.MAX_ROWS
    vnni = "avx512_vnni" in cpu_flags() and cpu_march() == ("-march=native",)
    assert lib.pypto_native_wide_rows() == (10 if vnni else native_decode.ROW_BLOCK)
    flags = ("-mno-avx512vnni", "-mno-avx512bf16")
    path = native.build(2, 16, tmp_path / "portable", extra_flags=flags)
    portable = None if path is None else native.load(path)
    assert portable is not None and portable.pypto_native_wide_rows() == native_decode.ROW_BLOCK


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """grid_model(name): a tiny checkpoint whose matrices (not the norms and biases) lie on
    the int4 grid of their groups of 32, each group spanning it: Q4 holds them exactly."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"grid-{name}")
            build_checkpoint(name, out, grid=True)
            build_tokenizer(out)
            made[name] = out
        return made[name]

    return get


def compare_paths(executor: Any) -> list[float]:
    """Make every step the native step takes run the graphs first, then the native step over
    the same KV (each writes the new token's K/V); returns each step's relative difference."""
    diffs: list[float] = []
    run, decoder = executor.run, executor.native

    def both(step: Any) -> torch.Tensor:
        if step.max_q > 1 or len(step.q_lens) > native_decode.MAX_ROWS:
            return run(step)
        executor.native = None
        graph = run(step)
        executor.native = decoder
        out = run(step)
        diffs.append(relative_error(out, graph))
        return out

    executor.run = both
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "kv_cache_dtype", "quantization"),
    [(n, "auto", "int4") for n in ELIGIBLE]
    + [("qwen3-hd32-gqa4", "int8", "int4"), ("qwen2-gqa2", "auto", None)]
    + [("qwen3-hd32-gqa4", "auto", "int8")],
)
def test_the_native_step_computes_what_the_graphs_do(
    grid_model, name, kv_cache_dtype, quantization
):
    """int4 (int8): the graphs multiply by the Q4 (Q8) records dequantized, the step by the
    records themselves with activations quantized per 32; unquantized, both by the bf16
    weights. Decodes of one to five sequences, a
    one-token prefill chunk among them."""
    knobs = {"dtype": "bfloat16", "quantization": quantization, "enforce_eager": False}
    with tiny_llm(grid_model(name), kv_cache_dtype=kv_cache_dtype, **knobs) as llm:
        executor = llm.engine.executor
        assert executor.native is not None
        diffs = compare_paths(executor)
        prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(2 + 9 * i)] for i in range(5)]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        # two decodes leave one token of a budget of three to a prompt: a step of one-token
        # rows of which one is a prefill chunk (computed, not sampled)
        llm.engine.scheduler.config.max_num_batched_tokens = 3
        llm.generate(prompts[2:5], params, use_tqdm=False)
    assert len(diffs) > 20
    assert max(diffs) < 0.03, diffs  # int8 activations, bf16 roundings; a wrong wire is ~1


@pytest.mark.slow
def test_long_contexts_attend_in_spans_as_the_graphs_do_alone_or_batched(grid_model, tmp_path):
    """A decode past 1,024 tokens attends in spans of its context (attention.cpp), the step
    sharing them among its team: the step against the graphs (whose decodes take the batch
    kernel's spans, held to float64 in test_native_attention.py) at 2,300 tokens, and the same
    bits alone, beside shorter ones (one span each) and after its prefix was cached."""
    model = tmp_path / "long"
    shutil.copytree(grid_model("qwen3-hd32-gqa4"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    knobs = {"dtype": "bfloat16", "quantization": "int4", "enforce_eager": False}
    long = [5] * 1_100 + [9] * 1_200  # values alike within a span: its weight shows
    short = [[(7 * i + 3 * j) % 300 + 3 for j in range(40 + 90 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    with tiny_llm(model, page_size=64, num_kv_pages=128, **knobs) as llm:
        executor = llm.engine.executor
        assert executor.native is not None
        diffs = compare_paths(executor)
        (alone,) = llm.generate([long], params, use_tqdm=False)
        batched = llm.generate([long, *short], params, use_tqdm=False)[0]
    assert len(diffs) >= 5 and max(diffs) < 0.03, diffs  # a span read wrong: 0.10
    assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
    assert alone.outputs[0].logprobs == batched.outputs[0].logprobs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "fmt"), [("int4", NATIVE_Q4), ("int4-w8a8", NATIVE_Q4), ("int8", NATIVE_Q8)]
)
def test_the_native_engine_follows_the_bf16_one(tiny_model, kind, fmt):
    """Greedy tokens where each side's token is in the other's top-5 (the rule of the bf16
    equality tests); the graphs, which the step spares int4, are one per layer kind."""
    name = "qwen3-hd32-gqa4"
    prompts = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    with tiny_llm(tiny_model(name), dtype="bfloat16") as plain:
        expected = plain.generate(prompts, params, use_tqdm=False)
    knobs = {"dtype": "bfloat16", "quantization": kind, "enforce_eager": False}
    with tiny_llm(tiny_model(name), **knobs) as quantized:
        executor = quantized.engine.executor
        calls = []
        logits = executor.native.logits
        executor.native.logits = lambda *a: calls.append(len(a[0])) or logits(*a)
        got = quantized.generate(prompts, params, use_tqdm=False)
        assert quantized.engine.stats().num_recompilations == 0
        assert 5 in calls and max(calls) <= native_decode.MAX_ROWS  # the five decode together
        assert set(map(tuple, executor.run_layer._row_bounds.values())) == {()}
        layer = quantized.engine.model.model.layers[0].mlp.down_proj
        assert layer.native is not None and layer.native[1] == fmt
        assert layer.quantized is None  # no PyTorch int4 (int8) beside it
        assert quantized.engine.model.lm_head.native[1] == NATIVE_Q8
    assert_top5_rule(expected, got)


def test_where_the_step_applies(tiny_model, monkeypatch):
    bf16, one = torch.bfloat16, ParallelGroups()
    qwen3, gqa8 = (load_model_config(tiny_model(n)) for n in ("qwen3-hd32-gqa4", "llama-gqa4-tied"))
    moe = load_model_config(tiny_model("qwen3moe-e4-top2"))
    applies = native_decode.applies
    assert applies(qwen3, "int4", bf16, one, 16)
    assert applies(qwen3, "int4-w8a8", bf16, one, 16)
    assert applies(qwen3, None, bf16, one, 16)  # bf16 weights, read in place
    assert not applies(qwen3, None, torch.float32, one, 16)
    assert not applies(qwen3, "w8a8", bf16, one, 16)  # batched throughput: the graphs
    assert not applies(qwen3, "int8", bf16, one, 16)  # int8 per output row: unread by the step
    assert applies(qwen3, "int8", bf16, one, 16, records_only=True)  # its Q8 records
    assert not applies(gqa8, "int4", bf16, one, 16)  # head_dim 8: no native attention
    assert not applies(moe, "int4", bf16, one, 16)
    tp2 = ParallelGroups(tp=Group(0, 2))  # TP with no shared-memory group (gloo): the graphs
    assert not applies(qwen3, None, bf16, tp2, 16)  # (with one: test_tensor_parallel.py)
    # the machine's part is the run plan's: the CPU and a compiler to build the step with
    config = EngineConfig(device="cpu", dtype="bfloat16", quantization="int4")
    assert plan_attention(plan_run(config), config, qwen3, one).native_decode
    monkeypatch.setenv("CXX", "no-such-compiler-here")  # int4 stays on PyTorch's kernel
    assert not plan_run(config).native_decode
    monkeypatch.delenv("CXX")


def test_linear_keeps_and_takes_back_its_native_form():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    layer.quantize("q4-w8a8")
    kept = layer.quantized_tensors()
    again = Linear(64, 48, bias=False).to(torch.bfloat16)
    again.load_quantized(kept)
    assert again.native is not None and again.native[1] == NATIVE_Q4
    assert torch.equal(again.native[0], layer.native[0]) and again.int8 is not None
    assert again.row_bounds == ()  # the graphs never branch on int4


@pytest.mark.slow
def test_int4_w8a8_decodes_every_row_in_the_native_step(tiny_model):
    """int4-w8a8's decodes, however many, run in the native step over its Q4 records (its
    int8 GEMM serves the prefill chunks): twelve sequences decode in one call, and each gets
    the tokens, and the logprobs to the bit, it gets alone (the step's rows do not meet; the
    int8 GEMM's decodes would differ in the last bits)."""
    name = "qwen3-hd32-gqa4"
    prompts = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    knobs = {"dtype": "bfloat16", "quantization": "int4-w8a8", "enforce_eager": False}
    with tiny_llm(tiny_model(name), **knobs) as llm:
        executor = llm.engine.executor
        assert executor.native_rows == native_decode.MAX_ROWS
        calls: list[int] = []
        logits = executor.native.logits
        executor.native.logits = lambda *a: calls.append(len(a[0])) or logits(*a)
        together = llm.generate(prompts, params, use_tqdm=False)
        assert 12 in calls
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].logprobs for o in together] == [o.outputs[0].logprobs for o in alone]


def test_a_draft_row_costs_what_the_builds_step_measured(monkeypatch):
    """The plan's weight of a speculative draft's row (`draft_row_cost`): the native step's
    products over records with AVX512-VNNI, on the AVX2 build, over bf16 weights."""
    vnni = cpu_isa() == "avx512" and "avx512_vnni" in cpu_flags()
    assert native_decode.draft_row_cost("gguf") == (0.08 if vnni else 0.25)
    assert native_decode.draft_row_cost(None) == 0.15
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    assert native_decode.draft_row_cost("int4") == 0.25
