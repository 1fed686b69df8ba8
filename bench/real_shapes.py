#!/usr/bin/env python
"""Random-weight checkpoints at the shapes people run on CPUs (issue 47), for speed figures.

Each shape is written once, cached under ~/.cache/pypto-serving/shapes/<shape>/, as
- `hf/`: a Hugging Face directory (config.json, bfloat16 safetensors in shards, the default
  model's tokenizer), for us and vLLM;
- `model-<TYPE>.gguf` (TYPE: F32, F16, Q8_0 or Q4_1): the same weights as a GGUF file written
  by the `gguf` package (a llama's q/k rows permuted as llama.cpp's converter does, a MoE's
  experts stacked, the tokenizer copied from the default model's GGUF), for llama.cpp and for
  us: the very same file. Q4_1 files keep the embedding in Q8_0, the norms and a MoE's router
  in F32, as llama.cpp's own Q4_1 conversions do. The `gguf` package quantizes
  Q4_0/Q4_1/Q5_x/Q8_0 itself; K-quants (Q4_K) it cannot write.

Every shape uses SmolLM2's vocabulary (49,152 tokens) so that one tokenizer serves all engines
and llama.cpp reads the file (it wants the token list and the embedding to agree): the
embedding and LM head are smaller than the published models' where their vocabulary is larger
(llama-8b: 201 M parameters instead of 525 M each). The weights are N(0, 0.02) from a seed per
tensor name (norms ones), so every writer of a shape writes the same values.

    python bench/real_shapes.py --shape llama-1b --gguf Q4_1     # prints the paths
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE = Path.home() / ".cache" / "pypto-serving" / "shapes"
VOCAB = 49152
"""SmolLM2's vocabulary, used by every shape (see above)."""
SHARD_BYTES = 2 << 30
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_1")


@dataclass(frozen=True)
class Shape:
    """A decoder's published dimensions (the vocabulary aside: VOCAB)."""

    arch: str
    """llama, qwen3 or qwen3_moe (transformers' model_type)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int | None = None
    """None: hidden / heads."""
    tie: bool = True
    rope_theta: float = 10000.0
    context: int = 8192
    std: float = 0.02
    """Of the random weights (the tiny test shape's are larger, so that its outputs depend
    sharply on every weight)."""
    experts: int = 0
    """A MoE's experts per layer (qwen3_moe; 0: a dense MLP of `ffn`)."""
    experts_used: int = 0
    expert_ffn: int = 0

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def parameters(self) -> int:
        attn = self.hidden * self.dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        if self.experts:
            mlp = self.experts * (3 * self.hidden * self.expert_ffn + self.hidden)
        head = 0 if self.tie else VOCAB * self.hidden
        return self.layers * (attn + mlp) + VOCAB * self.hidden + head


SHAPES = {
    # the issue's 1B llama shape (Llama-3.2-1B's layers, SmolLM2's vocabulary)
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 8192, tie=True, rope_theta=500000.0),
    # Llama-3.1-8B's layers
    "llama-8b": Shape("llama", 4096, 32, 32, 8, 14336, tie=False, rope_theta=500000.0),
    # Qwen3-4B's layers (q/k norms; head_dim 128)
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 9728, head_dim=128, rope_theta=1000000.0),
    # Qwen3-30B-A3B's layers (128 experts of FFN 768, 8 used a token), 8 of its 48: 5.1 B
    # parameters, 0.44 B of them used a token
    "qwen3-moe-small": Shape(
        "qwen3_moe",
        2048,
        8,
        32,
        4,
        6144,
        head_dim=128,
        tie=False,
        rope_theta=1000000.0,
        experts=128,
        experts_used=8,
        expert_ffn=768,
    ),
    # tiny ones, for tests of this script
    "llama-tiny": Shape("llama", 64, 2, 4, 2, 128, tie=False, std=0.3),
    "qwen3-moe-tiny": Shape(
        "qwen3_moe",
        64,
        2,
        4,
        2,
        128,
        head_dim=32,
        tie=False,
        std=0.3,
        experts=4,
        experts_used=2,
        expert_ffn=32,
    ),
}


def tensor_names(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every HF tensor of the shape: (name, shape), in file order."""
    h, d = shape.hidden, shape.dim
    yield "model.embed_tokens.weight", (VOCAB, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (shape.heads * d, h)
        yield p + "self_attn.k_proj.weight", (shape.kv_heads * d, h)
        yield p + "self_attn.v_proj.weight", (shape.kv_heads * d, h)
        yield p + "self_attn.o_proj.weight", (h, shape.heads * d)
        if shape.arch != "llama":
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        yield p + "post_attention_layernorm.weight", (h,)
        if shape.experts:
            yield p + "mlp.gate.weight", (shape.experts, h)
            for e in range(shape.experts):
                yield p + f"mlp.experts.{e}.gate_proj.weight", (shape.expert_ffn, h)
                yield p + f"mlp.experts.{e}.up_proj.weight", (shape.expert_ffn, h)
                yield p + f"mlp.experts.{e}.down_proj.weight", (h, shape.expert_ffn)
            continue
        yield p + "mlp.gate_proj.weight", (shape.ffn, h)
        yield p + "mlp.up_proj.weight", (shape.ffn, h)
        yield p + "mlp.down_proj.weight", (h, shape.ffn)
    yield "model.norm.weight", (h,)
    if not shape.tie:
        yield "lm_head.weight", (VOCAB, h)


def weight(name: str, dims: tuple[int, ...], std: float):  # -> torch.Tensor (bfloat16)
    """The tensor's values: ones for a norm, else N(0, std) from a seed of its name."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed >> 1)
    return (torch.randn(dims, generator=g) * std).to(torch.bfloat16)


def hf_config(shape: Shape) -> dict[str, object]:
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = {
        "vocab_size": VOCAB,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.dim,
        "max_position_embeddings": shape.context,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": shape.tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if shape.experts:
        common |= {
            "num_experts": shape.experts,
            "num_experts_per_tok": shape.experts_used,
            "moe_intermediate_size": shape.expert_ffn,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    kind = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[shape.arch]
    out = kind(**common).to_dict()
    out["architectures"] = [ARCHITECTURES[shape.arch][1]]
    return out


def tokenizer_source() -> Path:
    from pypto_serving.models.default_model import resolve_model_path

    return resolve_model_path("default")


def write_hf(shape: Shape, out: Path) -> Path:
    """The shape as a Hugging Face directory at `out` (built beside it, then renamed)."""
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = tokenizer_source()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    shard: dict = {}
    index: dict[str, str] = {}
    size, number = 0, 0

    def flush() -> None:
        nonlocal shard, size, number
        if shard:
            number += 1
            file = f"model-{number:05d}.safetensors"
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, file))
            shard, size = {}, 0

    for name, dims in tensor_names(shape):
        t = weight(name, dims, shape.std)
        if size + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name] = t
        size += t.numel() * 2
    flush()
    total = sum(2 * math.prod(d) for _, d in tensor_names(shape))
    meta = {"metadata": {"total_size": total}, "weight_map": index}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(meta, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    (tmp / "generation_config.json").write_text(json.dumps(generation))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM"),
}
"""Each shape's arch: its GGUF architecture and its HF class."""
GGUF_NAMES = {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def permute(w, n_head: int):  # np.ndarray -> np.ndarray
    """llama.cpp's converter's q/k row order (it pairs rotary dimensions its own way)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(shape: Shape) -> Iterator[tuple[str, str, Any]]:
    """Every GGUF tensor of the shape: (GGUF name, the HF name it stands for, float32 values
    as the file holds them, an np.ndarray): a llama's q/k rows permuted, a MoE layer's
    experts stacked [experts, rows, cols] per projection."""
    import numpy as np

    stacks: dict[str, list[Any]] = {}
    for name, dims in tensor_names(shape):
        w = weight(name, dims, shape.std).float().numpy()
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.P.weight
            _, _, layer, _, _, expert, proj, _ = name.split(".")
            stacks.setdefault(proj, []).append(w)
            if int(expert) == shape.experts - 1 and proj == "down_proj":  # the layer's last
                for part, matrices in stacks.items():
                    yield f"blk.{layer}.{EXPERT_NAMES[part]}.weight", name, np.stack(matrices)
                stacks = {}
            continue
        if shape.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, shape.heads if "q_proj" in name else shape.kv_heads)
        yield gguf_name(name), name, w


def write_gguf(shape: Shape, kind: str, out: Path) -> Path:
    """The shape as a GGUF file of `kind` at `out` (written beside, renamed)."""
    import gguf
    import numpy as np

    from pypto_serving.models.default_model import find_default_gguf

    if out.exists():
        return out
    qtype = gguf.GGMLQuantizationType[kind]
    arch = ARCHITECTURES[shape.arch][0]
    out.parent.mkdir(parents=True, exist_ok=True)  # a GGUF may be written without the HF folder
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.dim)
    if arch != "llama":
        writer.add_key_length(shape.dim)
        writer.add_value_length(shape.dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    file_types = {"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 7}
    writer.add_file_type(file_types[kind])
    reader = gguf.GGUFReader(str(find_default_gguf()))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            kinds = field.types
            if kinds[0] == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, kinds[0])
    for name, hf, w in gguf_tensors(shape):
        if w.ndim == 1 or kind == "F32" or hf.endswith("mlp.gate.weight"):  # as llama.cpp's
            tensor_type, data = gguf.GGMLQuantizationType.F32, w.astype(np.float32)
        elif kind == "F16":
            tensor_type, data = gguf.GGMLQuantizationType.F16, w.astype(np.float16)
        else:
            tensor_type = qtype
            if kind == "Q4_1" and hf == "model.embed_tokens.weight":
                tensor_type = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(w, tensor_type)
        writer.add_tensor(name, data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.rename(out)
    return out


def checkpoint(name: str, gguf_kind: str | None = None) -> tuple[Path, Path | None]:
    """The shape's HF directory and (if asked) its GGUF file, written on first use."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    if gguf_kind is not None and gguf_kind not in GGUF_TYPES:
        raise SystemExit(f"unknown GGUF type {gguf_kind!r}; choose from {', '.join(GGUF_TYPES)}")
    shape, folder = SHAPES[name], CACHE / name
    hf = write_hf(shape, folder / "hf")
    file = write_gguf(shape, gguf_kind, folder / f"model-{gguf_kind}.gguf") if gguf_kind else None
    return hf, file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--gguf", choices=GGUF_TYPES, help="also write a GGUF file of this type")
    args = p.parse_args(argv)
    hf, file = checkpoint(args.shape, args.gguf)
    shape = SHAPES[args.shape]
    print(f"{args.shape}: {shape.parameters() / 1e9:.2f} B parameters")
    print(f"hf: {hf}")
    if file is not None:
        print(f"gguf: {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
