"""Tiny random Hugging Face checkpoints, built with transformers at test time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# name -> (architecture, config overrides); several shapes: GQA ratios, tied/untied, biases,
# head_dim != hidden/heads for Qwen3, rope scaling.
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa4-tied": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama-mha-untied": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    "qwen2-gqa2": (
        "qwen2",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "qwen3-hd32-gqa4": (
        "qwen3",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3moe-e4-top2": (  # layer 0 mixture of experts, layer 1 dense
        "qwen3_moe",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-hd8-untied": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False),
    ),
}

# DeepSeek (MLA + grouped MoE) shapes: kept apart from TINY, which every HF-equality and
# paged test runs over; tests/test_deepseek.py runs these.
MLA = dict(num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8)
DS_MOE = dict(n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=2)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, rope_theta=1e4)
TINY_DEEPSEEK: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseekv3-qlora-yarn": (  # dense layer 0, MoE 1-2: 4 groups, the best 2 kept
        "deepseek_v3",
        dict(
            **MLA,
            **DS_MOE,
            num_hidden_layers=3,
            q_lora_rank=24,
            v_head_dim=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
        ),
    ),
    "deepseekv3-noqlora-bias": (  # no q_lora_rank, rotate-half RoPE, biases, all MoE
        "deepseek_v3",
        dict(
            **MLA,
            **DS_MOE,
            q_lora_rank=None,
            v_head_dim=24,
            n_group=2,
            topk_group=1,
            n_shared_experts=2,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    "deepseekv3-yarn-2dense": (  # two dense layers, yarn with mscale = mscale_all_dim
        "deepseek_v3",
        dict(
            **MLA,
            **DS_MOE,
            num_hidden_layers=4,
            q_lora_rank=16,
            v_head_dim=8,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=2,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
    ),
    "deepseekv2-group-limited": (  # V2: softmax routing limited to the best group
        "deepseek_v2",
        dict(
            **MLA,
            **DS_MOE,
            q_lora_rank=None,
            v_head_dim=16,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.0,
        ),
    ),
}

# DeepSeek-V4 (sliding window + compressed caches, hyper-connections, hash and scored MoE):
# tests/test_deepseek_v4.py runs these.
V4 = dict(
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    max_position_embeddings=4096,  # room for a long generation over the window
)
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
TINY_DEEPSEEK_V4: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseekv4-swa-csa-hca-hash": (  # window 8, CSA 4:1 top 2, HCA 8:1; a hash layer first
        "deepseek_v4",
        dict(
            **V4,
            num_hidden_layers=3,
            layer_types=[SWA, CSA, HCA],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 8},
            sliding_window=8,
            index_topk=2,
            hc_mult=2,
            hc_sinkhorn_iters=4,  # the default's 20 here: a quarter of its cold compile
        ),
    ),
    "deepseekv4-hca-csa-yarn-nohash": (  # HCA first, window 6, YaRN, Sinkhorn's default 20
        "deepseek_v4",
        dict(
            **V4,
            num_hidden_layers=3,
            layer_types=[HCA, CSA, CSA],
            mlp_layer_types=["moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 16},
            sliding_window=6,
            index_topk=3,
            hc_mult=3,
            scoring_func="sigmoid",
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    "deepseekv4-csa2-window5-2hash": (  # a short window, 2:1 CSA, two hash layers
        "deepseek_v4",
        dict(
            **V4,
            num_hidden_layers=4,
            layer_types=[CSA, SWA, HCA, CSA],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={CSA: 2, HCA: 8},
            sliding_window=5,
            index_topk=4,
            hc_mult=2,
            hc_sinkhorn_iters=3,
        ),
    ),
}

# Sliding-window models (windows shorter than the prompts): tests/test_sliding_window.py runs
# these.
TINY_WINDOW: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window8": (  # every layer windowed; head_dim != hidden / heads
        "mistral",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            tie_word_embeddings=False,
            max_position_embeddings=4096,  # room for a long generation over the window
        ),
    ),
    "mistral-window13-mha": (  # a window across page boundaries, MHA, tied
        "mistral",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=13,
            num_hidden_layers=3,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-window6-from1": (  # layer 0 full, layers 1-2 windowed (max_window_layers 1)
        "qwen3",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-local5-global": (  # local, global, local: each its RoPE base; query scale 1/sqrt(24)
        "gemma3_text",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=3.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-global-first-mqa": (  # a global layer first, one KV head, the default pattern
        "gemma3_text",
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            num_hidden_layers=2,
            sliding_window=9,
            layer_types=["full_attention", "sliding_attention"],
            query_pre_attn_scalar=32,
            tie_word_embeddings=True,
        ),
    ),
    "gptoss-window6-yarn": (  # sliding, full, sliding; sinks, 4 experts top 2, YaRN
        "gpt_oss",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=6,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "gptoss-full-first-mqa": (  # full, sliding; one KV head, 8 experts top 3, a tight clamp
        "gpt_oss",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention"],
            num_local_experts=8,
            num_experts_per_tok=3,
            intermediate_size=32,
            swiglu_limit=1.0,
            swiglu_alpha=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "qwen2-window11-from1": (  # Qwen2's biases; layer 0 full, layer 1 windowed
        "qwen2",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=11,
            max_window_layers=1,
            tie_word_embeddings=False,
        ),
    ),
}

WIDE: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-wide": (  # dims where the GEMMs' blocking shows (batch-invariance tests)
        "llama",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
}

SPLIT8: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe-e8-kv4": (  # heads, KV heads and MLP split 4 ways, 8 experts: DP 2 x TP 4 x EP
        "qwen3_moe",
        {**TINY["qwen3moe-e4-top2"][1], "num_key_value_heads": 4, "num_experts": 8},
    ),
    "deepseekv4-split8": (  # heads and output groups split 4 ways, 8 experts: DP 2 x TP 4 x EP
        "deepseek_v4",
        {
            **TINY_DEEPSEEK_V4["deepseekv4-swa-csa-hca-hash"][1],
            "num_attention_heads": 8,
            "o_groups": 4,
            "n_routed_experts": 8,
        },
    ),
}

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


MTP_SOURCE = (  # deepseekv3-qlora-yarn with a fourth layer, which becomes its MTP layer
    "deepseek_v3",
    {**TINY_DEEPSEEK["deepseekv3-qlora-yarn"][1], "num_hidden_layers": 4},
)


def build_mtp_checkpoint(out: Path, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 (3 layers, as deepseekv3-qlora-yarn) with a multi-token prediction
    layer after them, as the released checkpoints ship it: `model.layers.3.*` (a MoE decoder
    layer) with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head` and its
    own `embed_tokens`; config num_hidden_layers 3, num_nextn_predict_layers 1."""
    import json

    from safetensors.torch import load_file, save_file

    build_checkpoint("deepseekv3-mtp-source", out, seed)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    size = BASE["hidden_size"]
    layer = "model.layers.3."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{layer}{norm}.weight"] = 1 + 0.1 * torch.randn(size, generator=gen)
    weights[f"{layer}eh_proj.weight"] = (
        torch.randn(size, 2 * size, generator=gen) / (2 * size) ** 0.5
    )
    weights[f"{layer}shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights[f"{layer}embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_checkpoint(name: str, out: Path, seed: int = 0, grid: bool = False) -> Path:
    """Write a random checkpoint `name` (a key of TINY) into `out` (config + safetensors).
    grid: its matrices (embeddings, projections) hold values (q - 8) / 64 for q in 0..15,
    each group of 32 inputs spanning 0 to 15, which int4 quantization keeps exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, overrides = {
        "deepseekv3-mtp-source": MTP_SOURCE,
        **TINY,
        **TINY_DEEPSEEK,
        **TINY_DEEPSEEK_V4,
        **TINY_WINDOW,
        **WIDE,
        **SPLIT8,
    }[name]
    config = AutoConfig.for_model(family, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases are zero-initialised; make them matter
        for pname, p in model.named_buffers():
            if pname.endswith("e_score_correction_bias"):  # DeepSeek-V3's router
                p.copy_(torch.randn_like(p) * 0.1)
            elif pname.endswith("tid2eid"):  # DeepSeek-V4's hash layers: distinct experts
                experts = config.n_routed_experts
                p.copy_(torch.stack([torch.randperm(experts)[: p.shape[1]] for _ in p]))
        for pname, p in model.named_parameters():
            if pname.endswith(("sinks", "position_bias", "hc.base", "hc_base")):
                p.copy_(torch.randn_like(p) * 0.5)  # DeepSeek-V4's zero-initialised ones
            elif pname.endswith(("hc.scale", "hc_scale")):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
            elif pname.endswith("mlp.gate.weight") and "deepseek" in family:
                p.mul_(20)  # routing scores far apart: no near-tie for rounding to flip
            elif pname.endswith("mlp.router.weight"):
                p.mul_(20)  # gpt-oss's router: the same
            elif pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.mul_(10)  # gpt-oss's experts: outputs that matter, gates the clamp reaches
            elif any(f"{x}.weight" in pname for x in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")):
                p.mul_(4)  # MLA: attention far from uniform, so its scale and RoPE matter
            elif grid and p.dim() == 2 and p.shape[1] % 32 == 0:
                q = torch.randint(0, 16, p.shape)
                q[:, ::32], q[:, 1::32] = 0, 15
                p.copy_((q - 8) / 64)
    model.save_pretrained(out)
    return out


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


HERMES_TOOLS = (  # a Qwen2.5-style template: tools, <tool_call> blocks, <tool_response>
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}\n{% endif %}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% if not loop.last %}\n{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 320, hermes: bool = False) -> None:
    """A byte-level BPE tokenizer of `vocab_size` tokens with a ChatML template, saved to out;
    `hermes`: Qwen's tool calling instead (the template above, and `<tool_call>` and
    `</tool_call>` as added tokens that are not special, as Qwen's are)."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "the quick brown fox jumps over the lazy dog " * 4,
        "hello world, what is the capital of france? paris is. " * 4,
    ]
    bpe = ByteLevelBPETokenizer()
    specials = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    tags = ["<tool_call>", "</tool_call>"] if hermes else []
    bpe.train_from_iterator(
        corpus, vocab_size=vocab_size - len(tags), special_tokens=specials, show_progress=False
    )
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<unk>",
    )
    tok.chat_template = HERMES_TOOLS if hermes else CHATML
    tok.save_pretrained(out)


def build_hermes_model(out: Path) -> Path:
    """A tiny Qwen3 whose tokenizer has Qwen's tool calling (build_tokenizer's hermes), with
    room for a prompt that lists tools (2,048 positions)."""
    build_checkpoint("qwen3-hd32-gqa4", out)
    build_tokenizer(out, hermes=True)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    return out


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt` (EOS not special): the ground truth."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_model(path: Path) -> Any:
    """The checkpoint in HF transformers, float32, for ground truth."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_expected(
    tiny_model: Callable[[str], Path], prompts: list[list[int]], max_new_tokens: int
) -> Callable[[str], list[list[int]]]:
    """expected(name): HF's greedy continuation of each prompt on checkpoint `name` (made
    once per name)."""
    made: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in made:
            hf = hf_model(tiny_model(name))
            made[name] = [hf_greedy(hf, p, max_new_tokens) for p in prompts]
        return made[name]

    return get


def token_ids(outputs: list[Any]) -> list[list[int]]:
    """Each RequestOutput's first sample's token ids."""
    return [o.outputs[0].token_ids for o in outputs]


def assert_top5_rule(expected: list[Any], got: list[Any]) -> int:
    """The bf16 equality rule over two runs' RequestOutputs (greedy, logprobs=5): each
    sequence's tokens are equal, or where they first diverge each side's token is in the
    other's top 5 (after that the contexts differ). Returns how many sequences diverged."""
    diverged = 0
    for a, b in zip(expected, got, strict=True):
        ours, theirs = a.outputs[0], b.outputs[0]
        for i, (x, y) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True)):
            if x != y:
                assert y in ours.logprobs[i].top_logprobs and x in theirs.logprobs[i].top_logprobs
                diverged += 1
                break
    return diverged


def assert_prompt_logprobs_near(got: list[Any], want: list[Any], share: float) -> None:
    """Each request's prompt logprobs in `got` within `share` of the largest in `want` (plus
    0.05): what a quantization's error allows, where a wrong weight moves them by whole
    units."""
    for got_out, want_out in zip(got, want, strict=True):
        found = torch.tensor([s.logprob for s in got_out.prompt_logprobs[1:]])
        expected = torch.tensor([s.logprob for s in want_out.prompt_logprobs[1:]])
        assert (found - expected).abs().max() < share * expected.abs().max() + 0.05, (
            found,
            expected,
        )


def fake_kv_store(num_pages: int, page_size: int, **options: Any) -> Any:
    """The KV of one full-attention group for tests without a model: one layer, one KV head
    of dim 2 (room for a token's fake KV, (token id, position)), fp32 on the CPU. `options`:
    the pool's (prefix caching, tiers)."""
    from pypto_serving.kv.paged_cache import PagedCache
    from pypto_serving.kv.spec import KVSpec

    spec = KVSpec("gqa", 1, 1, 2, 2, page_size, torch.float32, num_tensors=2)
    return one_group(PagedCache(spec, num_pages, torch.device("cpu")), **options)


def one_group(cache: Any, **options: Any) -> Any:
    """`KVGroups` of one full-attention group over a pool of `cache`'s pages (`options`: the
    pool's)."""
    from pypto_serving.kv.groups import KVGroups
    from pypto_serving.kv.manager import KVManager
    from pypto_serving.kv.pool import KVPool

    return KVGroups([KVManager(cache.spec.kind, KVPool(cache, **options))])


def hash_chain(token_ids: list[int], page_size: int, salt: str | None = None) -> list[bytes]:
    """The prefix-cache hash chain over the full pages of `token_ids`."""
    from pypto_serving.kv.page_pool import hash_page

    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash_page(parent, token_ids[start : start + page_size], salt)
        hashes.append(parent)
    return hashes


def dequantize(records: torch.Tensor, fmt: int, rows: int, cols: int) -> torch.Tensor:
    """The weight [rows, cols] the records hold, in float64 (their layout read back)."""
    groups, blocks = cols // 32, -(-rows // 16)
    if fmt == 1:  # NATIVE_Q4 (ops/linear.py); else NATIVE_Q8
        rec = records.view(blocks, groups, 320)
        nib = rec[..., :256].reshape(blocks, groups, 4, 16, 4).long()
        q = torch.cat([nib & 15, nib >> 4], -1)  # [B, G, c, 16, 8]: inputs 8c .. 8c + 7
        q = q.permute(0, 3, 1, 2, 4).reshape(blocks * 16, groups, 32)
        scale, low = (
            rec[..., 256 + 32 * i : 288 + 32 * i].contiguous().view(torch.float16) for i in range(2)
        )
        scale, low = (t.permute(0, 2, 1).reshape(-1, groups, 1).double() for t in (scale, low))
        return (q * scale + low).reshape(-1, cols)[:rows]
    rec = records.view(blocks, groups, 544)
    q = rec[..., :512].reshape(blocks, groups, 8, 16, 4).long() - 128
    q = q.permute(0, 3, 1, 2, 4).reshape(blocks * 16, groups, 32)
    scale = rec[..., 512:].contiguous().view(torch.float16).permute(0, 2, 1)
    return (q * scale.reshape(-1, groups, 1).double()).reshape(-1, cols)[:rows]


def build_embedding_model(out: Path, pooling: str = "lasttoken") -> Path:
    """A tiny Qwen3-Embedding-style model: the decoder saved alone (`Qwen3Model`: no LM head,
    names without `model.`, tied embeddings), a tokenizer, and a sentence-transformers pooling
    config (`pooling`: lasttoken, mean_tokens or cls_token)."""
    from transformers import AutoModel

    causal = out / "causal"
    build_checkpoint("qwen3-hd32-gqa4", causal)
    AutoModel.from_pretrained(causal, dtype=torch.float32).save_pretrained(out)
    build_tokenizer(out)
    (out / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{pooling}": True}))
    return out


MISTRAL_TOOLS = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}[TOOL_CALLS]"
    "{{ m['tool_calls'] | map(attribute='function') | list | tojson }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)
"""A Mistral-style chat template: tools in [AVAILABLE_TOOLS], calls after [TOOL_CALLS]."""
LLAMA3_TOOLS = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if loop.last and m['role'] == 'user' and tools %}Answer with a JSON function call "
    '{"name": function name, "parameters": its arguments} of one of these: '
    "{{ tools | tojson }}\n{% endif %}"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Llama-3-style chat template: calls written as {"name": ..., "parameters": ...}."""


def build_tools_model(out: Path, template: str) -> Path:
    """A tiny Qwen3 whose chat template is `template`, with room for a prompt that lists
    tools (2,048 positions)."""
    from transformers import AutoTokenizer

    build_checkpoint("qwen3-hd32-gqa4", out)
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = template
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    return out
