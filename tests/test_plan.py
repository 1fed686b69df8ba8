"""The run plan (engine/plan.py): the kernel switches are config fields with flags, resolved
once where the machine allows them, and the engine runs what the plan says."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoints import build_checkpoint, build_tokenizer
from live_server import tiny_llm

from pypto_serving import native
from pypto_serving.cli import build_parser
from pypto_serving.config import EngineConfig, engine_config
from pypto_serving.device import cpu_flags, cpu_isa, cpu_packs_bf16
from pypto_serving.distributed import ParallelGroups
from pypto_serving.engine.plan import RunPlan, plan_attention, plan_run
from pypto_serving.errors import PyptoError
from pypto_serving.executor import native_decode
from pypto_serving.executor.paged import AttentionPlan
from pypto_serving.flags import engine_knobs
from pypto_serving.models.config import load_model_config
from pypto_serving.models.loader import load_model
from pypto_serving.models.quantized_cache import quantized_cache_path
from pypto_serving.ops.linear import Linear
from pypto_serving.sampling import SamplingParams

SWITCHES = ("native_attention", "native_decode", "pack_linear")


def test_the_switches_are_flags_of_every_engine_command():
    off = ["--no-native-attention", "--no-native-decode", "--no-pack-linear", "--num-threads", "1"]
    for command in (["serve"], ["generate", "--prompt", "x"], ["chat"], ["bench", "latency"]):
        knobs = engine_knobs(build_parser().parse_args([*command, *off]))
        assert knobs == dict.fromkeys(SWITCHES, False) | {"num_threads": 1}, command
        plan = plan_run(engine_config(device="cpu", **knobs))
        assert (plan.native_attention, plan.native_decode, plan.pack_linear) == (False, False, None)
        assert plan.num_threads == 1
    assert engine_knobs(build_parser().parse_args(["serve", "--native-decode"])) == {
        "native_decode": True
    }


def test_the_plan_takes_the_switches_where_the_machine_allows(monkeypatch):
    # the environment no longer switches kernels: only the config does
    for name in ("PYPTO_NATIVE_ATTENTION", "PYPTO_NATIVE_DECODE", "PYPTO_PACK_LINEAR"):
        monkeypatch.setenv(name, "0")
    plan = plan_run(EngineConfig(device="cpu", dtype="bfloat16", quantization="int4"))
    assert plan == RunPlan(
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        num_threads=plan.num_threads,
        native_attention=True,
        native_decode=True,
        pack_linear=None,  # int4's records serve every matmul: no bf16 weight packed
        quantization="int4",
        records_only=True,
        expert_records=True,  # a MoE's experts would be Q4 records too
        # the graphs' matmuls dequantize them into bf16: AVX512-BF16 pairs or float32 panels
        records_wide="pairs" if native.gemm_library().pypto_records_pairs_built() else "panels",
    )
    # int8's Q8 records serve every matmul too: no bf16 weight packed beside them
    plan = plan_run(EngineConfig(device="cpu", dtype="bfloat16", quantization="int8"))
    assert plan.pack_linear is None and plan.records_only
    plan = plan_run(EngineConfig(device="cpu", dtype="bfloat16", quantization="w8a8"))
    assert plan.pack_linear == ("onednn" if cpu_packs_bf16() else "panels")
    assert not plan.records_only
    assert plan.num_threads >= 1
    assert not plan_run(EngineConfig(device="cpu", dtype="float32")).pack_linear
    # the native decode step needs native attention
    no_attention = plan_run(EngineConfig(device="cpu", native_attention=False))
    assert not no_attention.native_attention and not no_attention.native_decode
    with pytest.raises(PyptoError, match="num_threads must be >= 1"):
        engine_config(num_threads=0)


def test_the_attention_plan_is_decided_once_from_the_plan_and_the_model(tiny_model, caplog):
    """The kernels where the plan runs them, the kind has them and they take its shape (GQA's,
    MLA's latent as one KV head), or the kind's own (DeepSeek-V4's decode kernel); compiled
    unless --enforce-eager or the model's layers do not
    compile (DeepSeek-V4's); the native decode step where GQA's model allows it."""

    def attention(name: str, **knobs: object) -> AttentionPlan:
        config = engine_config(device="cpu", **knobs)
        cfg = load_model_config(tiny_model(name))
        return plan_attention(plan_run(config), config, cfg, ParallelGroups())

    qwen3 = attention("qwen3-hd32-gqa4", dtype="bfloat16")
    bf16_rows = native_decode.draft_row_cost(None)  # a draft's row over bf16 weights: 0.15
    assert qwen3 == AttentionPlan(
        "gqa", (4, 32), compiled=True, native_decode=True, draft_row_cost=bf16_rows
    )
    int4 = attention("qwen3-hd32-gqa4", dtype="bfloat16", quantization="int4")
    vnni = cpu_isa() == "avx512" and "avx512_vnni" in cpu_flags()  # records.h's VNNI path
    assert int4.native_decode and int4.draft_row_cost == (0.08 if vnni else 0.25)
    assert attention("qwen3-hd32-gqa4", dtype="float32").native_decode is False  # bf16 only
    assert attention("qwen3-hd32-gqa4", dtype="bfloat16", enforce_eager=True).compiled is False
    with caplog.at_level(logging.INFO):  # head_dim 8: PyTorch's attention, said
        assert attention("llama-gqa4-tied", dtype="float32").kernels is None
    assert "head_dim 8" in caplog.text
    off = attention("qwen3-hd32-gqa4", dtype="bfloat16", native_attention=False)
    assert (off.kernels, off.native_decode) == (None, False)
    reference = attention("qwen3-hd32-gqa4", dtype="bfloat16", executor="reference")
    assert reference == AttentionPlan("gqa", None, compiled=False, native_decode=False)
    mla = attention("deepseekv3-qlora-yarn", dtype="float32")  # a latent of 32 + 8: PyTorch's
    assert mla == AttentionPlan("mla", None, compiled=True, native_decode=False)
    config = engine_config(device="cpu", dtype="float32")
    wide = replace(load_model_config(tiny_model("deepseekv3-qlora-yarn")), kv_lora_rank=56)
    mla = plan_attention(plan_run(config), config, wide, ParallelGroups())
    assert mla.kernels == (wide.num_heads, 64)  # every head over one KV head of 56 + 8
    v4 = attention("deepseekv4-swa-csa-hca-hash", dtype="float32")  # its own decode kernel
    assert v4 == AttentionPlan("compressed", None, True, False, own_kernels=True)
    off = attention("deepseekv4-swa-csa-hca-hash", dtype="float32", native_attention=False)
    assert off.own_kernels is False
    with pytest.raises(PyptoError, match="kv_cache_dtype int8 needs the native CPU attention"):
        attention("qwen3-hd32-gqa4", kv_cache_dtype="int8", native_attention=False)


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("qwen3-hd32-gqa4")
    build_checkpoint("qwen3-hd32-gqa4", out)
    build_tokenizer(out)
    return out


def test_the_engine_runs_what_its_plan_says(grid_model):
    """Native attention and the native decode step on by default (bf16 on the CPU), each off
    by its field; the greedy tokens stay the same."""
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(2 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    knobs = {"dtype": "bfloat16"}
    results = {}
    for off in ((), ("native_decode",), ("native_attention",)):
        with tiny_llm(grid_model, **knobs, **dict.fromkeys(off, False)) as llm:
            engine = llm.engine
            assert engine.plan.native_attention == ("native_attention" not in off)
            assert (engine.executor.attention_kernel is not None) == engine.plan.native_attention
            assert (engine.executor.native is not None) == (not off)
            results[off] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results[("native_decode",)] == results[("native_attention",)] == results[()]


@pytest.mark.parametrize("pack", [False, True], ids=["no-pack-linear", "pack-linear"])
def test_the_engine_packs_linear_weights_as_its_plan_says(grid_model, pack):
    """--no-pack-linear reaches the loader: every Linear keeps its plain weight only; with the
    switch on, every one is packed: for oneDNN where the CPU packs bf16, else in panels for
    the native GEMM."""
    with tiny_llm(grid_model, dtype="bfloat16", pack_linear=pack) as llm:
        form = ("onednn" if cpu_packs_bf16() else "panels") if pack else None
        assert llm.engine.plan.pack_linear == form
        layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
        assert layers and all((m.packed is not None) == pack for m in layers)
        assert all(m.packed is None or m.packed.is_mkldnn == (form == "onednn") for m in layers)


@pytest.mark.parametrize("pack", [False, True], ids=["no-pack-linear", "pack-linear"])
def test_quantized_loads_pack_as_asked(grid_model, tmp_path, monkeypatch, pack):
    """int4 keeps the packed bf16 weight for prefill-sized matmuls only where packing is on,
    whether it quantizes or reads back the kept weights (`quantize_cached`)."""
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    form = ("onednn" if cpu_packs_bf16() else "panels") if pack else None
    for _ in range(2):  # quantized, then read back
        model = load_model(grid_model, torch.bfloat16, torch.device("cpu"), None, "int4", pack=form)
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert layers and all(m.quantized is not None for m in layers)
        assert all((m.packed is not None) == pack for m in layers)
    assert len(list((tmp_path / "quantized").glob("*.safetensors"))) == 1


def test_the_quantized_weights_key_follows_the_layers_marked_exact(grid_model):
    """A layer marked (or unmarked) to keep 8 bits both under w8a8 (`Linear.exact_int8`) gets
    other kept weights, wherever the mark is set (llama.py marks every model's LM head)."""
    model = load_model(grid_model, torch.bfloat16, torch.device("cpu"), None, None)
    assert model.lm_head is not None and model.lm_head.exact_int8

    def path() -> Path:
        return quantized_cache_path(model, "digest", "w8a8", ParallelGroups(), native=False)

    before = path()
    assert path() == before  # the key is stable
    model.lm_head.exact_int8 = False
    assert path() != before
