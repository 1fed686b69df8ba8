"""Tiny llama GGUF files written with `gguf.GGUFWriter`, for the conversion and gguf-weights
tests."""

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, which the converter must undo."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    ffn_qtype: gguf.GGMLQuantizationType | None = None,
    untied: bool = False,
    hidden: int = HIDDEN,
    proj_qtype: gguf.GGMLQuantizationType | None = None,
    head_dim: int | None = None,
    experts: tuple[int, int, int] | None = None,
) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF of `arch` (llama; qwen3: q/k norms, q/k rows not permuted;
    qwen3moe: with experts); return the float32 HF-layout weights it should convert to.
    ffn_qtype: ffn_up's type, its data zeros; proj_qtype: every projection's, quantized;
    head_dim: where not hidden / heads (qwen3's); experts: (count, used, FFN of each)."""
    rng = np.random.default_rng(0)
    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt"]
    dim = head_dim or hidden // HEADS
    ref: dict[str, np.ndarray] = {}
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name("tiny")
    for add, value in [
        (w.add_block_count, LAYERS),
        (w.add_context_length, 64),
        (w.add_embedding_length, hidden),
        (w.add_feed_forward_length, FFN),
        (w.add_head_count, HEADS),
        (w.add_head_count_kv, KV_HEADS),
        (w.add_rope_dimension_count, dim),
        (w.add_vocab_size, len(tokens)),
        (w.add_bos_token_id, 1),
        (w.add_eos_token_id, 2),
        (w.add_pad_token_id, 2),
        (w.add_unk_token_id, 0),
    ]:
        add(value)
    if arch != "llama":
        w.add_key_length(dim)
        w.add_value_length(dim)
    if experts is not None:
        w.add_expert_count(experts[0])
        w.add_expert_used_count(experts[1])
        w.add_expert_feed_forward_length(experts[2])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    embed = rng.standard_normal((len(tokens), hidden), dtype=np.float32)
    q8 = gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    ref["model.embed_tokens.weight"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        "attn_q": ("self_attn.q_proj", (HEADS * dim, hidden)),
        "attn_k": ("self_attn.k_proj", (KV_HEADS * dim, hidden)),
        "attn_v": ("self_attn.v_proj", (KV_HEADS * dim, hidden)),
        "attn_output": ("self_attn.o_proj", (hidden, HEADS * dim)),
        "attn_norm": ("input_layernorm", (hidden,)),
        "ffn_norm": ("post_attention_layernorm", (hidden,)),
    }
    if arch != "llama":
        shapes["attn_q_norm"] = ("self_attn.q_norm", (dim,))
        shapes["attn_k_norm"] = ("self_attn.k_norm", (dim,))
    if experts is None:
        shapes["ffn_gate"] = ("mlp.gate_proj", (FFN, hidden))
        shapes["ffn_up"] = ("mlp.up_proj", (FFN, hidden))
        shapes["ffn_down"] = ("mlp.down_proj", (hidden, FFN))
    else:
        count, _, each = experts
        shapes["ffn_gate_inp"] = ("mlp.gate", (count, hidden))
        shapes["ffn_gate_exps"] = ("gate_proj", (count, each, hidden))
        shapes["ffn_up_exps"] = ("up_proj", (count, each, hidden))
        shapes["ffn_down_exps"] = ("down_proj", (count, hidden, each))
    for layer in range(LAYERS):
        for gguf_name, (hf_name, shape) in shapes.items():
            x = rng.standard_normal(shape, dtype=np.float32)
            heads = (
                {"attn_q": HEADS, "attn_k": KV_HEADS}.get(gguf_name) if arch == "llama" else None
            )
            stored = x if heads is None else _permute(x, heads)
            if proj_qtype is not None and len(shape) >= 2 and gguf_name != "ffn_gate_inp":
                data = gguf.quants.quantize(stored, proj_qtype)
                x = gguf.quants.dequantize(gguf.quants.quantize(x, proj_qtype), proj_qtype)
                w.add_tensor(f"blk.{layer}.{gguf_name}.weight", data, raw_dtype=proj_qtype)
            elif gguf_name == "ffn_up" and ffn_qtype is not None:
                raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, ffn_qtype), np.uint8)
                w.add_tensor(f"blk.{layer}.{gguf_name}.weight", raw, raw_dtype=ffn_qtype)
            else:
                w.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(stored))
            if len(shape) == 3:  # an expert's matrix each
                for e in range(shape[0]):
                    ref[f"model.layers.{layer}.mlp.experts.{e}.{hf_name}.weight"] = x[e]
            else:
                ref[f"model.layers.{layer}.{hf_name}.weight"] = x
    ref["model.norm.weight"] = rng.standard_normal((hidden,), dtype=np.float32)
    w.add_tensor("output_norm.weight", ref["model.norm.weight"])
    if untied:
        ref["lm_head.weight"] = rng.standard_normal((len(tokens), hidden), dtype=np.float32)
        w.add_tensor("output.weight", ref["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
