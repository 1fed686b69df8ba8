"""ModelConfig: the few facts of a Hugging Face config.json that our model code needs."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pypto_serving.errors import ModelLoadError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM",
)
DECODER_ALONE = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
"""A decoder saved without its LM head (embedding models, Qwen3-Embedding's `Qwen3Model`):
served as its causal LM (the head tied to the embeddings), for its hidden states."""
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
DEEPSEEK_V4 = "DeepseekV4ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GPT_OSS = "GptOssForCausalLM"
WINDOWED = (
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    GEMMA3,
    GPT_OSS,
)
"""Architectures whose layers may attend within a sliding window (`_windows`)."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Gemma 3's text model (models/gemma3.py): what differs from Llama's decoder."""

    local_inv_freq: tuple[float, ...]
    """RoPE of the sliding-window (local) layers: their own base; the global layers take
    `ModelConfig.rope_inv_freq`."""
    local_rope_scaling: float
    query_scale: float
    """The attention's scale, query_pre_attn_scalar ** -0.5 (not head_dim's)."""
    embed_scale: float
    """The embeddings are multiplied by hidden_size ** 0.5 (in the weights' dtype)."""
    final_logit_softcapping: float | None
    """Logits are soft-capped to (-c, c) by c * tanh(logits / c) where set."""


@dataclass(frozen=True, slots=True)
class GptOssConfig:
    """gpt-oss (models/gpt_oss.py): what differs from the windowed Llama decoder besides its
    attention sinks and biases, which every gpt-oss has."""

    swiglu_alpha: float
    """The experts' gate activation is gate * sigmoid(alpha * gate), times (up + 1)."""
    swiglu_limit: float
    """The experts clamp their gate (above) and up (both sides) projections to it."""
    mxfp4: bool
    """The experts' weights are stored as MXFP4 blocks and scales (`models/mxfp4.py`)."""


@dataclass(frozen=True, slots=True)
class CompressedAttentionConfig:
    """DeepSeek-V4's attention and residual: per layer a sliding window over the last raw
    tokens, plus (CSA) a 4:1-style compressed cache read through a lightning indexer's top-k
    or (HCA) a heavily compressed cache read whole; manifold hyper-connections."""

    compress_ratios: tuple[int, ...]
    """Per layer: 0 (the sliding window alone), or the compression ratio of its cache."""
    indexed: tuple[bool, ...]
    """Per layer: whether its compressed cache is read through the indexer's top-k (CSA)."""
    sliding_window: int
    """Raw tokens a query sees: its own and the window - 1 before it."""
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    main_inv_freq: tuple[float, ...]
    """RoPE of the sliding-window-only layers (over qk_rope_head_dim, interleaved pairs)."""
    compress_inv_freq: tuple[float, ...]
    """RoPE of the compressed layers, their compressors and indexers (YaRN's frequencies
    where the checkpoint asks for it; cos/sin are never scaled: its attention factor is 1)."""
    hc_mult: int
    """Residual streams (manifold hyper-connections)."""
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    """Routed and shared experts clamp their gate (above) and up (both sides) projections."""
    scoring_func: str
    """The router's scores: sqrtsoftplus or sigmoid."""
    hash_layers: tuple[int, ...]
    """Layers whose experts are chosen by a fixed token-id table (tid2eid)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and behaviour of a decoder-only transformer, read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias)."""
    o_bias: bool
    """Bias on the output projection (Llama/Qwen3 when attention_bias)."""
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    rope_inv_freq: tuple[float, ...]
    rope_scaling: float
    """Multiplier on cos/sin (yarn's attention factor; 1.0 otherwise)."""
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    num_experts: int = 0
    """Routed experts of the MoE layers (0: a dense model)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to one."""
    moe_layers: tuple[int, ...] = ()
    """Layers whose MLP is the mixture of experts (the others are dense)."""
    shared_intermediate_size: int = 0
    """The MoE layers' shared experts, as one MLP of this size (DeepSeek; 0: none)."""
    router: str = "softmax"
    """Expert choice: softmax top-k (Qwen3-MoE, DeepSeek-V2 greedy), group_limited_greedy
    (DeepSeek-V2), noaux_tc (DeepSeek-V3: sigmoid scores, e_score_correction_bias) or
    topk_softmax (gpt-oss: the top k logits, then a softmax over them)."""
    n_group: int = 1
    """Routed experts form this many groups; a token picks among its topk_group best."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Multiplier on the routing weights (DeepSeek)."""
    kv_lora_rank: int = 0
    """MLA (DeepSeek): the rank of the latent KV; 0 for the other attention kinds."""
    q_lora_rank: int = 0
    """MLA: the rank of the low-rank query projection (0: a plain q_proj)."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    """MLA: each head's roped query/key part, shared by the heads on the key side."""
    v_head_dim: int = 0
    softmax_scale: float = 0.0
    """MLA: the attention's scale, qk_head_dim**-0.5 times YaRN's mscale(mscale_all_dim)²."""
    rope_interleave: bool = False
    """The checkpoint's roped dims come in pairs (DeepSeek): the loader de-interleaves them."""
    extra_layers: int = 0
    """Checkpoint layers after the decoder's (DeepSeek-V3's multi-token prediction): skipped."""
    compressed: CompressedAttentionConfig | None = None
    """DeepSeek-V4's compressed attention and hyper-connections (None for other models)."""
    gemma: GemmaConfig | None = None
    """Gemma 3's own fields (None for other models)."""
    gpt_oss: GptOssConfig | None = None
    """gpt-oss's own fields (None for other models)."""
    sliding_window: int = 0
    """Keys a windowed layer's query sees: its own and the window - 1 before it."""
    window_layers: tuple[int, ...] = ()
    """The layers that attend within `sliding_window` (Mistral: every one; Qwen2/Qwen3 with
    use_sliding_window: those from max_window_layers on); none: full attention throughout."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_max_model_len(self, max_model_len: int | None) -> None:
        """Refuse a max_model_len beyond the model's own context length, as vLLM does (its
        positions were never trained there); None takes the model's."""
        if max_model_len is not None and max_model_len > self.max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len {max_model_len} is longer than the model's context length, "
                f"{self.max_position_embeddings} (max_position_embeddings in config.json): "
                "lower --max-model-len or leave it unset",
                "max_model_len",
            )

    def parallel_shard(self, tp: int, pp: int = 1, ep: bool = False) -> ModelConfig:
        """One rank's share under tensor parallelism of `tp`: its attention heads, KV heads
        and MLP columns (vocabulary sharding is the embedding's business); checks that `pp`
        pipeline stages get a layer each (which layers is the model's business) and that
        expert parallelism (`ep`) has experts to place."""
        if ep and not self.num_experts:
            raise ModelLoadError(
                f"enable_expert_parallel needs a mixture-of-experts model; {self.architecture} "
                "is dense"
            )
        if self.num_experts and tp > 1 and not ep:
            raise ModelLoadError(
                "a mixture-of-experts model under tensor parallelism needs "
                "enable_expert_parallel (splitting each expert by columns is not supported)"
            )
        if pp > self.num_layers:
            raise ModelLoadError(
                f"pipeline_parallel_size {pp} exceeds the model's {self.num_layers} layers"
            )
        size = tp
        if size == 1:
            return self
        v4 = self.compressed
        split = [
            ("attention heads", self.num_heads),
            ("shared experts' intermediate size", self.shared_intermediate_size),
        ]
        if v4 is None:
            split += [
                ("KV heads", self.num_kv_heads),
                ("MLP intermediate size", self.intermediate_size),
            ]
        else:  # one KV head, kept whole on every rank; every layer's MLP is its experts
            split.append(("output projection's groups (o_groups)", v4.o_groups))
        for what, n in split:
            if n % size:
                raise ModelLoadError(
                    f"tensor_parallel_size {size} does not divide the model's {what} ({n})"
                )
        share = replace(
            self,
            num_heads=self.num_heads // size,
            shared_intermediate_size=self.shared_intermediate_size // size,
        )
        if v4 is not None:
            return replace(share, compressed=replace(v4, o_groups=v4.o_groups // size))
        return replace(
            share,
            num_kv_heads=self.num_kv_heads // size,
            intermediate_size=self.intermediate_size // size,
        )


def _rope(
    hf: Any, head_dim: int, params: dict[str, Any] | None = None, layer_type: str | None = None
) -> tuple[tuple[float, ...], float]:
    """RoPE's inverse frequencies over `head_dim` and its cos/sin factor, from the model's
    rope parameters (or `params`, one layer type's: DeepSeek-V4's "main" / "compress")."""
    params = dict(params if params is not None else getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return tuple(inv.tolist()), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **kwargs)
    return tuple(inv.double().tolist()), float(factor)


_read: dict[tuple[str, str], ModelConfig] = {}
"""The configs this process read or was handed, by (directory, config.json's text)."""


def _config_text(model_dir: Path) -> str:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing config.json in model directory {model_dir}")
    try:
        return path.read_text()
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"config.json in {model_dir} is not valid JSON: {e}") from None


def read_model_config(model_dir: Path) -> tuple[str, ModelConfig]:
    """config.json's text and `load_model_config`'s reading of it (for a child's spec)."""
    text = _config_text(model_dir)
    key = (str(model_dir), text)
    if key not in _read:
        _read[key] = _parse_model_config(model_dir, text)
    return text, _read[key]


def remember_model_config(model_dir: Path, read: tuple[str, ModelConfig]) -> None:
    """Take a parent's `read_model_config(model_dir)` as this process's reading of that text:
    a child process (a rank, a replica) skips transformers' config machinery (~3 s of its
    start); a config.json changed since is read anew."""
    text, cfg = read
    _read[(str(model_dir), text)] = cfg


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read and check `model_dir/config.json`; raise ModelLoadError when we cannot serve it.
    Read once per process while the file's text stays the same."""
    return read_model_config(model_dir)[1]


def _parse_model_config(model_dir: Path, text: str) -> ModelConfig:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"config.json in {model_dir} is not valid JSON: {e}") from None
    archs = [DECODER_ALONE.get(a, a) for a in raw.get("architectures") or []]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {', '.join(archs) or '(none given)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ModelLoadError(f"cannot parse config.json in {model_dir}: {e}") from None
    if getattr(hf, "mlp_bias", False):
        raise ModelLoadError("mlp_bias=true is not supported")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    inv_freq: tuple[float, ...] = ()  # DeepSeek-V4 keeps its two RoPEs in `compressed`
    rope_scaling = 1.0
    if arch == DEEPSEEK_V4:
        extra = _deepseek_v4(hf, raw)
    elif arch == GEMMA3:
        inv_freq, rope_scaling, gemma = _gemma3(hf, head_dim)
        extra = _windows(hf, arch) | {"gemma": gemma, "qk_norm": True}
    elif arch == GPT_OSS:
        inv_freq, rope_scaling = _rope(hf, head_dim)
        extra = _windows(hf, arch) | _gpt_oss(hf, raw)
    else:
        inv_freq, rope_scaling = _rope(hf, head_dim)  # DeepSeek: head_dim is qk_rope_head_dim
        extra = _deepseek(hf, raw, arch) if arch in DEEPSEEK else _moe(hf, arch)
        extra |= _windows(hf, arch)
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",  # DeepSeek: q_a/kv_a's
        o_bias=attention_bias and arch != "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        rope_inv_freq=inv_freq,
        rope_scaling=rope_scaling,
        eos_token_ids=eos_ids,
        torch_dtype=str(dtype),
    )
    return replace(cfg, **extra)


def _windows(hf: Any, arch: str) -> dict[str, Any]:
    """The sliding window and the layers it applies to: Mistral's `sliding_window` on every
    layer; Qwen2/Qwen3's with `use_sliding_window`, Gemma 3's and gpt-oss's, on the layers
    its `layer_types` marks sliding. None where the window is off or (but for Gemma 3 and
    gpt-oss, whose models are built on their windowed layers) no shorter than the model's
    positions."""
    window = getattr(hf, "sliding_window", None)
    built_on_windows = arch in (GEMMA3, GPT_OSS)
    if built_on_windows and not window:
        raise ModelLoadError(f"{arch} without a sliding_window is not supported")
    if arch not in WINDOWED or not window:
        return {}
    if window >= hf.max_position_embeddings and not built_on_windows:
        return {}
    if arch.startswith("Qwen") and not getattr(hf, "use_sliding_window", False):
        return {}
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if built_on_windows and not layers:
        raise ModelLoadError(f"{arch} without sliding-window layers is not supported")
    return {"sliding_window": int(window), "window_layers": layers} if layers else {}


def _gpt_oss(hf: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields: every layer a mixture of experts (a router with a bias, the top k of
    its logits softmaxed; experts with biases and the clamped SwiGLU), attention with biases
    and sinks; its experts' weights in MXFP4 where the checkpoint says so."""
    arch = GPT_OSS
    quantization = raw.get("quantization_config") or {}
    method = quantization.get("quant_method") if quantization else None
    if method not in (None, "mxfp4"):
        raise ModelLoadError(
            f"{arch} checkpoints quantized with {method!r} are not supported (mxfp4 is)"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{arch} with hidden_act={hf.hidden_act!r} is not supported")
    if not getattr(hf, "attention_bias", True):
        raise ModelLoadError(f"{arch} with attention_bias=false is not supported")
    experts, top_k = int(hf.num_local_experts), int(hf.num_experts_per_tok)
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"{arch}: {top_k} of {experts} experts is not a routing")
    oss = GptOssConfig(
        swiglu_alpha=float(hf.swiglu_alpha),
        swiglu_limit=float(hf.swiglu_limit),
        mxfp4=method == "mxfp4",
    )
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(hf.intermediate_size),
        "moe_layers": tuple(range(hf.num_hidden_layers)),
        "router": "topk_softmax",
        "gpt_oss": oss,
    }


def _gemma3(hf: Any, head_dim: int) -> tuple[tuple[float, ...], float, GemmaConfig]:
    """Gemma 3's global RoPE (its inverse frequencies and factor) and its own fields; what its
    modelling has and ours does not (attention logit soft-capping, bidirectional attention,
    another activation) is refused by name."""
    for key, value in (
        ("attn_logit_softcapping", None),
        ("use_bidirectional_attention", False),
        ("hidden_activation", "gelu_pytorch_tanh"),
    ):
        if getattr(hf, key, value) != value:
            raise ModelLoadError(
                f"Gemma3ForCausalLM with {key}={getattr(hf, key)!r} is not supported ({value!r})"
            )
    params = hf.rope_parameters
    inv_freq, scaling = _rope(hf, head_dim, params["full_attention"], "full_attention")
    local, local_scaling = _rope(hf, head_dim, params["sliding_attention"], "sliding_attention")
    softcap = getattr(hf, "final_logit_softcapping", None)
    gemma = GemmaConfig(
        local_inv_freq=local,
        local_rope_scaling=local_scaling,
        query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf.hidden_size) ** 0.5,
        final_logit_softcapping=None if softcap is None else float(softcap),
    )
    return inv_freq, scaling, gemma


def _moe(hf: Any, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields (Qwen3-MoE: top-k routing, no shared expert)."""
    experts = int(getattr(hf, "num_experts", 0) or 0) if arch == "Qwen3MoeForCausalLM" else 0
    if experts == 0:
        return {}
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(hf.num_experts_per_tok),
        "moe_intermediate_size": int(hf.moe_intermediate_size),
        "norm_topk_prob": bool(getattr(hf, "norm_topk_prob", False)),
        "moe_layers": tuple(
            i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0
        ),
    }


def _deepseek(hf: Any, raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V2/V3's fields: MLA, and the MoE layers after the first dense ones (routed
    experts chosen per group, shared experts beside them). What transformers' modelling does
    not do (other scoring, a MoE layer every other layer, ...) is refused by name."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if raw.get("quantization_config"):
        raise ModelLoadError(
            f"quantized {arch} checkpoints (quantization_config) are not supported; "
            "dequantize the weights first"
        )
    want = {"scoring_func": "sigmoid" if v3 else "softmax", "moe_layer_freq": 1}
    want |= {"hidden_act": "silu"} | ({"topk_method": "noaux_tc"} if v3 else {})
    for key, value in want.items():
        if raw.get(key, value) != value:
            raise ModelLoadError(f"{arch} with {key}={raw[key]!r} is not supported ({value!r})")
    router = "noaux_tc" if v3 else str(getattr(hf, "topk_method", None) or "greedy")
    if not v3 and router not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(f"{arch} with topk_method={router!r} is not supported")
    if not v3 and getattr(hf, "norm_topk_prob", False):
        raise ModelLoadError(f"{arch} with norm_topk_prob=true is not supported")
    experts = int(hf.n_routed_experts or 0)
    grouped = router != "greedy"
    n_group = int(hf.n_group or 1) if grouped else 1
    topk_group = int(hf.topk_group or n_group) if grouped else 1
    top_k = int(hf.num_experts_per_tok or 0)
    if experts and not (
        experts % n_group == 0
        and 0 < topk_group <= n_group
        and 0 < top_k <= experts * topk_group // n_group
        and (not v3 or experts // n_group >= 2)
    ):
        raise ModelLoadError(
            f"{arch}: {top_k} of {experts} experts in {n_group} groups of which {topk_group} "
            "are kept is not a routing this model can do"
        )
    dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    scale = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    softmax_scale = scale**-0.5
    params = dict(getattr(hf, "rope_parameters", None) or {})
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = float(params["factor"])
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        softmax_scale *= mscale * mscale
    moe = {}
    if experts:
        moe = {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(hf.moe_intermediate_size),
            "norm_topk_prob": bool(v3 and hf.norm_topk_prob),
            "moe_layers": tuple(range(dense, hf.num_hidden_layers)),
            "shared_intermediate_size": int(hf.moe_intermediate_size)
            * int(hf.n_shared_experts or 0),
        }
    return moe | {
        "router": router,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(hf.routed_scaling_factor),
        "head_dim": scale,
        "kv_lora_rank": int(hf.kv_lora_rank),
        "q_lora_rank": int(hf.q_lora_rank or 0),
        "qk_nope_head_dim": int(hf.qk_nope_head_dim),
        "qk_rope_head_dim": int(hf.qk_rope_head_dim),
        "v_head_dim": int(hf.v_head_dim),
        "softmax_scale": softmax_scale,
        "rope_interleave": bool(getattr(hf, "rope_interleave", True)) if v3 else True,
        "extra_layers": int(raw.get("num_nextn_predict_layers") or 0),
    }


def _deepseek_v4(hf: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V4's fields: shared-KV MQA (one KV head of head_dim, partly roped) with a
    sliding window and, per layer, a compressed cache (CSA: indexed, HCA: read whole), the
    grouped output projection, hyper-connections, and experts routed by score or by a fixed
    token table (hash layers) beside one shared expert."""
    arch = DEEPSEEK_V4
    if raw.get("quantization_config"):
        raise ModelLoadError(
            f"quantized {arch} checkpoints (quantization_config) are not supported; "
            "dequantize the weights first"
        )
    if int(getattr(hf, "num_key_value_heads", 1) or 1) != 1:
        raise ModelLoadError(f"{arch} with num_key_value_heads != 1 is not supported")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{arch} with hidden_act={hf.hidden_act!r} is not supported")
    if hf.scoring_func not in ("sqrtsoftplus", "sigmoid"):
        raise ModelLoadError(f"{arch} with scoring_func={hf.scoring_func!r} is not supported")
    n = hf.num_hidden_layers
    rates = dict(hf.compress_rates)
    ratios, indexed = [], []
    for kind in hf.layer_types:
        ratios.append(0 if kind == "sliding_attention" else int(rates[kind]))
        indexed.append(kind == "compressed_sparse_attention")
    rope = int(hf.qk_rope_head_dim)
    if rope % 2 or rope > hf.head_dim or rope > hf.index_head_dim:
        raise ModelLoadError(f"{arch}: qk_rope_head_dim {rope} does not fit its heads")
    params = hf.rope_parameters
    main_inv, _ = _rope(hf, rope, params["main"], "main")
    compress_inv, compress_scaling = _rope(hf, rope, params["compress"], "compress")
    if compress_scaling != 1.0:
        raise ModelLoadError(f"{arch} with a RoPE attention factor != 1 is not supported")
    compressed = CompressedAttentionConfig(
        compress_ratios=tuple(ratios),
        indexed=tuple(indexed),
        sliding_window=int(hf.sliding_window),
        o_groups=int(hf.o_groups),
        o_lora_rank=int(hf.o_lora_rank),
        index_heads=int(hf.index_n_heads),
        index_head_dim=int(hf.index_head_dim),
        index_topk=int(hf.index_topk),
        main_inv_freq=main_inv,
        compress_inv_freq=compress_inv,
        hc_mult=int(hf.hc_mult),
        hc_sinkhorn_iters=int(hf.hc_sinkhorn_iters),
        hc_eps=float(hf.hc_eps),
        swiglu_limit=float(hf.swiglu_limit or 0.0),
        scoring_func=str(hf.scoring_func),
        hash_layers=tuple(i for i, t in enumerate(hf.mlp_layer_types) if t == "hash_moe"),
    )
    if (hf.num_attention_heads * hf.head_dim) % compressed.o_groups:
        raise ModelLoadError(f"{arch}: o_groups {hf.o_groups} does not divide the heads")
    return {
        "num_kv_heads": 1,
        "num_experts": int(hf.n_routed_experts),
        "num_experts_per_tok": int(hf.num_experts_per_tok),
        "moe_intermediate_size": int(hf.moe_intermediate_size),
        "norm_topk_prob": True,
        "moe_layers": tuple(range(n)),
        "shared_intermediate_size": int(hf.moe_intermediate_size),
        "routed_scaling_factor": float(hf.routed_scaling_factor),
        "q_lora_rank": int(hf.q_lora_rank),
        "qk_rope_head_dim": rope,
        "compressed": compressed,
    }
