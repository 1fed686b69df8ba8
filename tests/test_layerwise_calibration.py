"""w8a8's calibration layer by layer as the checkpoint is read (models/calibration.py's
`LayerwiseCalibration`, models/loader.py's `iter_checkpoint_by_layer`).

w8a8 and int4-w8a8 take their smoothing factors from running the model over a text, which
held the whole checkpoint in bf16 at a first load (16 GB at 8B, beside the int8 forms). The
checkpoint is now read layer by layer, in layer order whatever order its files keep (here:
two shards, layer 1's in the first); each layer runs over the text's chunks as soon as its
weights are in, is quantized and drops its bf16 weights. The factors, and so every layer's
quantized forms, are the same bits as the whole model's calibration gives (also where an
int16-pair int8 GEMM has each layer choose 7-bit inputs or weights); a later load takes the
kept forms and drops each bf16 weight as it is filled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving import LLM, SamplingParams
from pypto_serving.device import int8_gemm_full_range
from pypto_serving.models import calibration, loader, quantized_cache
from pypto_serving.ops import linear
from pypto_serving.ops.linear import Linear

MODEL = "llama-mha-untied"  # two layers, an untied head
PROMPTS = [[5, 9, 40, 41, 7], [3, 8, 100, 2, 77, 31, 64]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(params=["dot-products", "int16-pairs"])
def int8_gemm(request, monkeypatch) -> str:
    """The int8 GEMM w8a8 is quantized for: full-range int8 dot products (VNNI), or AVX2's
    pairs summed in int16, where each layer also chooses 7-bit inputs or 7-bit weights
    (`choose_w8a8_inputs`). The latter's decisions are taken on any CPU (the products
    themselves are exact either way: 7 bits fit both)."""
    if request.param == "int16-pairs":
        for module in (linear, loader, quantized_cache):
            monkeypatch.setattr(module, "int8_gemm_full_range", lambda: False)
    elif not int8_gemm_full_range():
        pytest.skip("this CPU's int8 GEMM sums pairs in int16: only that path runs here")
    return request.param


@pytest.fixture
def sharded(tiny_model, tmp_path: Path) -> Path:
    """The tiny checkpoint in two shards: the first holds layer 1 and the head, the second
    the embedding, layer 0 and the final norm."""
    source = tiny_model(MODEL)
    out = tmp_path / "sharded"
    out.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(source / "model.safetensors")
    first = {n: t for n, t in weights.items() if n.startswith(("model.layers.1.", "lm_head"))}
    second = {n: t for n, t in weights.items() if n not in first}
    save_file(first, out / "model-00001-of-00002.safetensors")
    save_file(second, out / "model-00002-of-00002.safetensors")
    index = {n: "model-00001-of-00002.safetensors" for n in first}
    index |= {n: "model-00002-of-00002.safetensors" for n in second}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return out


def forms(llm: LLM) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: m.quantized_tensors()
        for name, m in llm.engine.model.named_modules()
        if isinstance(m, Linear)
    }


@pytest.mark.parametrize("quantization", ["w8a8", "int4-w8a8"])
def test_the_layers_calibrate_as_they_stream_to_the_whole_models_bits(
    sharded, tmp_path, monkeypatch, quantization, int8_gemm
):
    held: list[tuple[int, list[int]]] = []  # at each layer's calibration: layers holding bf16
    layer = calibration.LayerwiseCalibration.layer

    def spy(self, i):
        layers = self.model.model.layers
        bf16 = [
            j
            for j in range(len(layers))
            if any(m.weight is not None for m in layers[j].modules() if isinstance(m, Linear))
        ]
        held.append((i, bf16))
        return layer(self, i)

    monkeypatch.setattr(calibration.LayerwiseCalibration, "layer", spy)
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path / "streamed"))
    with LLM(str(sharded), quantization=quantization, enforce_eager=True) as llm:
        streamed, streamed_out = forms(llm), llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    # layer 0's before layer 1's, each layer's bf16 weights gone before the next runs (layer
    # 1's are allocated at layer 0's, not yet read: the reader's test below)
    assert held == [(0, [0, 1]), (1, [1])]

    monkeypatch.setattr(loader, "_calibrates_by_layer", lambda *args: False)
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path / "whole"))
    with LLM(str(sharded), quantization=quantization, enforce_eager=True) as llm:
        whole, whole_out = forms(llm), llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert streamed.keys() == whole.keys()
    if int8_gemm == "int16-pairs":  # each way chosen somewhere: the choices are compared
        parts = [p for p in whole.values() if "int8.weight" in p and "int8.low" not in p]
        assert any("int8.row_sums" in p for p in parts), "no layer kept 7-bit inputs"
        assert any("int8.row_sums" not in p for p in parts), "no layer took 7-bit weights"
    for name, parts in whole.items():
        assert parts.keys() == streamed[name].keys() and parts, name
        for part, tensor in parts.items():
            assert torch.equal(streamed[name][part], tensor), (name, part)
    assert [o.outputs[0].token_ids for o in streamed_out] == [
        o.outputs[0].token_ids for o in whole_out
    ]


def test_a_cached_load_drops_each_weight_as_it_is_filled(sharded, own_cache, monkeypatch):
    with LLM(str(sharded), quantization="w8a8", enforce_eager=True) as llm:
        first = forms(llm), llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    held: list[list[str]] = []  # at the hand-over to quantize_cached: Linears with bf16
    quantize_cached = loader.quantize_cached

    def spy(model, *args, **kwargs):
        head = model.lm_head
        held.append(
            [n for n, m in model.named_modules() if isinstance(m, Linear) and m is not head]
        )
        held[-1] = [n for n in held[-1] if model.get_submodule(n).weight is not None]
        return quantize_cached(model, *args, **kwargs)

    monkeypatch.setattr(loader, "quantize_cached", spy)
    monkeypatch.setattr(calibration, "smoothing_factors", None)  # (never called)
    monkeypatch.setattr(calibration.LayerwiseCalibration, "layer", None)
    with LLM(str(sharded), quantization="w8a8", enforce_eager=True) as llm:
        again = forms(llm), llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert held == [[]]
    for name, parts in first[0].items():
        for part, tensor in parts.items():
            assert torch.equal(again[0][name][part], tensor), (name, part)
    assert [o.outputs[0].token_ids for o in again[1]] == [o.outputs[0].token_ids for o in first[1]]


def test_the_reader_gives_layers_in_order_and_says_when_each_is_in(sharded):
    files = loader.safetensors_files(sharded)
    seen: list[str] = []
    names = [
        name
        for name, _ in loader.iter_checkpoint_by_layer(files, 2, lambda i: seen.append(f"<{i}>"))
        if not seen.append(name)
    ]
    whole = {n for f in files for n in load_file(f)}
    assert sorted(names) == sorted(whole)
    layer_0 = [n for n in seen if n.startswith("model.layers.0.")]
    layer_1 = [n for n in seen if n.startswith("model.layers.1.")]
    others = [n for n in seen if not n.startswith(("model.layers.", "<"))]
    assert seen == others + layer_0 + ["<0>"] + layer_1 + ["<1>"]
