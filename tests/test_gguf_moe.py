"""A mixture of experts' GGUF served from its own Q4_1 matrices (--quantization gguf, auto).

A tiny qwen3moe GGUF whose every projection is Q4_1, each expert's too (stacked as llama.cpp
stacks them; the router F32): the conversion keeps each expert's stored parts, which are the
file's weights exactly; the engine holds each MoE block's experts as records alone (no bf16
stack loaded), which hold exactly those weights, gate's rows then up's; the router stays in
the model's dtype; the experts multiply by their records with activations quantized per 32
inputs (llama.cpp's arithmetic) at every width, and the answers are those of the same weights
in bf16 within what that allows; each row's expert sums do not depend on the rows beside it,
so under --batch-invariant a request's tokens are the same bits alone, batched, chunked and
after a prefix hit.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from checkpoints import assert_prompt_logprobs_near, dequantize
from gguf_files import write_tiny_gguf
from safetensors.torch import load_file
from torch import nn

from pypto_serving import LLM, SamplingParams, native
from pypto_serving.config import EngineConfig, ParallelConfig
from pypto_serving.engine.plan import plan_run
from pypto_serving.errors import PyptoError
from pypto_serving.models.gguf_convert import BLOCKS_FILE, convert_gguf_to_hf
from pypto_serving.ops.linear import NATIVE_Q4, NATIVE_Q8, Linear, pack_q4, pack_q8
from pypto_serving.ops.moe import activate, moe_experts

HIDDEN, EXPERTS, USED, FFN = 64, 4, 2, 32
PROMPTS = [[5, 9, 40, 41], [7, 1, 2, 3, 100, 120, 33, 34, 35, 36, 37, 38, 39, 60, 61]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)

pytestmark = pytest.mark.skipif(
    native.gemm_library() is None, reason="the records serve a MoE where the native GEMM builds"
)


@pytest.fixture(scope="module")
def moe_q4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("gguf-moe")
    ref = write_tiny_gguf(
        tmp / "moe.gguf",
        arch="qwen3moe",
        hidden=HIDDEN,
        head_dim=16,
        experts=(EXPERTS, USED, FFN),
        proj_qtype=gguf.GGMLQuantizationType.Q4_1,
    )
    return convert_gguf_to_hf(tmp / "moe.gguf", tmp / "hf"), ref


def expert_weight(ref: dict, layer: int, expert: int, *projections: str) -> torch.Tensor:
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"
    return torch.cat([torch.from_numpy(ref[f"{prefix}.{p}_proj.weight"]) for p in projections])


def test_each_experts_stored_parts_are_the_files_weights_exactly(moe_q4):
    out, ref = moe_q4
    stored = load_file(out / BLOCKS_FILE)
    names = [n for n in ref if ".experts." in n]
    assert len(names) == 2 * EXPERTS * 3
    for name in names:
        q, scale, low = (stored[f"{name}.{p}"].double() for p in ("q", "scale", "min"))
        got = q * scale.repeat_interleave(32, 1) + low.repeat_interleave(32, 1)
        assert torch.equal(got.float(), torch.from_numpy(ref[name])), name
    assert "model.layers.0.mlp.gate.weight.q" not in stored  # the router: F32 in the file


def test_the_experts_are_records_alone_holding_the_files_weights(moe_q4):
    out, ref = moe_q4
    with LLM(str(out), enforce_eager=True) as llm:  # quantization auto
        plan = llm.engine.plan
        assert plan.quantization == "gguf" and plan.records_only
        assert not llm.engine.attention.native_decode  # a MoE: the graphs run every step
        for layer, block in enumerate(llm.engine.model.model.layers):
            moe = block.mlp
            assert moe.experts_gate_up is None and moe.experts_down is None  # never loaded
            records = moe.records
            assert records is not None
            assert records.gate_up_format == records.down_format == NATIVE_Q4
            for e in range(EXPERTS):
                got = dequantize(records.gate_up[e], NATIVE_Q4, 2 * FFN, HIDDEN)
                assert torch.equal(got.float(), expert_weight(ref, layer, e, "gate", "up"))
                got = dequantize(records.down[e], NATIVE_Q4, HIDDEN, FFN)
                assert torch.equal(got.float(), expert_weight(ref, layer, e, "down"))
            router = moe.gate  # the model's dtype, never quantized
            assert type(router) is nn.Linear and router.weight.dtype == torch.bfloat16
            want = torch.from_numpy(ref[f"model.layers.{layer}.mlp.gate.weight"]).bfloat16()
            assert torch.equal(router.weight, want)
            linears = [m for m in block.modules() if isinstance(m, Linear)]
            assert all(m.weight is None for m in linears)
            assert all(m.records_few for m in linears)  # its decodes' few rows: the records


def test_the_answers_are_the_same_weights_in_bf16s(moe_q4):
    """Against the conversion's bf16 weights (quantization none), which are the file's
    weights rounded to bf16: every prompt logprob within 2 % of their largest, what the
    experts' activations quantized per 32 inputs cost this tiny model (about 1 %). A wrong
    expert, gate and up swapped or a record misread moves them by whole units."""
    out, _ = moe_q4
    found = {}
    for quantization in ("gguf", "none"):
        with LLM(str(out), enforce_eager=True, quantization=quantization) as llm:
            found[quantization] = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_prompt_logprobs_near(found["gguf"], found["none"], 0.02)
    assert all(len(o.outputs[0].token_ids) == 8 for o in found["gguf"])


@pytest.mark.parametrize("rows", [1, 3, 300])  # 300: past a call's chunk of 256 tokens
@pytest.mark.parametrize(
    "formats", [(NATIVE_Q4, NATIVE_Q4), (NATIVE_Q8, NATIVE_Q8), (NATIVE_Q4, NATIVE_Q8)]
)
def test_the_expert_op_multiplies_records_as_the_weights_they_hold(rows, formats):
    """`moe_experts` over records (gate_up's and down's formats each their own, as a file
    whose ffn_down_exps are Q8_0) against float64 over the weights the records hold, the
    activations quantized to int8 per 32 inputs (an error of about 1 %); and each row's sums
    the same bits alone as among the others."""
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, FFN) * 0.2
    packs = [pack_q4 if fmt == NATIVE_Q4 else pack_q8 for fmt in formats]
    stacks = [
        torch.stack([pack(w) for w in stack])
        for pack, stack in zip(packs, (gate_up, down), strict=True)
    ]
    held = [
        [dequantize(r, fmt, *w.shape[1:]) for r in s]
        for s, w, fmt in zip(stacks, (gate_up, down), formats, strict=True)
    ]
    x = torch.randn(rows, HIDDEN).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS)[:USED] for _ in range(rows)])
    weights = torch.rand(rows, USED).bfloat16()
    experts = (*stacks, list(range(EXPERTS)), 0.0, 0.0, None, None, *formats)
    got = moe_experts(x, ids, weights, *experts)
    want = torch.zeros(rows, HIDDEN, dtype=torch.float64)
    for t in range(rows):
        for slot in range(USED):
            e = int(ids[t, slot])
            gate, up = (x[t].double() @ held[0][e].T).chunk(2)
            hidden = activate(gate, up, 0.0, 0.0)
            want[t] += weights[t, slot].double() * (hidden @ held[1][e].T)
            alone = moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], *experts)
            assert torch.equal(alone[0], got[t])
    error = (got.double() - want).norm() / want.norm()
    assert error < 0.02, error


def test_batch_invariance_makes_a_requests_tokens_the_same_bits_anywhere(moe_q4):
    """--batch-invariant: every expert product over the records themselves (one kernel, each
    row's sums in one order), so a request's tokens and logprobs are the same alone, in a
    batch, with its prompt chunked and after a prefix hit."""
    out, _ = moe_q4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompt = [(7 * j + 3) % 250 + 3 for j in range(40)]
    others = [[(11 * i + 5 * j) % 250 + 3 for j in range(3 + 6 * i)] for i in range(6)]

    def result(o):
        return o.outputs[0].token_ids, [s.logprob for s in o.outputs[0].logprobs]

    knobs = {"batch_invariant": True, "enforce_eager": True, "page_size": 16}
    with LLM(str(out), **knobs) as llm:
        alone = result(llm.generate([prompt], params, use_tqdm=False)[0])
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 32
        batched = result(llm.generate([prompt, *others], params, use_tqdm=False)[0])
    with LLM(str(out), **knobs, max_num_batched_tokens=16) as llm:
        chunked = result(llm.generate([prompt], params, use_tqdm=False)[0])
    assert alone == result(again) == batched == chunked


def test_expert_parallelism_over_replicas_serves_the_bf16_experts(moe_q4):
    """DP attention + EP exchanges tokens between the replicas' experts, which records do not
    take part in: auto picks none there (the experts in bf16), and gguf asked is refused with
    a reason, not a crash at load."""
    out, _ = moe_q4
    parallel = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    assert plan_run(EngineConfig(parallel=parallel), out).quantization is None
    with pytest.raises(PyptoError, match="no expert parallelism"):
        plan_run(EngineConfig(parallel=parallel, quantization="gguf"), out)
    assert plan_run(EngineConfig(), out).quantization == "gguf"
