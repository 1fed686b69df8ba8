"""The panel GEMM (native/gemm.cpp): matmuls of many rows over bf16 weights in float32, where
oneDNN cannot pack bf16 (AVX2 CPUs).

Held to the float64 product of the same bf16 operands, in each build an x86 machine can make
(AVX-512 where the CPU runs it, AVX2 as x86-64-v3, and x86-64-v2), across the tiles' edges
(rows around 6, 12 and 96; inputs around 256; columns not a multiple of 16). And each row's
result is the same bits whatever rows share its call: the batch does not change a token.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from pypto_serving import native
from pypto_serving.device import cpu_flags, cpu_packs_bf16
from pypto_serving.ops.linear import (
    QUANTIZED_MAX_ROWS,
    Linear,
    dequantizing_matmul,
    pack_panels,
    packed_linear,
    panel_linear,
)

SHAPES = [(1, 64, 40), (5, 300, 33), (13, 576, 960), (97, 520, 48), (200, 96, 16)]
"""(rows, inputs, outputs)."""


@pytest.fixture(scope="module", params=["native", "avx2", "default"])
def gemm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "native" and not {"avx512f", "avx512bw"} <= cpu_flags():
        pytest.skip("the native build is the AVX2 one here")  # which runs below
    with pytest.MonkeyPatch.context() as mp:
        if request.param != "native":
            mp.setenv("PYPTO_CPU_ISA", request.param)
        path = native.build_gemm(tmp_path_factory.mktemp("gemm"))
    assert path is not None, "the GEMM must build here (g++ is what Inductor uses too)"
    lib = native.load_gemm(path)
    assert lib is not None
    return lib


def run(lib: Any, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int):
    rows, cols = x.shape
    width = panels.shape[0] * 16
    out = torch.full((rows, width), float("nan"))
    bias_ptr = None if bias is None else bias.data_ptr()
    args = (x.data_ptr(), cols, panels.data_ptr(), bias_ptr, out.data_ptr(), width)
    assert lib.pypto_panel_gemm(*args, rows, n, cols, 2) == 0
    return out[:, :n]


@pytest.mark.parametrize(("rows", "cols", "n"), SHAPES)
def test_products_are_exact_over_the_bf16_operands(gemm, rows, cols, n):
    torch.manual_seed(rows)
    weight, bias = torch.randn(n, cols).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(rows, cols)
    out = run(gemm, x, pack_panels(weight), bias, n)
    expected = x.double() @ weight.double().T + bias.double()
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-6
    no_bias = run(gemm, x, pack_panels(weight), None, n)
    assert torch.allclose(no_bias + bias.float(), out, atol=1e-5)


def test_a_row_gets_the_same_bits_in_any_batch(gemm):
    torch.manual_seed(7)
    cols, n = 600, 80
    panels = pack_panels(torch.randn(n, cols).bfloat16())
    x = torch.randn(130, cols)
    whole = run(gemm, x, panels, None, n)
    for start, size in ((0, 1), (3, 1), (5, 7), (11, 96), (40, 90), (129, 1)):
        part = run(gemm, x[start : start + size].contiguous(), panels, None, n)
        assert torch.equal(part, whole[start : start + size])


def test_panels_hold_the_weight(tmp_path: Path):
    weight = torch.randn(40, 24).bfloat16()
    panels = pack_panels(weight)
    assert panels.shape == (3, 24, 16) and panels.dtype == torch.bfloat16
    assert torch.equal(panels.transpose(1, 2).reshape(48, 24)[:40], weight)
    assert not panels.transpose(1, 2).reshape(48, 24)[40:].any()


@pytest.mark.parametrize("form", ["panels", "onednn"])
def test_a_packed_linear_runs_its_form_inside_compiled_graphs_too(form):
    """The form is the layer's, not read off the tensor: a oneDNN tensor's fake (what
    torch.compile traces with) does not say it is one, and a graph once called the panel GEMM
    on oneDNN's weights."""
    if form == "onednn" and not cpu_packs_bf16():
        pytest.skip("oneDNN packs bf16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
    if form == "panels" and native.gemm_library() is None:
        pytest.fail("the GEMM must build here")
    torch.manual_seed(3)
    layer = Linear(96, 40, bias=True).to(torch.bfloat16).requires_grad_(False)
    layer.pack(form)
    assert layer.packed is not None and layer.packed.is_mkldnn == (form == "onednn")
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    if form == "panels":
        expected = panel_linear(x, layer.packed, layer.bias, 40)
    else:
        expected = packed_linear(x, layer.packed, layer.bias, 40)
    assert expected.dtype == torch.bfloat16 and torch.equal(layer(x), expected)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), expected)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_layers_take_the_panels_for_prefill_sized_matmuls(kind):
    """Where oneDNN does not pack bf16, panels are the dense form a quantized layer keeps for
    matmuls past QUANTIZED_MAX_ROWS rows (the dequantizing kernels win only while
    memory-bound)."""
    torch.manual_seed(2)
    layer = Linear(128, 64, bias=False).to(torch.bfloat16)
    layer.pack("panels")
    layer.quantize(kind)
    assert layer.packed is not None and layer.quantized is not None
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        out = layer(x)
        if rows > QUANTIZED_MAX_ROWS:
            assert torch.equal(out, panel_linear(x, layer.packed, None, 64))
        else:
            assert torch.equal(out, dequantizing_matmul(x, *layer.quantized))


def test_the_gemm_refuses_what_it_does_not_take(gemm):
    panels = pack_panels(torch.randn(20, 32).bfloat16())
    x, out = torch.randn(2, 32), torch.empty(2, 32)
    assert (
        gemm.pypto_panel_gemm(
            x.data_ptr(), 32, panels.data_ptr(), None, out.data_ptr(), 16, 2, 20, 32, 1
        )
        == 1
    )  # rows of 16: too narrow for 2 panels
    assert (
        ctypes.c_int(
            gemm.pypto_panel_gemm(
                x.data_ptr(), 32, panels.data_ptr(), None, out.data_ptr(), 32, 0, 20, 32, 1
            )
        ).value
        == 1
    )
