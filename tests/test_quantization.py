"""Quantization: weight-only (int8 per row, int4 per group of 32) and w8a8 (int8 weights and
smoothed per-token int8 activations). The kernels against a dequantized reference, the
calibration's factors against their definition, the engine against its bf16 self, and the
errors."""

from __future__ import annotations

import pytest
import torch
from checkpoints import assert_top5_rule
from live_server import tiny_llm

from pypto_serving.device import cpu_packs_bf16, int8_gemm_full_range
from pypto_serving.errors import PyptoError
from pypto_serving.ops.linear import (
    INT4_GROUP,
    NATIVE_Q4,
    NATIVE_Q8,
    QUANTIZED_MAX_ROWS,
    Linear,
    dequantizing_matmul,
    int8_linear,
    pack_linears,
    quantize_int4,
    quantize_int8,
    quantize_w8a8,
    quantize_w8a8_rows,
    quantized_linear,
)
from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear_matches_its_dequantized_weight(kind):
    torch.manual_seed(0)
    layer = Linear(128, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 128, dtype=torch.bfloat16)  # decode-sized: the quantized kernel
    exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    layer.quantize(kind)
    out = layer(x)
    assert out.shape == (5, 96) and out.dtype == torch.bfloat16
    # the quantization error is what the bits allow: int8 well under 1 %, int4 under 10 %
    assert relative_error(out, exact) < (0.01 if kind == "int8" else 0.1)
    if kind == "int8":  # and the kernel computes exactly x @ dequantized.T (+ bias)
        q, scales = quantize_int8(layer.weight.detach())
        reference = x.float() @ dequantize_int8(q, scales).T + layer.bias.float()
        assert relative_error(out, reference) < 0.01


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prefill_sized_matmuls_use_the_packed_bf16_weight(kind):
    if not cpu_packs_bf16():  # its counterpart runs: the test after this one
        pytest.skip("oneDNN packs bf16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
    torch.manual_seed(2)
    layer = Linear(128, 64, bias=False).to(torch.bfloat16)
    layer.pack()
    layer.quantize(kind)
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        dense = torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [None], "")
        out = layer(x)
        if rows > QUANTIZED_MAX_ROWS:
            assert torch.equal(out, dense)  # the bf16 GEMM, bit for bit
        else:
            assert not torch.equal(out, dense) and relative_error(out, dense) < 0.1
        # one row skips the custom op (decode of one) and computes what the op computes
        op = quantized_linear(x, *layer.quantized, layer.out_features, layer.packed)
        assert torch.equal(out, op)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_without_a_packed_weight_every_matmul_is_the_quantized_kernel(kind, monkeypatch):
    """Where oneDNN does not pack bf16 (AVX2 CPUs: `cpu_packs_bf16`), `pack_linears` packs
    nothing (the run plan never asks oneDNN there), and prefill-sized matmuls run the
    quantized kernel too."""
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    torch.manual_seed(2)
    model = torch.nn.Sequential(Linear(128, 64, bias=False)).to(torch.bfloat16)
    assert pack_linears(model, kind) == 1
    layer = model[0]
    assert layer.packed is None and layer.quantized is not None
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        assert torch.equal(layer(x), dequantizing_matmul(x, *layer.quantized))


def test_int4_w8a8_decodes_a_few_rows_in_int4_and_multiplies_more_in_int8():
    torch.manual_seed(4)
    layer = Linear(128, 64, bias=True).to(torch.bfloat16)
    smooth = torch.rand(128) + 0.5
    layer.quantize("int4-w8a8", smooth)
    assert layer.packed is None and layer.row_bounds == (1, QUANTIZED_MAX_ROWS)
    for rows in (1, 2, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, *layer.quantized[:1], INT4_GROUP, layer.quantized[1]
        )
        int8 = int8_linear(x, *layer.int8)
        want = int4 if rows <= QUANTIZED_MAX_ROWS else int8
        assert torch.equal(layer(x), want + layer.bias)
        assert not torch.equal(int4, int8)


@pytest.mark.parametrize(("kind", "graphs"), [("w8a8", 1), ("int4-w8a8", 2)])
def test_only_int4_w8a8_traces_a_graph_per_side_of_eight_rows(kind, graphs):
    """A trace-time branch on the row count guards the graph on it: int4-w8a8 needs one graph
    for up to 8 rows and one for more; a w8a8 layer, whose code is the same for any count,
    must stay one graph (a second would be compiled, and cached, for nothing)."""
    torch.manual_seed(5)
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    layer.quantize(kind)
    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(layer.forward, backend=backend, dynamic=True)
    for rows in (5, 9, 40, 3):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(run(x), layer(x))
    assert len(traced) == graphs


def test_int8_linear_is_the_integer_product_of_the_quantized_rows():
    torch.manual_seed(3)
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    weight = torch.randn(96, 128)
    q, scales, row_sums, low = quantize_w8a8(weight)  # row sums only where inputs get 7 bits
    assert q.abs().max() == 127 and (row_sums is None) == int8_gemm_full_range() and low is None
    out = int8_linear(x, q, scales)  # full-range inputs (exact with int8 dot products)
    if int8_gemm_full_range():
        assert out.shape == (7, 96) and out.dtype == torch.bfloat16
        # each row quantized by its own largest magnitude; int32 products; then both scales
        row_scale = x.float().abs().amax(1, keepdim=True) / 127
        xq = torch.round(x.float() / row_scale)
        assert xq.abs().max() <= 127
        expected = (xq.double() @ q.double().T) * row_scale.double() * scales.double()
        assert relative_error(out, expected) < 4e-3  # bf16 rounding of the output only
        assert relative_error(out, x.float() @ weight.T) < 0.02  # both quantizations together


def test_seven_bit_inputs_are_exact_on_every_int8_gemm():
    """The form for GEMMs that sum u8 x s8 pairs in int16 (AVX2), run on any CPU: each row
    mapped from its smallest to its largest value onto [0, 127]; its products with 8-bit
    weights are exact integers (no pair leaves int16), whatever the row, extreme ones too."""
    torch.manual_seed(5)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    x[0], x[1] = 3.0, torch.where(torch.arange(256) % 2 == 0, -2.0, 5.0)  # flat; extremes only
    weight = torch.randn(48, 256)
    weight[:, :8] = torch.where(torch.arange(48)[:, None] % 2 == 0, 1.0, -1.0)  # w = +-127
    q, scales = quantize_int8(weight)
    row_sums = q.sum(1, dtype=torch.int32)
    assert q.abs().max() == 127
    out = int8_linear(x, q, scales.float(), row_sums)
    xf = x.float()
    lo = xf.amin(1, keepdim=True)
    scale = (xf.amax(1, keepdim=True) - lo).clamp(min=1e-12) / 127
    u = torch.round((xf - lo) / scale)
    assert u.min() >= 0 and u.max() <= 127
    expected = ((u.double() * scale.double() + lo.double()) @ q.double().T) * scales.double()
    assert relative_error(out, expected) < 4e-3  # the output's bf16 rounding only
    assert torch.allclose(out[0].float(), (3.0 * q.float().sum(1) * scales).bfloat16().float())
    assert relative_error(out, x.float() @ weight.T) < 0.02


def test_each_layer_gets_seven_bits_where_they_cost_it_less(monkeypatch):
    """Where the int8 GEMM sums pairs of products in int16 (AVX2; forced here, where both
    forms are exact on any CPU), a layer whose inputs sit on 128 evenly spaced values far from
    0 keeps 7-bit inputs (exact there); one whose inputs are 255 symmetric levels and whose
    weights are whole numbers up to 64 takes 7-bit weights (exact there)."""
    from pypto_serving.models import calibration
    from pypto_serving.ops import linear

    monkeypatch.setattr(linear, "int8_gemm_full_range", lambda: False)
    torch.manual_seed(6)
    offset, symmetric = Linear(64, 32, bias=False), Linear(64, 32, bias=False)
    with torch.no_grad():
        offset.weight.copy_(torch.randint(-127, 128, (32, 64)).float())
        offset.weight[:, 0] = 127
        symmetric.weight.copy_(torch.randint(-64, 65, (32, 64)).float())
        symmetric.weight[:, 0] = 64
    levels = torch.randint(0, 128, (40, 64)).float()
    levels[:, :2] = torch.tensor([0.0, 127.0])
    inputs = {offset: 10 + 0.01 * levels}
    signed = torch.randint(-127, 128, (40, 64)).float()
    signed[:, :2] = torch.tensor([-127.0, 127.0])
    inputs[symmetric] = 0.03 * signed
    for layer in inputs:
        layer.quantize("w8a8")
        assert layer.int8 is not None and layer.int8.row_sums is not None  # 7-bit inputs first
    model = torch.nn.ModuleList(inputs)

    def run_text(_model: object, _tokens: list[int]) -> None:
        for layer, x in inputs.items():
            layer(x)

    monkeypatch.setattr(calibration, "_run_text", run_text)
    assert calibration.choose_w8a8_inputs(model, []) == 1  # type: ignore[arg-type]
    assert offset.int8 is not None and symmetric.int8 is not None
    assert offset.int8.row_sums is not None and offset.int8.weight.abs().max() == 127
    assert symmetric.int8.row_sums is None and symmetric.int8.weight.abs().max() == 64
    for layer, x in inputs.items():  # each exact in the form it got (float32 rounding only)
        assert relative_error(layer(x), x @ layer.weight.T) < 1e-6


def test_smoothing_keeps_a_token_with_loud_channels_precise():
    """A few loud input channels cost a token its quiet ones; divided by the smoothing
    factors (and the weight's columns multiplied), the product is the same and precise."""
    torch.manual_seed(4)
    x = torch.randn(16, 256)
    x[:, :4] *= 60  # outlier channels, the same for every token, as in LLMs
    weight = torch.randn(64, 256) * 0.05
    exact = x @ weight.T
    plain = int8_linear(x.bfloat16(), *quantize_w8a8(weight))
    s = (x.abs().amax(0) ** 0.5 / weight.abs().amax(0) ** 0.5).clamp(min=1e-5)
    smoothed = int8_linear(x.bfloat16(), *quantize_w8a8(weight * s), s)
    assert relative_error(smoothed, exact) < 0.5 * relative_error(plain, exact)
    assert relative_error(smoothed, exact) < 0.02


def test_calibrated_factors_meet_activations_and_weights_halfway(tiny_model):
    """alpha 0.5: after smoothing, each input channel's largest activation equals its
    largest weight, for every linear layer, from a forward over the calibration text."""
    from pypto_serving.models.calibration import (
        activation_maxima,
        calibration_tokens,
        smoothing_factors,
    )
    from pypto_serving.models.loader import load_model, load_tokenizer

    path = tiny_model(MODEL)
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    tokens = calibration_tokens(load_tokenizer(path))
    assert len(tokens) > 1000  # the text runs as several chunks
    maxima = activation_maxima(model, tokens)
    factors = smoothing_factors(model, tokens)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert set(factors) == set(maxima) == set(layers)  # the LM head included
    for layer in layers:
        act, s = maxima[layer], factors[layer]
        weight = layer.weight.detach().float().abs().amax(0)
        assert act.shape == s.shape == (layer.in_features,) and (act > 0).all()
        torch.testing.assert_close(act / s, weight * s, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("native", [False, True], ids=["pytorch-int4", "native-q4"])
@pytest.mark.parametrize("kind", ["int4", "int4-w8a8", "w8a8"])
def test_quantized_weights_are_kept_and_read_back_on_the_next_load(
    tiny_model, tmp_path, monkeypatch, kind, native
):
    """The first load quantizes (and calibrates, for w8a8) and keeps the result under the
    cache directory; the next one reads it back (no calibration, no quantizing) with every
    quantized tensor identical (PyTorch's int4, or the native step's records). A damaged file
    is made again."""
    from pypto_serving.models import calibration, loader
    from pypto_serving.ops import linear

    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    path, cpu = tiny_model(MODEL), torch.device("cpu")
    first = loader.load_model(path, torch.bfloat16, cpu, None, kind, native)
    (kept,) = (tmp_path / "quantized").glob("*.safetensors")
    runs = []
    for module, name in ((calibration, "smoothing_factors"), (linear.Linear, "quantize")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, **k: runs.append(1) or real(*a, **k)
        )
    again = loader.load_model(path, torch.bfloat16, cpu, None, kind, native)
    assert runs == []  # read back
    assert (again.lm_head.native is not None) == (native and kind != "w8a8")  # (int4's Q8)
    pairs = [(a, b) for a, b in zip(first.modules(), again.modules(), strict=True)]
    linears = [(a, b) for a, b in pairs if isinstance(a, Linear)]
    for a, b in linears:
        ta, tb = a.quantized_tensors(), b.quantized_tensors()
        assert ta.keys() == tb.keys() and ta
        assert all(torch.equal(ta[k], tb[k]) for k in ta)
        assert (a.quantized is None or a.quantized[2] == b.quantized[2]) and (a.packed is None) == (
            b.packed is None
        )
    # an int8 form (and records, or int4) serves every matmul: no bf16 weight is kept; the
    # native step reads a plain w8a8 layer's bf16 weight (it has no records)
    if kind == "int4-w8a8" or (kind == "w8a8" and not native):
        for model in (first, again):
            both = [m for m in model.modules() if isinstance(m, Linear) and m.int8 is not None]
            assert len(both) == len(linears) and all(m.weight is None for m in both)
            assert model.model.embed_tokens.weight is not None  # the lookup's, not the head's
    elif kind == "w8a8":
        assert all(m.weight is not None for _, m in linears)
    kept.write_bytes(b"not a safetensors file")
    loader.load_model(path, torch.bfloat16, cpu, None, kind, native)
    assert len(runs) >= len(linears) and kept.stat().st_size > 100  # made again, rewritten


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("seven", [False, True])
def test_w8a8_quantized_in_blocks_of_rows_is_the_whole_weights_bits(monkeypatch, split, seven):
    """A large weight (an LM head) is quantized PACK_ROWS rows at a time, with no float32 copy
    of it whole: every part the same bits as the whole weight's, split (8 bits in two GEMMs)
    or with 7-bit inputs (the row sums) too."""
    from pypto_serving.ops import linear

    monkeypatch.setattr(linear, "int8_gemm_full_range", lambda: not (split or seven))
    torch.manual_seed(3)
    weight = torch.randn(5000, 64, dtype=torch.bfloat16)
    smooth = torch.rand(64) + 0.5
    whole = quantize_w8a8(weight.float() * smooth, split=split)
    rows = quantize_w8a8_rows(weight, smooth, split)
    assert linear.PACK_ROWS < 5000
    for a, b in zip(whole, rows, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert (whole[3] is not None) == split and (whole[2] is not None) == (seven and not split)


def test_int4_groups_keep_each_group_in_range():
    torch.manual_seed(1)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    weight[:, :INT4_GROUP] *= 100  # one loud group must not cost the others their precision
    packed, scales = quantize_int4(weight)
    assert scales.shape == (128 // INT4_GROUP, 64, 2)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, INT4_GROUP:] = 1  # only the quiet groups
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales)
    exact = weight[:, INT4_GROUP:].float().sum(1)
    assert relative_error(out[0], exact) < 0.1


@pytest.mark.parametrize("kind", ["int8", "int4", "w8a8", "int4-w8a8"])
def test_the_quantized_engine_follows_the_bf16_one(tiny_model, kind):
    """Greedy tokens where each side's token is in the other's top-5 (the rule of the bf16
    equality tests), compiled and with 0 recompilations after warm-up."""
    prompts = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    with tiny_llm(tiny_model(MODEL), dtype="bfloat16") as plain:
        expected = plain.generate(prompts, params, use_tqdm=False)
    knobs = {"dtype": "bfloat16", "quantization": kind, "enforce_eager": False}
    with tiny_llm(tiny_model(MODEL), **knobs) as quantized:
        got = quantized.generate(prompts, params, use_tqdm=False)
        assert quantized.engine.stats().num_recompilations == 0
        layer = quantized.engine.model.model.layers[0].mlp.down_proj
        head = quantized.engine.model.lm_head
        if kind == "w8a8":  # int8 weights, smoothed, and no bf16 weight packed beside them
            assert layer.int8 is not None and layer.int8.smooth is not None
            assert layer.packed is None and layer.quantized is None
        elif kind == "int4-w8a8":  # both forms, the head w8a8 only; no bf16 weight packed
            assert layer.int8.smooth is not None and layer.quantized[2] == 32
            assert head.int8 is not None and head.quantized is None
            assert layer.packed is None and head.packed is None
        else:  # int4's (int8's) records alone serve every matmul: no bf16 weight kept
            assert quantized.engine.plan.records_only
            fmt = NATIVE_Q4 if kind == "int4" else NATIVE_Q8
            assert layer.native is not None and layer.native[1] == fmt
            assert head.native is not None and head.native[1] == NATIVE_Q8
            assert layer.weight is None and layer.quantized is None and layer.packed is None
        # a graph per class of step: one token, and (int4-w8a8) 2 to 8 apart from more; int4's
        # and int8's records multiply up to 8 rows themselves where the graphs run the decodes
        # (this model's: no native step), more dequantized; warm-up compiled each (0
        # recompilations)
        assert not quantized.engine.attention.native_decode
        bounds = {
            "int8": [QUANTIZED_MAX_ROWS],
            "int4": [QUANTIZED_MAX_ROWS],
            "w8a8": [],
            "int4-w8a8": [1, QUANTIZED_MAX_ROWS],
        }
        assert set(map(tuple, quantized.engine.executor.run_layer._row_bounds.values())) == {
            tuple(bounds[kind])
        }
    assert_top5_rule(expected, got)


def test_quantization_errors(tiny_model):
    with pytest.raises(PyptoError, match="quantization must be one of"):
        tiny_llm(tiny_model(MODEL), quantization="int3")
    with pytest.raises(PyptoError, match="runs on CPU with dtype bfloat16; this engine has cpu"):
        tiny_llm(tiny_model(MODEL), quantization="int4", dtype="float32")


def test_int8_refuses_input_sizes_its_kernel_cannot_read():
    """torch's int8 kernel crashed the process (SIGSEGV) on AVX-512 CPUs for input sizes not a
    multiple of 16 (a DeepSeek q_lora_rank of 24 met it): a clear error instead, on every CPU."""
    layer = Linear(24, 96, bias=False).to(torch.bfloat16)
    with pytest.raises(PyptoError, match="int8 quantization needs input sizes divisible by 16"):
        layer.quantize("int8")
    Linear(32, 96, bias=False).to(torch.bfloat16).quantize("int8")


def test_int4_refuses_output_sizes_its_packing_cannot_take():
    """int4's packing raised a bare RuntimeError (a traceback) for output sizes not a multiple
    of 16 (a DeepSeek latent projection of 32 + 8 rows met it): a clear error instead."""
    layer = Linear(64, 40, bias=False).to(torch.bfloat16)
    with pytest.raises(PyptoError, match="int4 quantization needs output sizes divisible by 16"):
        layer.quantize("int4")
    Linear(64, 48, bias=False).to(torch.bfloat16).quantize("int4")


def test_a_split_weight_multiplies_full_range_inputs_and_weights_exactly(monkeypatch):
    """The form of the head, queries and keys on a GEMM that sums pairs of products in int16
    (AVX2), run on any CPU: the 8-bit weight split in halves the int16 sums hold (2 x high +
    low, high in [-64, 63], low 0 or 1), each multiplied by the full-range inputs apart; the
    sum is the product of the whole weight, as a GEMM with int8 dot products computes it."""
    from pypto_serving.ops import linear

    monkeypatch.setattr(linear, "int8_gemm_full_range", lambda: False)
    torch.manual_seed(8)
    x = torch.randn(11, 128, dtype=torch.bfloat16)
    weight = torch.randn(48, 128)
    weight[:, :4] = torch.where(torch.arange(48)[:, None] % 2 == 0, 9.0, -9.0)  # w = +-127
    high, scales, row_sums, low = quantize_w8a8(weight, split=True)
    assert row_sums is None and low is not None
    assert high.min() == -64 and high.max() <= 63 and set(low.unique().tolist()) == {0, 1}
    whole, whole_scales = quantize_int8(weight)
    assert torch.equal(2 * high + low, whole) and torch.equal(scales, whole_scales.float())
    row_scale = x.float().abs().amax(1, keepdim=True) / 127
    xq = torch.round(x.float() / row_scale)
    expected = (xq.double() @ whole.double().T) * row_scale.double() * scales.double()
    out = int8_linear(x, high, scales, None, low)
    assert relative_error(out, expected) < 4e-3  # the output's bf16 rounding only
    layer = Linear(128, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.exact_int8 = True
    layer.quantize("w8a8")
    assert layer.int8 is not None and torch.equal(layer.int8.low, low)
    saved = layer.quantized_tensors()
    assert set(saved) == {"int8.weight", "int8.scale", "int8.low"}
    again = Linear(128, 48, bias=False)
    again.load_quantized(saved)
    assert torch.equal(again(x), layer(x))
