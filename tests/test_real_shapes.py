"""bench/real_shapes.py (issue 47): a shape written as a Hugging Face directory and as a GGUF
file holds the same weights: our engine gives the same greedy tokens from either (the GGUF's
q/k rows permuted as llama.cpp's converter does, and unpermuted by our loader), and a Q4_1 file
loads and generates; the shapes' parameter counts are the published models'."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import gguf
import pytest

from pypto_serving.engine.llm import LLM
from pypto_serving.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import real_shapes

PROMPT = [5, 9, 300, 4000, 7, 11, 12, 13, 900, 77]


def greedy(model: Path) -> list[int]:
    llm = LLM(str(model), dtype="float32", enforce_eager=True, num_kv_pages=32, page_size=16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF files' conversions (out of the user's cache), and one build of the native
    kernels for the module's tests."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])  # the MoE: qwen3's too
def test_the_hf_directory_and_the_gguf_file_are_one_model(
    tmp_path: Path, monkeypatch, cache: Path, name: str
) -> None:
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(cache))
    shape = real_shapes.SHAPES[name]
    hf = real_shapes.write_hf(shape, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        64,
        2,
        real_shapes.VOCAB,
    )
    assert config["architectures"] == [real_shapes.ARCHITECTURES[shape.arch][1]]
    f32 = real_shapes.write_gguf(shape, "F32", tmp_path / "model-F32.gguf")
    q4 = real_shapes.write_gguf(shape, "Q4_1", tmp_path / "model-Q4_1.gguf")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(q4)).tensors}
    assert kinds["token_embd.weight"] == "Q8_0" and kinds["blk.0.attn_q.weight"] == "Q4_1"
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    if shape.experts:  # stacked, the router kept in F32
        assert kinds["blk.0.ffn_gate_exps.weight"] == "Q4_1"
        assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"
    want = greedy(hf)
    assert greedy(f32) == want  # the same weights, whichever file
    assert len(greedy(q4)) == 8
    assert real_shapes.write_hf(shape, tmp_path / "hf") == hf  # cached: not written again


@pytest.mark.parametrize(
    ("name", "billions"), [("llama-1b", 1.07), ("llama-8b", 7.38), ("qwen3-4b", 3.76)]
)
def test_the_shapes_have_their_published_sizes(name: str, billions: float) -> None:
    """Within 2 % of the published models' parameters, their vocabulary's difference aside."""
    shape = real_shapes.SHAPES[name]
    published_vocab = {"llama-1b": 128256, "llama-8b": 128256, "qwen3-4b": 151936}[name]
    heads = 1 if shape.tie else 2
    extra = (published_vocab - real_shapes.VOCAB) * shape.hidden * heads
    published = {"llama-1b": 1.24, "llama-8b": 8.03, "qwen3-4b": 4.02}[name]
    assert abs((shape.parameters() + extra) / 1e9 - published) / published < 0.02
    assert abs(shape.parameters() / 1e9 - billions) / billions < 0.02


def test_the_moe_shape_is_qwen3_30b_a3b_s_layers() -> None:
    """8 of Qwen3-30B-A3B's 48 layers: with all 48 and its vocabulary, its 30.5 B parameters
    (within 2 %), 3.3 B of them used a token."""
    shape = real_shapes.SHAPES["qwen3-moe-small"]
    full = dataclasses.replace(shape, layers=48)
    extra = (151936 - real_shapes.VOCAB) * shape.hidden * 2
    assert abs((full.parameters() + extra) / 1e9 - 30.5) / 30.5 < 0.02
    assert abs(shape.parameters() / 1e9 - 5.1) / 5.1 < 0.02
