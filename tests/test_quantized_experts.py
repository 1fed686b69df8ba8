"""A mixture of experts quantized as its checkpoint is read (models/quantized_experts.py).

Under --quantization int4 (int8) a tiny Qwen3-MoE's experts become Q4 (Q8) records, each
expert's gate and up rows then down's, exactly what `pack_q4` (`pack_q8`) makes of the
checkpoint's weights in bf16; no bf16 stack is held; the answers are the bf16 model's within
what the quantization allows; a second load takes the records back from the quantized
weights' cache without reading the checkpoint's expert tensors; blocks whose experts are not
plain SwiGLU, or are exchanged between replicas, keep bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import assert_prompt_logprobs_near
from safetensors.torch import load_file

from pypto_serving import LLM, SamplingParams, native
from pypto_serving.config import EngineConfig
from pypto_serving.distributed import ParallelGroups
from pypto_serving.engine.plan import plan_run
from pypto_serving.models import loader, quantized_experts
from pypto_serving.models.config import load_model_config
from pypto_serving.models.llama import MoE
from pypto_serving.ops.linear import NATIVE_Q4, NATIVE_Q8, pack_q4, pack_q8

MODEL = "qwen3moe-e4-top2"  # layer 0 a mixture of 4 experts (top 2), layer 1 dense
PROMPTS = [[5, 9, 40, 41], [7, 1, 2, 3, 100, 120, 33, 34, 35, 36, 37, 38, 39, 60, 61]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)

pytestmark = pytest.mark.skipif(
    native.gemm_library() is None, reason="experts are records where the native GEMM builds"
)


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(path)
    return out


@pytest.mark.parametrize(
    ("quantization", "fmt"),
    [("int4", NATIVE_Q4), ("int4-w8a8", NATIVE_Q4), ("int8", NATIVE_Q8), ("w8a8", NATIVE_Q8)],
)
def test_the_experts_are_records_of_the_checkpoints_weights(
    tiny_model, own_cache, quantization, fmt
):
    model_dir = tiny_model(MODEL)
    weights = checkpoint(model_dir)
    pack = pack_q4 if fmt == NATIVE_Q4 else pack_q8
    with LLM(str(model_dir), quantization=quantization, enforce_eager=True) as llm:
        assert llm.engine.plan.expert_records
        moe = llm.engine.model.model.layers[0].mlp
        assert isinstance(moe, MoE)
        assert moe.experts_gate_up is None and moe.experts_down is None  # never held
        records = moe.records
        assert records is not None
        assert records.gate_up_format == records.down_format == fmt
        for e in range(4):
            prefix = f"model.layers.0.mlp.experts.{e}"
            gate, up, down = (weights[f"{prefix}.{p}_proj.weight"].bfloat16() for p in PROJ)
            assert torch.equal(records.gate_up[e], pack(torch.cat([gate, up])))
            assert torch.equal(records.down[e], pack(down))
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)


def test_a_large_matrix_is_packed_in_parts_to_the_same_records(monkeypatch):
    from pypto_serving.ops import linear

    weight = torch.randn(200, 96).bfloat16()
    whole = linear.pack_q4(weight), linear.pack_q8(weight)
    monkeypatch.setattr(linear, "PACK_ROWS", 48)
    assert torch.equal(linear.pack_q4(weight), whole[0])
    assert torch.equal(linear.pack_q8(weight), whole[1])


PROJ = ("gate", "up", "down")


def test_the_answers_are_the_bf16_models_within_the_quantizations_error(tiny_model, own_cache):
    """int8's Q8 experts (and its int8 layers) against the bf16 model: every prompt logprob
    within 3 % of their largest (8-bit weights, activations quantized per 32 inputs); gate and
    up swapped, or a wrong expert's records, move them by whole units."""
    model_dir = tiny_model(MODEL)
    found = {}
    for quantization in ("int8", "none"):
        with LLM(str(model_dir), quantization=quantization, enforce_eager=True) as llm:
            found[quantization] = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_prompt_logprobs_near(found["int8"], found["none"], 0.03)


def test_a_second_load_takes_the_records_from_the_cache_unread(tiny_model, own_cache, monkeypatch):
    model_dir = tiny_model(MODEL)
    with LLM(str(model_dir), quantization="int4", enforce_eager=True) as llm:
        first = llm.engine.model.model.layers[0].mlp.records
        tokens = llm.generate(PROMPTS, PARAMS, use_tqdm=False)

    read: list[str] = []
    iterate = loader.iter_checkpoint

    def recorded(files, skip=None):
        for name, tensor in iterate(files, skip):
            read.append(name)
            yield name, tensor

    def refused(self, name, tensor):
        raise AssertionError("the cached records were quantized again")

    monkeypatch.setattr(loader, "iter_checkpoint", recorded)
    monkeypatch.setattr(quantized_experts.ExpertQuantizer, "take", refused)
    with LLM(str(model_dir), quantization="int4", enforce_eager=True) as llm:
        again = llm.engine.model.model.layers[0].mlp.records
        assert torch.equal(again.gate_up, first.gate_up) and torch.equal(again.down, first.down)
        assert llm.generate(PROMPTS, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == (
            tokens[0].outputs[0].token_ids
        )
    assert read and not [n for n in read if ".experts." in n]  # the experts left unread


def test_blocks_that_are_not_plain_swiglu_or_exchanged_keep_bf16(tiny_model):
    cfg = load_model_config(tiny_model(MODEL))
    with torch.device("meta"):
        block = MoE(cfg, ParallelGroups())
    assert quantized_experts.takes_records(block)
    block.exchange = "all_to_all"  # DP attention + EP: bf16 rows cross the replicas
    assert not quantized_experts.takes_records(block)
    block.exchange, block.swiglu_limit = "none", 7.0  # DeepSeek-V4's clamped experts
    assert not quantized_experts.takes_records(block)
    block.swiglu_limit, block.swiglu_alpha = 0.0, 1.702  # gpt-oss's
    assert not quantized_experts.takes_records(block)


def test_the_plan_makes_experts_records_for_weight_quantizations_only(tiny_model):
    model_dir = tiny_model(MODEL)
    for quantization, records in (("int4", True), ("int8", True), ("none", False)):
        plan = plan_run(EngineConfig(quantization=quantization), model_dir)
        assert plan.expert_records is records


def test_a_checkpoint_missing_an_expert_is_refused(tiny_model, own_cache, tmp_path):
    from safetensors.torch import save_file

    from pypto_serving.errors import ModelLoadError

    source = tiny_model(MODEL)
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (broken / path.name).write_bytes(path.read_bytes())
    weights = checkpoint(source)
    del weights["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing 1 expert tensors: .*experts\.2\.up_proj"):
        LLM(str(broken), quantization="int4", enforce_eager=True)
