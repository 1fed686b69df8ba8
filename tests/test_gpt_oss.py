"""gpt-oss beyond what tests/test_sliding_window.py holds it to (HF's logits and greedy tokens
through every path, for two shapes in `checkpoints.TINY_WINDOW`): its released checkpoints'
MXFP4 experts, dequantized as transformers' own conversion does, serve HF's tokens; and what
it cannot take is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import build_checkpoint, build_tokenizer, hf_greedy, hf_model
from safetensors.torch import load_file, save_file

from pypto_serving import LLM, SamplingParams
from pypto_serving.errors import ModelLoadError
from pypto_serving.models import mxfp4
from pypto_serving.models.config import load_model_config
from pypto_serving.models.loader import load_model
from pypto_serving.ops.attention import DenseKV

NAME = "gptoss-window6-yarn"
PROMPTS = [list(range(40, 70)), [5, 17, 33, 90, 12] * 5, [200, 3] * 12]
EXPERTS = ("gate_up_proj", "down_proj")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks and scales of weight [..., rows, cols] (a scale per 32 values, each value
    the nearest E2M1 code): the released checkpoints' format, written here for the test."""
    groups = weight.float().unflatten(-1, (-1, 32))  # [..., rows, G, 32]
    top = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(mxfp4.E2M1)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny gpt-oss with its experts in MXFP4, over two shard files, blocks and scales
    apart; the same weights dequantized by transformers' conversion, unquantized)."""
    plain = build_checkpoint(NAME, tmp_path_factory.mktemp("plain"))
    packed, dequantized = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("dq")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(plain / "model.safetensors")
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    ground = {}
    for name, tensor in tensors.items():
        if name.endswith(EXPERTS):  # [experts, inputs, outputs]: stored by output rows
            blocks, scales = quantize(tensor.transpose(1, 2))
            shards[0][f"{name}_blocks"], shards[1][f"{name}_scales"] = blocks, scales
            ground[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            shards[0][name] = ground[name] = tensor
    index = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, packed / file, metadata={"format": "pt"})
        index |= {name: file for name in shard}
    (packed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    save_file(ground, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    (dequantized / "config.json").write_text(json.dumps(config))
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    for out in (packed, dequantized):
        build_tokenizer(out)
    return packed, dequantized


def test_mxfp4_dequantizes_as_transformers_does():
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 2), dtype=torch.uint8)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 8]
    # the pair arrives in either order, among other tensors
    stream = iter([("a_scales", scales), ("other", torch.ones(2)), ("a_blocks", blocks)])
    got = dict(mxfp4.dequantized(stream))
    assert list(got) == ["other", "a"]
    assert got["a"].dtype == torch.bfloat16 and torch.equal(got["a"].float(), want)


def test_an_mxfp4_checkpoint_serves_hf_tokens_on_its_dequantized_weights(checkpoints):
    """HF on the weights transformers' conversion dequantizes: our engine on the MXFP4 file
    gives its logits (1e-4) and greedy tokens, on the reference and the paged executor."""
    packed, dequantized = checkpoints
    cfg = load_model_config(packed)
    assert cfg.gpt_oss is not None and cfg.gpt_oss.mxfp4
    hf = hf_model(dequantized)
    ids = torch.tensor(PROMPTS[0])
    ours = load_model(packed, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = ours.logits(ours(ids, torch.arange(len(ids)), DenseKV(ours.cfg.num_layers)))
    assert (got - want).abs().max().item() < 1e-4
    expected = [hf_greedy(hf, p, 24) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    knobs = {"page_size": 4, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 16}
    for executor in ("reference", "paged"):
        llm = LLM(str(packed), executor=executor, dtype="float32", enforce_eager=True, **knobs)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, executor


def test_a_pair_without_its_half_or_of_a_wrong_shape_is_refused():
    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    with pytest.raises(ModelLoadError, match="without their blocks or scales: w_blocks"):
        list(mxfp4.dequantized(iter([("w_blocks", blocks)])))
    scales = torch.zeros(2, 4, 2, dtype=torch.uint8)
    pair = iter([("w_blocks", blocks), ("w_scales", scales)])
    with pytest.raises(ModelLoadError, match=r"MXFP4 tensor 'w': .* do not match"):
        list(mxfp4.dequantized(pair))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized with 'fp8'"),
        ({"sliding_window": None}, "without a sliding_window"),
        ({"layer_types": ["full_attention"] * 3}, "without sliding-window layers"),
        ({"attention_bias": False}, "attention_bias=false"),
    ],
)
def test_what_it_cannot_serve_is_refused_by_name(tmp_path, change, message):
    model = build_checkpoint(NAME, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(model)
