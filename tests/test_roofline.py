"""bench/roofline.py (issue 47, item 2): what a model's token asks of the machine, counted from
the files as stored (a GGUF's matrices in their own types, an HF directory's bf16), a MoE's
used experts only (or in our quantized records); the fractions of the limits; the limits
measured and kept per machine."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import real_shapes
import roofline


def matrices(shape: real_shapes.Shape) -> tuple[int, int]:
    """(elements a token multiplies by, of which the embedding's), by hand."""
    used = shape.experts_used / shape.experts if shape.experts else 1.0
    elements = 0.0
    for name, dims in real_shapes.tensor_names(shape):
        if len(dims) == 2 and name != "model.embed_tokens.weight":
            elements += math.prod(dims) * (used if ".experts." in name else 1.0)
    return int(elements), real_shapes.VOCAB * shape.hidden


def test_a_token_reads_each_matrix_once_as_stored(tmp_path: Path) -> None:
    shape = real_shapes.SHAPES["qwen3-moe-tiny"]  # untied: the embedding's one row is read
    elements, _ = matrices(shape)
    f32 = roofline.demand(real_shapes.write_gguf(shape, "F32", tmp_path / "f32.gguf"))
    assert f32.weight_bytes == 4 * elements + 4 * shape.hidden
    assert f32.flops == 2 * elements
    hf = roofline.demand(real_shapes.write_hf(shape, tmp_path / "hf"))
    assert hf.weight_bytes == 2 * elements + 2 * shape.hidden and hf.flops == 2 * elements
    q4 = roofline.demand(real_shapes.write_gguf(shape, "Q4_1", tmp_path / "q4.gguf"))
    assert q4.flops == f32.flops
    experts = 2 * shape.layers * 3 * shape.expert_ffn * shape.hidden * shape.experts_used
    assert q4.expert_flops == f32.expert_flops == hf.expert_flops == experts  # the used ones
    router = shape.layers * shape.experts * shape.hidden * 4  # kept in F32
    assert q4.weight_bytes == pytest.approx(
        (elements - router / 4) * 20 / 32 + router + shape.hidden * 34 / 32
    )  # Q4_1: 20 bytes a block of 32; the Q8_0 embedding's row
    kv = shape.layers * shape.kv_heads * shape.dim * 2 * 2
    assert q4.kv_bytes_per_token == hf.kv_bytes_per_token == kv


def test_our_quantized_forms_are_read_in_their_records(tmp_path: Path) -> None:
    """An HF directory served with --quantization int4-w8a8 or int8: the layers' matrices are
    read in the native step's Q4 records (320 bytes per 16 rows x 32 inputs) or Q8 (544), the
    LM head in Q8 either way, the embedding's one row as stored."""
    shape = real_shapes.SHAPES["llama-tiny"]  # untied: its head is among the matrices
    elements, embedding = matrices(shape)
    hf = real_shapes.write_hf(shape, tmp_path / "hf")
    layers, row = elements - embedding, 2 * shape.hidden  # the head holds the vocabulary
    int4 = roofline.demand(hf, "int4-w8a8")
    assert int4.weight_bytes == pytest.approx(layers * 320 / 512 + embedding * 544 / 512 + row)
    int8 = roofline.demand(hf, "int8")
    assert int8.weight_bytes == pytest.approx(elements * 544 / 512 + row)
    assert int4.flops == int8.flops == roofline.demand(hf).flops == 2 * elements


def test_the_command_reads_a_directory_in_our_quantized_forms(tmp_path, monkeypatch, capsys):
    """`--quantization int4` counts an HF directory's weights as our records hold them."""
    shape = real_shapes.SHAPES["llama-tiny"]
    hf = real_shapes.write_hf(shape, tmp_path / "hf")
    fixed = roofline.Limits("cpu", "avx2", 2, 10.0, 100.0, 50.0, None)
    monkeypatch.setattr(roofline, "limits", lambda threads, fresh: fixed)
    stored, int4 = roofline.demand(hf), roofline.demand(hf, "int4")
    for quantization, need in ((None, stored), ("int4", int4)):
        argv = ["--model", str(hf), "--decode-tok-s", "10"]
        assert roofline.main(argv + (["--quantization", quantization] if quantization else [])) == 0
        printed = capsys.readouterr().out
        assert f"{need.weight_bytes / 1e6:.1f} MB of weights a decoded token" in printed
        share = 10 * need.weight_bytes / 1e9 / fixed.read_gb_s
        assert f"decode 10.0 tok/s: {share:.0%} of the read bandwidth" in printed
    assert int4.weight_bytes < stored.weight_bytes


def test_the_fractions_of_the_limits() -> None:
    need = roofline.Demand(1e9, 1e5, 2e9, 0.0, 1e3)
    machine = roofline.Limits("cpu", "avx2", 2, 50.0, 400.0, 200.0, None)
    assert roofline.decode_fraction(25.0, need, machine) == pytest.approx(0.5)
    assert roofline.decode_fraction(25.0, need, machine, context=10_000) == pytest.approx(1.0)
    flops = 100 * 2e9 + 1e3 * 100 * 101 / 2
    assert roofline.prefill_fraction(100, flops / 200e9, need, 400.0) == pytest.approx(0.5)
    moe = roofline.Demand(1e9, 1e5, 2e9, 1.5e9, 1e3)  # three quarters in int8 at twice
    assert roofline.mixed_peak(moe, 400.0, 800.0) == pytest.approx(
        2e9 / (0.5e9 / 400 + 1.5e9 / 800)
    )
    later = roofline.Limits("cpu", "avx2", 2, 30.0, 420.0, 190.0, 700.0)
    assert roofline.best(machine, later) == roofline.Limits(
        "cpu", "avx2", 2, 50.0, 420.0, 200.0, 700.0
    )


def test_the_limits_are_measured_once_per_machine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    real = roofline.measure_limits
    monkeypatch.setattr(roofline, "measure_limits", lambda t: real(t, size_mib=16, gemm=256))
    first = roofline.limits(1)
    assert first.read_gb_s > 0 and first.bf16_gflop_s > 0 and first.fp32_gflop_s > 0
    assert first.isa == roofline.cpu_name_and_isa()[1]
    monkeypatch.setattr(roofline, "measure_limits", lambda t: pytest.fail("measured again"))
    assert roofline.limits(1) == first
    assert (tmp_path / roofline.LIMITS_FILE).is_file()
