"""`--quantization gguf`: a GGUF file's own Q4_1 and Q8_0 matrices, served as they are stored.

llama.cpp runs a Q4_1 file's matrices as Q4_1. The conversion (gguf_convert.py) dequantizes
them for the Hugging Face directory, and `--quantization int4` would quantize those bf16
values a second time. Instead the conversion keeps each Q4_1 / Q8_0 matrix's stored parts
(`BLOCKS_FILE`: 4-bit or int8 values, an fp16 scale and, for Q4_1, an fp16 minimum per row and
32 inputs) when every matrix the model multiplies by is one of the two, and here they become
the native decode step's records exactly (`q4_records`, `q8_records`: the same formats, 16
rows to a record), fused as the model fuses its projections (q/k/v, gate/up), the tied head
taking the embedding's. The step then computes what llama.cpp computes for a token (int8
activations per 32 inputs, the file's weights); wider steps multiply by the dequantized bf16
weights as int4's do. `auto`, the default, takes this wherever the native step runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from pypto_serving.errors import ModelLoadError
from pypto_serving.models.gguf_convert import BLOCKS_FILE
from pypto_serving.ops.linear import NATIVE_Q4, NATIVE_Q8, Linear, q4_records, q8_records


def has_blocks(model_dir: Path) -> bool:
    """Whether `model_dir` is a GGUF conversion whose every multiplied matrix was kept as
    stored (Q4_1 or Q8_0)."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return any(True for _ in f.keys())  # noqa: SIM118 (a safe_open has no __iter__)
    except (OSError, ValueError):
        return False


def stored_records(
    model: nn.Module, model_dir: Path, fused: dict[str, tuple[str, int]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Each Linear's records by module name, in `Linear.quantized_tensors`' form ({"native.F":
    records}), made from the stored matrices of its checkpoint tensors (`fused`: the loader's
    map of HF projections onto fused Linears; a tied head takes the embedding's)."""
    stored = load_file(str(Path(model_dir) / BLOCKS_FILE))
    parts_of: dict[str, list[tuple[int, str]]] = {}
    for hf, (target, index) in fused.items():
        parts_of.setdefault(target, []).append((index, hf))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        sources = [f"{name}.weight"]
        if leaf in parts_of:
            sources = [f"{name[: -len(leaf)]}{hf}.weight" for _, hf in sorted(parts_of[leaf])]
        elif leaf == "lm_head" and f"{name}.weight.q" not in stored:
            sources = ["model.embed_tokens.weight"]  # tied
        missing = [s for s in sources if f"{s}.q" not in stored]
        kinds = {f"{s}.min" in stored for s in sources}
        if missing or len(kinds) != 1:
            raise ModelLoadError(
                f"{BLOCKS_FILE} in {model_dir} has no single stored form for {name} "
                f"({', '.join(missing) or 'Q4_1 and Q8_0 parts'}): drop --quantization gguf"
            )
        q = torch.cat([stored[f"{s}.q"] for s in sources])
        scale = torch.cat([stored[f"{s}.scale"] for s in sources])
        if q.shape != (layer.out_features, layer.in_features):
            raise ModelLoadError(
                f"{BLOCKS_FILE} in {model_dir}: {name} is {tuple(q.shape)}, the model's "
                f"{(layer.out_features, layer.in_features)}"
            )
        if kinds == {True}:
            low = torch.cat([stored[f"{s}.min"] for s in sources])
            out[name] = {f"native.{NATIVE_Q4}": q4_records(q, scale, low)}
        else:
            out[name] = {f"native.{NATIVE_Q8}": q8_records(q, scale)}
    return out
