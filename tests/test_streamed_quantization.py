"""Linear layers quantized as the checkpoint streams (models/loader.py's `_streamed_weights`).

Where a model's layers will be the native step's records alone (`--quantization int4`
wherever the native GEMM builds), each layer but the LM head is packed the moment its weight
is whole and its bf16 weight dropped, so the load never holds the checkpoint in bf16: when
the load hands over to `quantize_cached`, no such layer keeps a weight, and each one's
records are `pack_q4` of the checkpoint's weights, fused as the model fuses them. Where the
kept file holds every layer's forms, the layers are not packed at all (the file's forms are
taken), and the answers are the same.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pypto_serving import LLM, SamplingParams, native
from pypto_serving.models import loader
from pypto_serving.ops.linear import NATIVE_Q4, Linear, pack_q4

MODEL = "llama-mha-untied"
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

pytestmark = pytest.mark.skipif(
    native.gemm_library() is None, reason="int4's records serve alone where the native GEMM builds"
)


def held_weights(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records, at each load's hand-over to `quantize_cached`, the Linears (LM head aside)
    that still hold a bf16 weight."""
    seen: list[list[str]] = []
    quantize_cached = loader.quantize_cached

    def spy(model, *args, **kwargs):
        seen.append(
            [
                n
                for n, m in model.named_modules()
                if isinstance(m, Linear) and m is not model.lm_head and m.weight is not None
            ]
        )
        return quantize_cached(model, *args, **kwargs)

    monkeypatch.setattr(loader, "quantize_cached", spy)
    return seen


def test_each_layer_is_packed_as_it_streams_and_the_cache_is_taken_after(
    tiny_model, own_cache, monkeypatch
):
    model_dir = tiny_model(MODEL)
    weights = load_file(model_dir / "model.safetensors")
    seen = held_weights(monkeypatch)
    with LLM(str(model_dir), quantization="int4", enforce_eager=True) as llm:
        assert llm.engine.plan.records_only
        first = llm.generate([[5, 9, 40, 41, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        layer = llm.engine.model.model.layers[1]
        attn, mlp = layer.self_attn, layer.mlp
        prefix = "model.layers.1."
        qkv = torch.cat([weights[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([weights[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for module, weight in (
            (attn.qkv_proj, qkv),
            (attn.o_proj, weights[f"{prefix}self_attn.o_proj.weight"]),
            (mlp.gate_up_proj, gate_up),
            (mlp.down_proj, weights[f"{prefix}mlp.down_proj.weight"]),
        ):
            assert module.native is not None and module.native[1] == NATIVE_Q4
            assert torch.equal(module.native[0], pack_q4(weight.bfloat16()))
    assert seen == [[]]  # every layer packed before the hand-over, none held in bf16

    packed = []
    quantize = Linear.quantize
    monkeypatch.setattr(
        Linear, "quantize", lambda self, *a, **k: packed.append(self) or quantize(self, *a, **k)
    )
    with LLM(str(model_dir), quantization="int4", enforce_eager=True) as llm:
        again = llm.generate([[5, 9, 40, 41, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert seen == [[], []] and packed == []  # the kept forms taken: nothing packed
    assert again == first
