"""--quantization gguf (and auto): a GGUF's own Q4_1 / Q8_0 matrices, served as stored.

A tiny llama GGUF whose every projection is Q4_1 (its embedding, the tied head, Q8_0): the
conversion keeps each matrix's stored parts, which are the file's weights exactly; the engine
takes them as the native decode step's records without a second quantization (each Linear's
records hold exactly the dequantized file weights, q/k un-permuted and q/k/v, gate/up fused as
the model fuses them); auto picks gguf there and none elsewhere; the default model answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from checkpoints import build_checkpoint, build_tokenizer, dequantize
from cpu_builds import AVX2_ENV, AVX2_IS_THIS_BUILD
from gguf_files import write_tiny_gguf
from safetensors.torch import load_file

from pypto_serving import LLM, SamplingParams, native
from pypto_serving.config import EngineConfig
from pypto_serving.device import cpu_flags
from pypto_serving.engine.plan import plan_run
from pypto_serving.errors import PyptoError
from pypto_serving.models import gguf_convert
from pypto_serving.models.gguf_convert import (
    BLOCKS_FILE,
    BLOCKS_INDEX,
    blocks_files,
    convert_gguf_to_hf,
)
from pypto_serving.models.gguf_weights import has_blocks, parts_file
from pypto_serving.models.loader import safetensors_files
from pypto_serving.ops.linear import NATIVE_Q4, NATIVE_Q8, Linear, dequantized_linear

Q4_1 = gguf.GGMLQuantizationType.Q4_1
HIDDEN = 64  # head_dim 16: a shape the native kernels take


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("gguf-q4")
    ref = write_tiny_gguf(tmp / "tiny.gguf", hidden=HIDDEN, proj_qtype=Q4_1)
    return convert_gguf_to_hf(tmp / "tiny.gguf", tmp / "hf"), ref


def test_the_stored_parts_are_the_files_weights_exactly(q4_model):
    out, ref = q4_model
    assert has_blocks(out)
    stored = load_file(out / BLOCKS_FILE)
    for name, weight in ref.items():
        if not name.endswith("_proj.weight") and name != "model.embed_tokens.weight":
            continue
        q, scale = stored[f"{name}.q"].double(), stored[f"{name}.scale"].double()
        scale = scale.repeat_interleave(32, dim=1)
        if name == "model.embed_tokens.weight":  # Q8_0
            assert f"{name}.min" not in stored and stored[f"{name}.q"].dtype == torch.int8
            got = q * scale
        else:
            low = stored[f"{name}.min"].double().repeat_interleave(32, dim=1)
            assert stored[f"{name}.q"].dtype == torch.uint8 and q.max() <= 15
            got = q * scale + low
        assert torch.equal(got.float(), torch.from_numpy(weight)), name  # q/k un-permuted too


def test_a_file_too_big_for_one_file_converts_in_shards(tmp_path, monkeypatch):
    """Past SHARD_BYTES a conversion writes shards as it goes (an 8B file's 23 GB would not
    fit a 24 GiB machine's memory at once), with HF's index for the weights and its own for
    the stored parts: the same tensors, the same records, the same tokens."""
    write_tiny_gguf(tmp_path / "tiny.gguf", hidden=HIDDEN, proj_qtype=Q4_1)
    whole = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "whole")
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 4096)
    sharded = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "sharded")
    assert not (sharded / "model.safetensors").exists()
    assert len(safetensors_files(sharded)) > 1 and len(blocks_files(sharded)) > 1
    assert blocks_files(whole) == [whole / BLOCKS_FILE]
    assert (parts_file(whole), parts_file(sharded)) == (BLOCKS_FILE, BLOCKS_INDEX)  # messages
    for read in (safetensors_files, blocks_files):
        got = {k: v for f in read(sharded) for k, v in load_file(f).items()}
        want = {k: v for f in read(whole) for k, v in load_file(f).items()}
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for out in (whole, sharded):
        with LLM(str(out), enforce_eager=True) as llm:
            assert llm.engine.plan.quantization == "gguf"
            [first] = llm.generate([[5, 9, 40, 41]], params, use_tqdm=False)
            tokens.append(first.outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_a_file_with_other_types_keeps_none(tmp_path):
    """The plain tiny GGUF's projections are float32: nothing to serve as stored, so auto
    stays none there."""
    write_tiny_gguf(tmp_path / "f32.gguf")
    out = convert_gguf_to_hf(tmp_path / "f32.gguf", tmp_path / "hf")
    assert not has_blocks(out)
    assert plan_run(EngineConfig(), out).quantization is None


def test_the_engine_takes_the_files_records_without_requantizing(q4_model):
    out, ref = q4_model
    with LLM(str(out), enforce_eager=True) as llm:  # quantization auto
        plan = llm.engine.plan
        assert plan.quantization == "gguf" and llm.engine.attention.native_decode
        assert plan.records_only and plan.pack_linear is None  # one form: the records
        model = llm.engine.model
        layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        for name, layer in layers.items():
            assert layer.native is not None and layer.packed is None, name
            assert layer.weight is None and layer.quantized is None, name  # never loaded
            records, fmt = layer.native
            if name == "lm_head":  # tied: the embedding's Q8_0
                assert fmt == NATIVE_Q8
                want = torch.from_numpy(ref["model.embed_tokens.weight"])
            else:
                assert fmt == NATIVE_Q4
                parts = {
                    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
                    "gate_up_proj": ("gate_proj", "up_proj"),
                }.get(name.rsplit(".", 1)[-1], (name.rsplit(".", 1)[-1],))
                prefix = name.rsplit(".", 1)[0]
                want = torch.cat([torch.from_numpy(ref[f"{prefix}.{p}.weight"]) for p in parts])
            got = dequantize(records, fmt, layer.out_features, layer.in_features)
            assert torch.equal(got.float(), want), name
        embed = model.model.embed_tokens  # tied: looked up in the head's records, not loaded
        assert embed.weight is None and embed.q8 is model.lm_head.native[0]
        embedding = torch.from_numpy(ref["model.embed_tokens.weight"])
        rows = torch.arange(embedding.shape[0]).flip(0)
        assert torch.equal(embed(rows), embedding.bfloat16()[rows])  # the bf16 rows exactly
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        [first] = llm.generate([[5, 9, 40, 41]], params, use_tqdm=False)
        assert len(first.outputs[0].token_ids) == 8


EMBEDDING_CHECK = """
import sys
from pypto_serving import LLM, SamplingParams
from pypto_serving.models import loader

PROMPTS = [[5, 9, 40, 41], [7, 1, 2, 3, 100, 120, 3, 60, 61, 62]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)

def run():
    with LLM(sys.argv[1], enforce_eager=True) as llm:
        assert llm.engine.attention.native_decode
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        in_head = llm.engine.model.model.embed_tokens.weight is None
    samples = [o.outputs[0] for o in got]
    return in_head, [(c.token_ids, [s.logprob for s in c.logprobs]) for c in samples]

in_head, found = run()
loader.embedding_in_head = lambda *_: False  # the bf16 embedding loaded, as before
loaded, want = run()
assert in_head and not loaded, (in_head, loaded)
assert found == want, (found, want)
print("the same bits")
"""


@pytest.mark.parametrize("build", ["own", "avx2"])
def test_the_embedding_from_the_heads_records_gives_the_same_bits(q4_model, build):
    """Greedy tokens and logprobs, prefill on the graphs and decodes on the native step, are
    the same bits with the tied embedding looked up in the head's Q8 records as with the bf16
    embedding loaded beside them (as before), on this CPU's build and the AVX2 build (a
    child process each: torch's ISA is chosen as it loads)."""
    if build == "avx2" and (AVX2_IS_THIS_BUILD or not {"avx2", "fma", "f16c"} <= cpu_flags()):
        pytest.skip("this CPU's own build is the AVX2 build, or it has no AVX2")
    out, _ = q4_model
    run = subprocess.run(
        [sys.executable, "-c", EMBEDDING_CHECK, str(out)],
        env=os.environ | (AVX2_ENV if build == "avx2" else {}),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "the same bits" in run.stdout, run.stderr[-4000:]


def test_the_graphs_multiply_by_the_files_weights_in_bf16(q4_model):
    """A prefill's matmuls dequantize the records as they run (`dequantized_linear`): the
    file's weights rounded to bf16, the HF conversion's exactly (an identity matrix's product
    gives them back), with bf16 pair dot products where the build has them and float32
    panels everywhere; and a row's result is the same bits alone or among others."""
    out, ref = q4_model
    forms = [False] + ([True] if native.gemm_library().pypto_records_pairs_built() else [])
    with LLM(str(out), enforce_eager=True) as llm:
        assert llm.engine.plan.records_wide == ("pairs" if True in forms else "panels")
        head = llm.engine.model.lm_head
        qkv = llm.engine.model.model.layers[1].self_attn.qkv_proj
        want = {
            head: torch.from_numpy(ref["model.embed_tokens.weight"]),
            qkv: torch.cat(
                [torch.from_numpy(ref[f"model.layers.1.self_attn.{p}_proj.weight"]) for p in "qkv"]
            ),
        }
        x = torch.randn(7, HIDDEN).bfloat16()
        for layer, weight in want.items():
            records, fmt = layer.native
            n = layer.out_features
            for pairs in forms:
                eye = torch.eye(HIDDEN).bfloat16()
                got = dequantized_linear(eye, records, fmt, n, pairs)
                assert torch.equal(got.T.bfloat16(), weight.bfloat16()), (layer, pairs)
                together = dequantized_linear(x, records, fmt, n, pairs)
                for i in range(len(x)):
                    alone = dequantized_linear(
                        x[i : i + 1], records, fmt, layer.out_features, pairs
                    )
                    assert torch.equal(alone[0], together[i])


def test_none_and_other_engines_keep_the_dtype(q4_model):
    out, _ = q4_model
    assert plan_run(EngineConfig(quantization="none"), out).quantization is None
    assert plan_run(EngineConfig(native_decode=False), out).quantization is None
    assert plan_run(EngineConfig(dtype="float32"), out).quantization is None
    assert plan_run(EngineConfig(executor="reference"), out).quantization is None
    assert plan_run(EngineConfig(quantization="int4"), out).quantization == "int4"


def test_batch_invariance_serves_every_matmul_from_the_files_records(q4_model):
    out, _ = q4_model
    with LLM(str(out), batch_invariant=True, enforce_eager=True) as llm:
        assert llm.engine.plan.quantization == "gguf" and llm.engine.plan.pack_linear is None
        for _, layer in llm.engine.model.named_modules():
            if isinstance(layer, Linear):
                assert layer.native is not None and layer.packed is None
                assert layer.weight is None


def test_gguf_asked_of_a_model_without_stored_matrices_is_refused(tmp_path):
    build_checkpoint("llama-wide", tmp_path)
    build_tokenizer(tmp_path)
    assert plan_run(EngineConfig(), tmp_path).quantization is None  # auto: none
    with pytest.raises(PyptoError, match="gguf"):
        LLM(str(tmp_path), quantization="gguf", enforce_eager=True)
