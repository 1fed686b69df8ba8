"""The run plan: the choices an engine's start-up makes once, from its config and the machine.

Device, dtype, threads, which kernels run (native attention, the native decode step, oneDNN
packing) and the quantization are resolved here, once per process, into a frozen `RunPlan`
that every rank builds from (rank 0 in `EngineCore`, the others in `engine/ranks.py`). Once a
rank knows its share of the model, `plan_attention` decides how that share attends: its
attention kind, the KV cache's storage, the native kernels or PyTorch's attention, compiled
or eager layers, and the native decode step (`AttentionPlan`), from the run plan and what the
model declares (its kind's `KERNELS` and `NATIVE_DECODE`, its class's `compiles`). The code
below takes the plans' answers as arguments: nothing asks the environment, `device.py`'s
capability checks or the model's kind again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pypto_serving import native
from pypto_serving.config import EngineConfig
from pypto_serving.device import (
    auto_dtype,
    default_num_threads,
    linear_packing,
    resolve_device,
    resolve_dtype,
    use_native_attention,
    use_native_decode,
)
from pypto_serving.distributed import ParallelGroups
from pypto_serving.errors import PyptoError
from pypto_serving.executor import native_decode
from pypto_serving.executor.paged import AttentionPlan
from pypto_serving.kv import native_attention
from pypto_serving.models.config import ModelConfig, load_model_config
from pypto_serving.models.gguf_weights import has_blocks
from pypto_serving.models.loader import model_class
from pypto_serving.models.quantized_experts import EXPERT_FORMATS
from pypto_serving.speculative import ROW_COST

log = logging.getLogger(__name__)

RECORDS_QUANTIZATIONS = ("int4", "int8", "gguf")
"""Quantizations whose records serve every matmul wherever the native GEMM builds (the run
plan's `records_only`): int4's Q4, int8's Q8 (a scale per 32 weights, as llama.cpp's Q8_0),
a GGUF file's own; they are the layers' only form, so no bf16 copy is held."""


@dataclass(slots=True, frozen=True)
class RunPlan:
    """What one rank of an engine runs with."""

    device: torch.device
    dtype: torch.dtype
    num_threads: int
    """CPU threads of PyTorch's (and the native kernels') thread team."""
    native_attention: bool
    """Paged attention on the native CPU kernels (else PyTorch's)."""
    native_decode: bool
    """Decode steps of a few sequences as one native call, where the model allows it
    (`decodes_natively` says for a model)."""
    pack_linear: str | None
    """How bf16 linear weights are repacked for wide matmuls: "onednn", "panels" (the
    native GEMM, where oneDNN cannot pack bf16), or None (not at all)."""
    quantization: str | None
    """The linear layers' quantization (config.py's names), or None."""
    batch_invariant: bool = False
    """Every matmul on the native GEMM's panels (bf16, float32), or on the native step's
    records (int8, int4, int4-w8a8), or w8a8's integers, and no native decode step (config.py's
    `batch_invariant`)."""
    records_only: bool = False
    """A quantized model's weights are the native step's records alone, which serve every
    matmul whatever its rows (`ops/linear.records_linear`), no bf16 copy beside them: int4 and
    gguf wherever the native GEMM builds (their product beats oneDNN's bf16 GEMM at every
    width on AVX-512 and the panels on AVX2, at a third of the bytes), and every quantization
    but w8a8 under --batch-invariant."""
    expert_records: bool = False
    """A quantized MoE's experts are records (int4 and int4-w8a8: Q4, int8 and w8a8: Q8),
    made as the checkpoint is read and multiplied by `ops/moe.moe_records` at every width:
    wherever the native GEMM builds (models/quantized_experts.py; the blocks whose experts
    are not plain SwiGLU, or are exchanged between replicas, keep bf16)."""
    records_wide: str = "records"
    """How the graphs (prefill chunks) multiply by such records (`ops/linear.py`'s
    `Linear.wide`): dequantized per call into bf16, "pairs" where the native GEMM has
    AVX512-BF16 dot products, else "panels" (float32 FMAs), each output one chain over its
    inputs whatever the rows; "records" (activations quantized per 32, as a decode's) under
    --batch-invariant, whose decodes run on the graphs too."""


def plan_attention(
    plan: RunPlan, config: EngineConfig, cfg: ModelConfig, groups: ParallelGroups
) -> AttentionPlan:
    """How this rank's share (`groups`) of the model `cfg` describes attends, under `plan`:
    the native kernels where the plan runs them, the kind has them and they take its shape
    (else PyTorch's, said in the log), or the kind's own where it has some; compiled unless
    --enforce-eager or the model's layers do not compile; the native decode step where the
    plan runs it and the model allows it (`native_decode.applies`). An int8 KV cache needs
    the kernels."""
    model, cache, paged = model_class(cfg), config.cache, config.executor == "paged"
    kind = model.attention_kind
    kernels = None
    if paged and plan.native_attention and kind.KERNELS:
        share = cfg.parallel_shard(groups.tp.size, groups.pp.size, groups.ep.size > 1)
        one = kind.kv_groups(share, range(1), cache.page_size, plan.dtype, cache.kv_cache_dtype)
        spec = one[0].spec
        heads, kv_heads, dim = share.num_heads, spec.num_heads, spec.head_dim
        if native_attention.takes(plan.dtype, heads, kv_heads, dim, cache.page_size):
            kernels = (heads // kv_heads, dim)
        else:
            log.info(
                "attention on the PyTorch path: the native kernels do not take %s, head_dim "
                "%d, %d query heads per KV head or pages of %d",
                plan.dtype,
                dim,
                heads // kv_heads,
                cache.page_size,
            )
    if cache.kv_cache_dtype == "int8" and kernels is None:
        raise PyptoError(
            "kv_cache_dtype int8 needs the native CPU attention kernels, which this engine "
            f"does not run ({plan.device.type}, {str(plan.dtype).removeprefix('torch.')}, "
            f"head_dim {cfg.head_dim}, or --no-native-attention)",
            "kv_cache_dtype",
        )
    native = (
        paged
        and kernels is not None
        and plan.native_decode
        and _native_step_runs(
            cfg, plan.quantization, plan.dtype, groups, cache.page_size, plan.records_only
        )
    )
    return AttentionPlan(
        kind=kind.NAME,
        kernels=kernels,
        own_kernels=paged and plan.native_attention and kind.OWN_KERNELS,
        compiled=paged and model.compiles and not config.enforce_eager,
        native_decode=native,
        native_rows=native_decode.rows_taken(plan.quantization),
        draft_row_cost=native_decode.draft_row_cost(plan.quantization) if native else ROW_COST,
    )


def _native_step_runs(
    cfg: ModelConfig,
    quantization: str | None,
    dtype: torch.dtype,
    groups: ParallelGroups,
    page_size: int,
    records_only: bool = False,
) -> bool:
    """Whether the native decode step runs this model's decodes: its kind's, and the model's
    sizes, layers and weights (`native_decode.applies`)."""
    return model_class(cfg).attention_kind.NATIVE_DECODE and native_decode.applies(
        cfg, quantization, dtype, groups, page_size, records_only
    )


def plan_run(config: EngineConfig, model_dir: Path | None = None) -> RunPlan:
    """The plan of a rank whose config (device, num_threads) is its own (`plan_ranks`): the
    config's switches where the machine allows them. model_dir: the model's (Hugging Face)
    directory, for quantization auto (`_quantization`); None: auto is none."""
    device = resolve_device(config.device)
    if config.dtype == "auto":  # bf16 on AVX2 hinges on the native GEMM's panels
        dtype, why = auto_dtype(device, config.pack_linear and native.compiler() is not None)
        log.info("dtype auto: %s, %s", str(dtype).removeprefix("torch."), why)
    else:
        dtype = resolve_dtype(config.dtype, device)
    attention = config.native_attention and use_native_attention(device)
    decode = (
        attention
        and config.native_decode
        and use_native_decode(device)
        and native.compiler() is not None
        and not config.batch_invariant
    )
    quantization = _quantization(config, model_dir, device, dtype, decode)
    records_only = quantization is not None and (
        (config.batch_invariant and quantization != "w8a8")
        or (quantization in RECORDS_QUANTIZATIONS and native.gemm_library() is not None)
    )
    wide = "records"
    if records_only and not config.batch_invariant:
        gemm = native.gemm_library()
        wide = "pairs" if gemm is not None and gemm.pypto_records_pairs_built() else "panels"
    return RunPlan(
        device=device,
        dtype=dtype,
        num_threads=config.num_threads or default_num_threads(),
        native_attention=attention,
        native_decode=decode,
        pack_linear=_packing(config, device, dtype, quantization, records_only),
        quantization=quantization,
        batch_invariant=config.batch_invariant,
        records_only=records_only,
        expert_records=quantization in EXPERT_FORMATS and native.gemm_library() is not None,
        records_wide=wide,
    )


def _quantization(
    config: EngineConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    decode: bool,
) -> str | None:
    """The config's quantization, none as None and auto resolved: gguf (the file's own Q4_1 /
    Q8_0 matrices, models/gguf_weights.py) for a GGUF conversion that kept them, where the
    native decode step runs them, or for a mixture of experts (which the step does not run)
    where the native GEMM builds, its records then serving the graphs' every matmul (as under
    --batch-invariant), said in the log; else none."""
    asked = config.quantization
    if asked not in ("auto", "gguf"):
        return None if asked == "none" else asked
    if model_dir is None or not has_blocks(model_dir):
        if asked == "gguf":
            raise PyptoError(
                f"--quantization gguf serves a GGUF file's own Q4_1/Q8_0 matrices; "
                f"{model_dir} has none kept (pass the .gguf file, whose every projection is "
                f"Q4_1 or Q8_0), or use another --quantization",
                "quantization",
            )
        return None
    cfg = load_model_config(model_dir)
    served = (
        config.batch_invariant
        or (bool(cfg.moe_layers) and device.type == "cpu" and native.gemm_library() is not None)
        or (
            decode
            and _native_step_runs(cfg, "gguf", dtype, ParallelGroups(), config.cache.page_size)
        )
    )
    if (
        config.executor != "paged"
        or config.parallel.ranks_per_engine > 1
        or config.parallel.expert_parallel_over_dp  # (its experts would be exchanged)
        or dtype != torch.bfloat16
        or not served
    ):
        why = (
            "the file's Q4_1/Q8_0 matrices run through the native decode step (a mixture of "
            "experts: the native GEMM) or --batch-invariant: the CPU, bfloat16, one rank and "
            "no expert parallelism, the paged executor, a C++ compiler"
        )
        if asked == "gguf":
            raise PyptoError(
                f"--quantization gguf cannot run in this engine: {why}", "quantization"
            )
        log.info("quantization auto: none (%s)", why)
        return None
    log.info("quantization auto: gguf, the file's own Q4_1/Q8_0 matrices as stored")
    return "gguf"


def _packing(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    records_only: bool,
) -> str | None:
    """The linear weights' packing: the machine's (`device.linear_packing`) unless the config
    turns it off; panels only where the native GEMM builds (else said, and plain weights);
    none where the records serve every matmul."""
    if records_only and not config.batch_invariant:
        return None
    if config.batch_invariant:
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            raise PyptoError(
                f"--batch-invariant runs on the CPU in bfloat16 or float32; this engine has "
                f"{device.type} and {str(dtype).removeprefix('torch.')}",
                "batch_invariant",
            )
        if native.gemm_library() is None:
            raise PyptoError(
                "--batch-invariant needs the native GEMM, which did not build (a C++ "
                "compiler: g++, or $CXX; see the log)",
                "batch_invariant",
            )
        # quantized: w8a8's exact integers, or the native step's records (`records_only`)
        return "panels" if quantization is None else None
    form = linear_packing(device, dtype) if config.pack_linear else None
    if form == "panels" and native.gemm_library() is None:
        log.warning("the native GEMM did not build: bf16 matmuls of many rows run on PyTorch's")
        return None
    return form
