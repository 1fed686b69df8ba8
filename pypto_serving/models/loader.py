"""Load a Hugging Face model directory into our model code.

This file is the ONE place where checkpoint tensors are rearranged: HF parameter names are
kept, except that q/k/v and gate/up land in slices of the fused `qkv_proj` / `gate_up_proj`,
MLA's kv_b_proj is split into each head's `w_uk` and `w_uv` (models/deepseek.py), experts
land in their stacks (gpt-oss's from its [experts, inputs, outputs] tensors, gate and up
interleaved, MXFP4 dequantized first), and under tensor parallelism each rank takes its slice
of the split tensors first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pypto_serving.config import CALIBRATED_QUANTIZATIONS as CALIBRATED
from pypto_serving.device import int8_gemm_full_range
from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.errors import ModelLoadError, PyptoError
from pypto_serving.models import calibration, mxfp4
from pypto_serving.models.calibration import LayerwiseQuantization
from pypto_serving.models.config import DEEPSEEK, DEEPSEEK_V4, ModelConfig, load_model_config
from pypto_serving.models.deepseek import DeepseekForCausalLM, DeepseekMoE
from pypto_serving.models.deepseek_mtp import OWN_PARTS, DeepseekMTP, mtp_tensor_names
from pypto_serving.models.deepseek_v4 import DeepseekV4ForCausalLM, V4MoE
from pypto_serving.models.gemma3 import Gemma3ForCausalLM
from pypto_serving.models.gguf_weights import (
    embedding_in_head,
    expert_sources,
    record_sources,
    stored_expert_records,
    stored_records,
)
from pypto_serving.models.gpt_oss import GptOssForCausalLM, GptOssMoE
from pypto_serving.models.llama import CausalLM, MoE, RoutedExperts
from pypto_serving.models.quantized_cache import (
    cached_experts,
    kept_forms_fit,
    quantize_cached,
    quantized_cache_path,
)
from pypto_serving.models.quantized_experts import (
    EXPERT_FORMATS,
    ExpertQuantizer,
    is_records_expert,
    parse_expert,
    record_blocks,
)
from pypto_serving.models.tensor_files import MALFORMED, read_header, read_tensors
from pypto_serving.models.windowed import WindowedCausalLM
from pypto_serving.ops.linear import (
    NATIVE_Q8,
    Linear,
    pack_linears,
    quantized_kind,
    weights_unread,
)
from pypto_serving.ops.moe import ExpertRecords

# HF projection name -> (our fused parameter, index of the slice it fills)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
BARE_DECODER = ("embed_tokens.", "layers.", "norm.")
"""Names of a decoder saved without its LM head's wrapper (Qwen3-Embedding's `Qwen3Model`):
they load as `model.<name>`."""


def checkpoint_digest(model_dir: Path) -> str:
    """Identifies a checkpoint without reading its weights: config.json's bytes and each weight
    file's name, size and modification time. Persistent KV (the SSD tier) is keyed by it."""
    h = hashlib.blake2b(digest_size=16)
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in safetensors_files(model_dir):
        stat = path.stat()
        h.update(f"{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def fused_slices(cfg: ModelConfig, fused: str, rows: int) -> list[int]:
    """Row counts of the pieces stacked in a fused projection of `rows` rows, in order."""
    if fused == "qkv_proj":
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [rows // 2, rows // 2]  # gate_up_proj: an MLP's, or DeepSeek's shared experts'


def expected_loads(cfg: ModelConfig, param_name: str, param: torch.Tensor) -> int:
    """How many checkpoint tensors fill a parameter (several for the fused projections, one
    or two per expert held for the experts' stacks)."""
    if cfg.gpt_oss is not None and ".experts_" in param_name:
        return 1  # one tensor of every expert's (`oss_expert_parts`)
    if param_name.endswith(".experts_gate_up"):
        return 2 * param.shape[0]
    if param_name.endswith(".experts_down"):
        return param.shape[0]
    fused = param_name.split(".")[-2]
    return len(fused_slices(cfg, fused, 0)) if fused in ("qkv_proj", "gate_up_proj") else 1


V4_RENAMED = {"head.weight": "lm_head.weight"}
V4_SKIPPED = ("mtp.",)
"""DeepSeek-V4's multi-token prediction layers: not served."""


def expert_target(
    model: CausalLM, params: Mapping[str, torch.Tensor], name: str
) -> tuple[str, torch.Tensor | None] | None:
    """Where a Qwen3-MoE expert tensor goes: (the stacked parameter, the slice this rank
    fills, or None when another rank holds that expert); None for a tensor that is no
    expert's."""
    parsed = parse_expert(name)
    if parsed is None:
        return None
    prefix, expert, proj = parsed
    moe = model.get_submodule(prefix)
    assert isinstance(moe, MoE | DeepseekMoE | V4MoE), f"{prefix} holds no experts"
    if expert not in moe.held:
        return prefix, None
    j = moe.held.index(expert)
    if proj == "down":
        return f"{prefix}.experts_down", params[f"{prefix}.experts_down"].data[j]
    rows = model.cfg.moe_intermediate_size
    stack = params[f"{prefix}.experts_gate_up"].data[j]
    return f"{prefix}.experts_gate_up", stack.narrow(0, 0 if proj == "gate" else rows, rows)


OSS_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.(gate_up|down)_proj(_bias)?")


def oss_expert_parts(
    model: CausalLM, params: Mapping[str, torch.Tensor], name: str, tensor: torch.Tensor
) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """Where a gpt-oss experts tensor goes: (our stacked parameter, [(the part of it an expert
    held here fills, the checkpoint's rows for it)]); None for a tensor that is no such one.
    The checkpoint holds every expert's projection as [experts, inputs, outputs] (biases
    [experts, outputs]), gate and up interleaved by output; our stacks hold nn.Linear's
    [outputs, inputs], the gate's rows first."""
    match = OSS_EXPERTS.fullmatch(name)
    if match is None or model.cfg.gpt_oss is None:
        return None
    prefix, proj, bias = match[1], match[2], match[3] or ""
    moe = model.get_submodule(prefix)
    assert isinstance(moe, GptOssMoE), f"{prefix} holds no experts"
    target = f"{prefix}.experts_{proj}{bias}"
    stack = params[target].data
    want = (model.cfg.num_experts, *stack.shape[1:][:: 1 if bias else -1])
    if tuple(tensor.shape) != want:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
    parts = []
    for j, expert in enumerate(moe.held):
        rows = tensor[expert] if bias else tensor[expert].T
        if proj == "gate_up":
            rows = torch.cat([rows[0::2], rows[1::2]])
        parts.append((stack[j], rows))
    return target, parts


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files: from model.safetensors.index.json, or all *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"invalid {index.name} in {model_dir}: {e}") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"missing shard files in {model_dir}: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in model directory {model_dir}")
    return files


def checkpoint_numel(model_dir: Path) -> int:
    """The checkpoint's weights, counted from its files' headers (no tensor read)."""
    total = 0
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    total += math.prod(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt safetensors file {path.name}: {e}") from None
    return total


def iter_checkpoint(
    files: list[Path], skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name, one at a time, each in memory of its own
    (`read_tensors`: a file's mapping would hold a whole shard's bytes resident beside what
    is made of them); those `skip` names are never read."""
    for path in files:
        try:
            yield from read_tensors(path, None if skip is None else lambda n: not skip(n))
        except (OSError, *MALFORMED) as e:
            raise ModelLoadError(f"corrupt safetensors file {path.name}: {e}") from None


LAYER = re.compile(r"model\.layers\.(\d+)\.")
"""A decoder layer's checkpoint tensor, and its index."""


def iter_checkpoint_by_layer(
    files: list[Path],
    num_layers: int,
    after_layer: Callable[[int], None],
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_checkpoint`'s tensors, the decoder layers' after every other (the embedding's
    among those), layer 0's first, then 1's, and so on, whatever order the files keep them
    in (a shard's are sorted by name: layer 10's before layer 2's); `after_layer(i)` is called
    once layer i's last tensor has been taken from the iterator. A layer's tensors are read
    from the files whose headers name them (each header read first, once)."""

    def layer_of(name: str) -> int | None:
        match = LAYER.match(name)
        index = None if match is None else int(match[1])
        return index if index is not None and index < num_layers else None

    def part(index: int | None) -> Callable[[str], bool]:
        return lambda name: layer_of(name) != index or (skip is not None and skip(name))

    holding: dict[int | None, list[Path]] = {}  # each part's files, in the files' order
    for path in files:
        try:
            names = read_header(path).keys() - {"__metadata__"}
        except (OSError, *MALFORMED) as e:
            raise ModelLoadError(f"corrupt safetensors file {path.name}: {e}") from None
        for index in {layer_of(name) for name in names}:
            holding.setdefault(index, []).append(path)
    yield from iter_checkpoint(holding.get(None, []), part(None))
    for i in range(num_layers):
        yield from iter_checkpoint(holding.get(i, []), part(i))
        after_layer(i)


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
"""Split by output rows under tensor parallelism (weights and biases)."""
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
"""Split by input columns."""
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")
"""Split by vocabulary rows, the last shard padded with zero rows."""
V4_SPLIT = {
    ".attn.wq_b.weight": 0,
    ".attn.attn_sink": 0,
    ".attn.wo_a.weight": 0,
    ".attn.wo_b.weight": 1,
    ".ffn.shared_experts.w1.weight": 0,
    ".ffn.shared_experts.w3.weight": 0,
    ".ffn.shared_experts.w2.weight": 1,
}
"""DeepSeek-V4's tensors split under tensor parallelism, by the dimension they split on: its
heads' query rows and sinks, its output groups (`wo_a`'s rows, `wo_b`'s columns), the shared
expert's columns. The low-rank query, the KV head, the compressors and the indexers stay
whole (their names end alike only under `.attn.compressor.` or `.attn.indexer.`)."""


def tensor_parallel_slice(hf_name: str, tensor: torch.Tensor, tp: Group) -> torch.Tensor:
    """This rank's part of a checkpoint tensor under tensor parallelism (the whole tensor for
    the replicated ones: norms, and the o_proj bias, added once after the reduction)."""
    if tp.size == 1 or ".mlp.experts." in hf_name or hf_name.endswith(".mlp.gate.weight"):
        return tensor  # experts stay whole: expert parallelism places them instead
    for suffix, dim in V4_SPLIT.items():
        if hf_name.endswith(suffix):
            return tensor.chunk(tp.size, dim=dim)[tp.rank]
    if hf_name.endswith(".self_attn.sinks"):  # gpt-oss's: one per head
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if hf_name.endswith(VOCAB_PARALLEL):
        shard = -(-tensor.shape[0] // tp.size)
        part = tensor[tp.rank * shard : (tp.rank + 1) * shard]
        pad = shard - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part
    if any(f".{name}." in hf_name for name in COLUMN_PARALLEL):
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if hf_name.endswith(ROW_PARALLEL):
        return tensor.chunk(tp.size, dim=1)[tp.rank]
    return tensor


def copy_checked(hf_name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(tensor)


def pipeline_targets(model: CausalLM, hf_name: str) -> list[str]:
    """The parameters (HF names) this pipeline stage fills from a checkpoint tensor: its own
    layers, the embedding on the first stage, the norm, LM head (and DeepSeek-V4's `hc_head`)
    on the last (a tied LM head on a last stage that is not the first gets its own copy of the
    embedding)."""
    cfg, first, last = model.cfg, model.first_stage, model.last_stage
    layer = re.match(r"model\.layers\.(\d+)\.", hf_name)
    if layer is not None:
        i = int(layer[1])
        if cfg.num_layers <= i < cfg.num_layers + cfg.extra_layers:
            return []  # DeepSeek-V3's multi-token prediction layers: `load_mtp`'s
        return [hf_name] if i in model.model.local or i >= cfg.num_layers else []
    if hf_name == "model.embed_tokens.weight":
        tied_here = cfg.tie_word_embeddings and last and not first
        return [hf_name] * first + ["lm_head.weight"] * tied_here
    if hf_name == "lm_head.weight":
        return [hf_name] if last and not cfg.tie_word_embeddings else []
    if hf_name == "model.norm.weight" or hf_name.startswith("model.hc_head."):
        return [hf_name] if last else []
    return [hf_name]


def deinterleaved(tensor: torch.Tensor, rows: int, rope: int) -> torch.Tensor:
    """The tensor with the last `rope` of each group of `rows` rows taken from DeepSeek's
    pairs (x0, x1), (x2, x3), ... to halves (x0, x2, ..., x1, x3, ...), as `ops/rope.py`'s
    rotate-half rotation pairs them (the rotated results are HF's, bit for bit)."""
    if tensor.shape[0] % rows:
        return tensor  # a wrong shape: copy_checked says so
    index = torch.arange(tensor.shape[0]).view(-1, rows)
    tail = index[:, rows - rope :]
    index[:, rows - rope :] = torch.cat([tail[:, 0::2], tail[:, 1::2]], dim=1)
    return tensor[index.flatten()]


def mla_tensors(
    cfg: ModelConfig, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """MLA's tensors (this rank's heads) as models/deepseek.py holds them: kv_b_proj split into
    each head's key rows (`w_uk`) and value rows (`w_uv`); the roped rows of the query and
    latent projections de-interleaved where the checkpoint interleaves them. Other tensors
    as they are."""
    attn, _, leaf = name.rpartition(".self_attn.")
    if not cfg.kv_lora_rank or not attn:
        return [(name, tensor)]
    rope, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    if leaf == "kv_b_proj.weight":
        shape = (cfg.num_heads * (nope + cfg.v_head_dim), cfg.kv_lora_rank)
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        w_uk, w_uv = tensor.view(cfg.num_heads, -1, cfg.kv_lora_rank).split(
            [nope, cfg.v_head_dim], dim=1
        )
        prefix = f"{attn}.self_attn."
        return [(prefix + "w_uk", w_uk), (prefix + "w_uv", w_uv)]
    if cfg.rope_interleave and leaf in ("q_proj.weight", "q_b_proj.weight"):
        return [(name, deinterleaved(tensor, nope + rope, rope))]
    if cfg.rope_interleave and leaf.startswith("kv_a_proj_with_mqa."):
        return [(name, deinterleaved(tensor, cfg.kv_lora_rank + rope, rope))]
    return [(name, tensor)]


def load_weights(
    model: CausalLM,
    weights: Iterator[tuple[str, torch.Tensor]],
    filled: Callable[[str], None] | None = None,
) -> None:
    """Copy checkpoint tensors into the model; every parameter must be filled exactly once.
    Under tensor parallelism each rank keeps its slice of every split tensor. filled(name):
    told as each parameter of the projections and other plain tensors is whole (it may take
    the parameter away, its quantized form made); no tensor may fill it again."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    pending = {name: expected_loads(cfg, name, p) for name, p in params.items()}
    for hf_name, tensor in weights:
        if hf_name.endswith(IGNORED_SUFFIXES):
            continue
        if cfg.compressed is not None:
            if hf_name.startswith(V4_SKIPPED):
                continue
            hf_name = V4_RENAMED.get(hf_name, hf_name)
        elif hf_name.startswith(BARE_DECODER):  # a decoder saved alone (an embedding model)
            hf_name = "model." + hf_name
        tensor = tensor_parallel_slice(hf_name, tensor, model.tp)
        for target_name in pipeline_targets(model, hf_name):
            stacked = oss_expert_parts(model, params, target_name, tensor)
            if stacked is not None:
                for held, rows in stacked[1]:
                    held.copy_(rows)
                pending[stacked[0]] -= 1
                continue
            expert = expert_target(model, params, target_name)
            if expert is not None:
                name, part = expert
                if part is not None:  # else another rank's expert
                    copy_checked(hf_name, tensor, part)
                    pending[name] -= 1
                continue
            for name, part in mla_tensors(cfg, target_name, tensor):
                shard = None
                for hf_proj, (fused, index) in FUSED.items():
                    if f".{hf_proj}." in name and name.replace(hf_proj, fused) in params:
                        name, shard = name.replace(hf_proj, fused), index
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"unexpected tensor {hf_name!r} in checkpoint")
                target = param.data
                if shard is not None:
                    sizes = fused_slices(cfg, name.split(".")[-2], target.shape[0])
                    target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
                copy_checked(hf_name, part, target)
                pending[name] -= 1
                if pending[name] == 0:
                    if filled is not None:
                        filled(name)
                    # no reference kept here: a weight its layer drops (here, or once its
                    # layer is quantized as the checkpoint streams) frees its memory then
                    del params[name]
    missing = sorted(n for n, left in pending.items() if left > 0)
    if missing == ["lm_head.weight"]:
        raise ModelLoadError(
            "checkpoint has no LM head (lm_head.weight) and does not tie it to its embeddings: "
            "a decoder saved alone, as embedding models are, needs tie_word_embeddings in its "
            "config.json to load here"
        )
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors: {shown}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A tokenizer's vocabulary comes in one of these (or a *.model / *.tiktoken file):
without one, transformers may build an empty tokenizer and say nothing."""


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    found = sorted(
        f.name
        for f in model_dir.glob("*")
        if f.name in TOKENIZER_FILES or f.suffix in (".model", ".tiktoken")
    )
    if not found:
        raise ModelLoadError(
            f"cannot load the tokenizer in {model_dir}: it has no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES)} and the files beside it, e.g. merges.txt and "
            "tokenizer_config.json); copy them from the model's original repository"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from None
    if not tokenizer.encode("Hello", add_special_tokens=False):  # e.g. vocab.json alone
        raise ModelLoadError(
            f"cannot load the tokenizer in {model_dir}: it encodes text to nothing "
            f"({', '.join(found)} found, is a file beside it missing?)"
        )
    return tokenizer


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """Our model code for the checkpoint's architecture."""
    if cfg.architecture == DEEPSEEK_V4:
        return DeepseekV4ForCausalLM
    if cfg.gemma is not None:
        return Gemma3ForCausalLM
    if cfg.gpt_oss is not None:
        return GptOssForCausalLM
    if cfg.window_layers:
        return WindowedCausalLM
    return DeepseekForCausalLM if cfg.architecture in DEEPSEEK else CausalLM


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    groups: ParallelGroups | None = None,
    quantization: str | None = None,
    native: bool = False,
    pack: str | None = None,
    records_only: bool = False,
    records_wide: str = "records",
    expert_records: bool = False,
) -> CausalLM:
    """Build our model for `model_dir` (this rank's share of it under tensor and pipeline
    parallelism) and fill it with the checkpoint's weights, quantized if asked (int8, int4,
    w8a8, int4-w8a8: CPU and bfloat16 only). native: its few decodes run through the native
    decode step, which takes int4's weights in its own packing (`pack_linears`). pack: how bf16
    weights are repacked for wide matmuls ("onednn", "panels", or None: the run plan's
    `pack_linear`). records_only (the run plan's): a quantized model's weights are the
    native step's records alone, which serve every matmul (`pack_linears`); a GGUF file's
    stored matrices are then never loaded in bf16; records_wide: how the graphs multiply by
    them (`Linear.wide`). expert_records (the run plan's): a quantized MoE's experts become
    records as the checkpoint is read (models/quantized_experts.py), or are read back from
    the quantized weights' cache, the checkpoint's expert tensors then left unread."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    if quantization is not None and (device.type != "cpu" or dtype != torch.bfloat16):
        raise PyptoError(
            f"quantization {quantization} runs on CPU with dtype bfloat16; this engine has "
            f"{device.type} and {str(dtype).removeprefix('torch.')}: pass --device cpu "
            "--dtype bfloat16 (dtype auto picks it on CPUs with AVX2 or AVX-512 where the "
            "native kernels build), or drop --quantization",
            "quantization",
        )
    groups = groups or ParallelGroups()
    cfg = load_model_config(model_dir).parallel_shard(
        groups.tp.size, groups.pp.size, groups.ep.size > 1
    )
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, groups)
    sources = None
    experts: dict[str, list[list[str]]] = {}  # MoE blocks' experts made from stored matrices
    embed = model.model.embed_tokens
    in_head = False  # the tied embedding read from the LM head's records
    if quantization == "gguf":  # the file's own matrices: nothing to quantize or cache
        sources = record_sources(model, model_dir, FUSED)
        if records_only:  # they are the layers' only form: never load those in bf16
            for name in sources:
                model.get_submodule(name).register_parameter("weight", None)
            experts = expert_sources(model, model_dir)
            for name in experts:
                model.get_submodule(name).register_parameter("experts_gate_up", None)
                model.get_submodule(name).register_parameter("experts_down", None)
            in_head = embed is not None and embedding_in_head(model_dir, sources)
            if in_head:
                assert embed is not None
                embed.register_parameter("weight", None)
    blocks = record_blocks(model) if expert_records and quantization in EXPERT_FORMATS else {}
    for name in blocks:  # their records are their only form: never loaded in bf16
        model.get_submodule(name).register_parameter("experts_gate_up", None)
        model.get_submodule(name).register_parameter("experts_down", None)
    model = model.to(dtype).to_empty(device=device)
    embed, head = model.model.embed_tokens, model.lm_head
    if (
        cfg.tie_word_embeddings
        and embed is not None
        and head is not None
        and head.weight is not None
    ):
        head.weight = embed.weight  # to_empty() gives each module its own tensor: tie again
    kept = None  # where the quantized weights are kept across starts
    if quantization is not None and sources is None:
        kept = quantized_cache_path(
            model, checkpoint_digest(model_dir), quantization, groups, native, records_only
        )
    skip = None
    if sources is not None and records_only:
        skipped = {s for parts in sources.values() for s in parts}
        skipped |= {s for each in experts.values() for parts in each for s in parts}
        if not in_head:
            skipped.discard("model.embed_tokens.weight")  # the lookup's, beside the head's
        skip = skipped.__contains__
    quantizer: ExpertQuantizer | None = None
    made: dict[str, ExpertRecords] | None = None
    if blocks:
        assert quantization is not None
        assert kept is not None
        fmt = EXPERT_FORMATS[quantization]
        made = cached_experts(kept, blocks, fmt)
        if made is not None:
            skip = functools.partial(is_records_expert, blocks=blocks)  # never read
        else:
            quantizer = ExpertQuantizer(blocks, fmt, dtype)
    cached = kept is not None and kept_forms_fit(kept, model)
    layerwise: LayerwiseQuantization | None = None  # (w8a8's factors, layer by layer)
    if _calibrates_by_layer(model, quantization, records_only, kept, cached):
        assert quantization is not None
        tokens = calibration.calibration_tokens(load_tokenizer(model_dir))
        choose = not int8_gemm_full_range()  # (`choose_w8a8_inputs`)
        layerwise = LayerwiseQuantization(model, tokens, quantization, native, pack, choose)
        weights = iter_checkpoint_by_layer(files, cfg.num_layers, layerwise, skip)
    else:
        weights = iter_checkpoint(files, skip)
    if quantizer is not None:
        weights = (w for w in weights if not quantizer.take(*w))
    if cfg.gpt_oss is not None and cfg.gpt_oss.mxfp4:
        weights = mxfp4.dequantized(weights)
    filled = None
    if (
        kept is not None
        and quantization is not None
        and (records_only or (cached and weights_unread(quantization, native)))
    ):
        filled = _streamed_weights(model, quantization, native, cached)
    # RoPE's buffers (lost by to_empty) before the weights: a layer calibrated as it streams
    # runs as soon as its weights are in
    model.inv_freq = torch.tensor(cfg.rope_inv_freq, dtype=torch.float32, device=device)
    if isinstance(model, DeepseekV4ForCausalLM | Gemma3ForCausalLM):
        model.set_rope(device)
    with torch.no_grad():
        load_weights(model, weights, filled)
    model = model.eval().requires_grad_(False)
    if blocks:
        made = made if quantizer is None else quantizer.records()
        assert made is not None
        for name, block_records in made.items():
            block = model.get_submodule(name)
            assert isinstance(block, RoutedExperts)
            block.records = block_records
    if sources is not None:  # the records made after the bf16 loads: a lower peak
        pack_linears(
            model,
            quantization,
            saved=stored_records(model, model_dir, sources),
            native=native,
            pack=pack,
            records_only=records_only,
            wide=records_wide,
        )
        if in_head:
            assert embed is not None and head is not None and head.native is not None
            records, fmt = head.native
            assert fmt == NATIVE_Q8, "the embedding's stored matrix is Q8_0"
            embed.q8 = records
        for name, stored in stored_expert_records(model, model_dir, experts).items():
            block = model.get_submodule(name)
            assert isinstance(block, RoutedExperts) and block.exchange == "none"
            block.records = stored
    elif quantization is not None:
        assert kept is not None
        quantize_cached(
            model,
            kept,
            quantization,
            lambda: load_tokenizer(model_dir),
            native,
            pack,
            records_only,
            records_wide,
            layerwise,
        )
    elif pack is not None:
        pack_linears(model, pack=pack)
    return model


def _calibrates_by_layer(
    model: CausalLM,
    quantization: str | None,
    records_only: bool,
    kept: Path | None,
    cached: bool,
) -> bool:
    """Whether w8a8's (int4-w8a8's) calibration runs layer by layer as the checkpoint is read
    (`LayerwiseCalibration`, `iter_checkpoint_by_layer`): where it calibrates at all (no kept
    forms fit: `cached`), the model's forward is `CausalLM.forward` and no layer is a mixture
    of experts (whose experts are records already, or bf16 stacks this does not stream).
    Where the int8 GEMM sums pairs in int16 (AVX2), each layer's choice of 7-bit inputs or
    weights (`choose_w8a8_inputs`) is made as it goes too."""
    return (
        quantization in CALIBRATED
        and not records_only
        and kept is not None
        and not cached
        and type(model).forward is CausalLM.forward
        and not any(isinstance(m, RoutedExperts) for m in model.modules())
    )


def _streamed_weights(
    model: CausalLM, quantization: str, native: bool, cached: bool
) -> Callable[[str], None]:
    """`load_weights`' `filled` for a model whose linear layers will not keep their bf16
    weights: each layer but the LM head, once its weight is whole, is packed into its records
    (`Linear.quantize`, the form `pack_linears` would give it: `records_only`, no calibration)
    or, where the quantized weights' cache file holds every layer's forms (`cached`:
    `kept_forms_fit`; `quantize_cached` then reads them; also where an int8 form serves every
    matmul: `weights_unread`), left for them; either way its bf16 weight goes at once,
    so the load never holds the checkpoint in bf16 (a dense 8B's 16 GB)."""
    head = model.lm_head
    linears = {
        f"{n}.weight": m
        for n, m in model.named_modules()
        if isinstance(m, Linear) and m is not head and m.weight is not None
    }

    def filled(name: str) -> None:
        layer = linears.pop(name, None)
        if layer is not None:
            if not cached:
                layer.quantize(quantized_kind(False, quantization, native, True))
            layer.register_parameter("weight", None)

    return filled


def load_mtp(model_dir: Path, target: CausalLM, dtype: torch.dtype) -> DeepseekMTP:
    """DeepSeek-V3's multi-token prediction layer (`models/deepseek_mtp.py`) from the
    checkpoint beside the target, whole (rank 0 drafts alone, under TP and PP too; unquantized:
    `dtype`); a ModelLoadError where the checkpoint ships none."""
    cfg = load_model_config(model_dir)  # (the target's own config is its TP share's)
    if cfg.architecture not in DEEPSEEK or cfg.compressed is not None:
        raise ModelLoadError(
            f"{cfg.architecture} has no multi-token prediction layer served here (DeepSeek-V3's "
            "and V2's checkpoints: `model.layers.{num_hidden_layers}.eh_proj` and the rest)"
        )
    files = safetensors_files(model_dir)
    first = cfg.num_layers
    prefix = f"model.layers.{first}."
    names: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names += [n for n in f.keys() if n.startswith(prefix)]  # noqa: SIM118
    if prefix + "eh_proj.weight" not in names:
        raise ModelLoadError(
            f"{model_dir} has no multi-token prediction layer ({prefix}eh_proj.weight and the "
            "rest): serve it with another speculative method"
        )
    own = {part for part in OWN_PARTS if any(n.startswith(prefix + part) for n in names)}
    tied = cfg.tie_word_embeddings
    device = target.inv_freq.device
    with torch.device("meta"):  # its entries: the KV layer after the target's (rank 0's)
        mtp = DeepseekMTP(cfg, kv_layer=len(target.local_layers))
    mtp = mtp.to(dtype).to_empty(device=device)

    def renamed() -> Iterator[tuple[str, torch.Tensor]]:  # reading the MTP's tensors only
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    for ours in mtp_tensor_names(name, first, own, tied):
                        yield ours, f.get_tensor(name)

    with torch.no_grad():
        load_weights(mtp, renamed())
    mtp.inv_freq = torch.tensor(mtp.cfg.rope_inv_freq, dtype=torch.float32, device=device)
    return mtp.eval().requires_grad_(False)
