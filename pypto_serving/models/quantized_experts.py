"""A mixture of experts' routed experts quantized while their checkpoint is read.

Under `--quantization int4` (and int4-w8a8, int8, w8a8) a MoE block's experts are most of the
model's weights (5.0 of qwen3-moe-small's 5.2 B parameters). Where the native GEMM builds,
they become records (`ops/moe.ExpertRecords`: Q4 for int4 and int4-w8a8, Q8 for int8 and
w8a8, the native step's own formats, one expert a row), which `ops/moe.moe_records`
multiplies at every width with activations quantized per 32 inputs, as it multiplies a GGUF
file's experts. Each expert is packed as soon as its three tensors have been read
(`ExpertQuantizer.take`, gate's rows then up's, as the model fuses them), so the bf16 stacks
are never held whole: a load needs the records and one expert's tensors, not the checkpoint
in bf16. The records are kept in the quantized weights' cache file beside the linear layers'
(`models/quantized_cache.py`); a later start reads them there and skips the checkpoint's
expert tensors unread.

A block takes records where its experts are plain SwiGLU MLPs (Qwen3-MoE's, DeepSeek-V2/V3's:
no clamp, no biases, SiLU; `takes_records`), its sizes are multiples of 32 inputs, and its
experts are not exchanged between replicas (DP attention + EP, whose exchange moves bf16
rows); the others keep their bf16 stacks, said in the log.
"""

from __future__ import annotations

import logging
import re

import torch

from pypto_serving.errors import ModelLoadError
from pypto_serving.models.llama import RoutedExperts
from pypto_serving.ops.linear import (
    INT4_GROUP,
    NATIVE_Q4,
    NATIVE_Q8,
    pack_q4,
    pack_q8,
    records_bytes,
)
from pypto_serving.ops.moe import ExpertRecords

log = logging.getLogger(__name__)

EXPERT_FORMATS = {"int4": NATIVE_Q4, "int4-w8a8": NATIVE_Q4, "int8": NATIVE_Q8, "w8a8": NATIVE_Q8}
"""The records' format a quantization gives a MoE block's experts."""

EXPERT = re.compile(
    r"(model\.layers\.\d+\.(?:mlp|ffn))\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
"""A routed expert's checkpoint tensor: its block, its id and its projection."""
V4_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""DeepSeek-V4's expert names (w1 gate, w3 up, w2 down) as the other models'."""


def parse_expert(name: str) -> tuple[str, int, str] | None:
    """A routed expert's checkpoint tensor name as (its block's module name, the expert's id,
    "gate", "up" or "down"); None for any other tensor."""
    match = EXPERT.fullmatch(name)
    if match is None:
        return None
    return match[1], int(match[2]), V4_PROJECTIONS.get(match[3], match[3]).removesuffix("_proj")


def takes_records(block: RoutedExperts) -> bool:
    """Whether the block's experts can be records: plain SwiGLU (no clamp, no gpt-oss gate,
    no biases), sizes in whole groups of 32 inputs, and not exchanged between replicas."""
    cfg = block.cfg
    return (
        not block.swiglu_limit
        and not block.swiglu_alpha
        and block.experts_gate_up_bias is None
        and block.experts_down_bias is None
        and block.exchange in ("none", "all_reduce")
        and cfg.hidden_size % INT4_GROUP == 0
        and cfg.moe_intermediate_size % INT4_GROUP == 0
    )


def record_blocks(model: torch.nn.Module) -> dict[str, RoutedExperts]:
    """The model's MoE blocks whose experts become records, by module name; those that keep
    their bf16 stacks are said in the log."""
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}
    taken = {n: b for n, b in blocks.items() if takes_records(b)}
    kept = sorted(set(blocks) - set(taken))
    if kept:
        log.info(
            "%d MoE blocks keep their experts in bf16 (clamped, biased or gpt-oss experts, "
            "sizes off 32 inputs, or exchanged between replicas): %s",
            len(kept),
            ", ".join(kept[:3]) + (" ..." if len(kept) > 3 else ""),
        )
    return taken


def is_records_expert(name: str, blocks: dict[str, RoutedExperts]) -> bool:
    """Whether a checkpoint tensor is an expert's of one of `blocks`."""
    parsed = parse_expert(name)
    return parsed is not None and parsed[0] in blocks


class ExpertQuantizer:
    """Packs the held experts of `blocks` into records as their tensors are read: `take`
    each checkpoint tensor (it keeps a block's expert tensors, dropping another rank's
    experts), then `records`."""

    def __init__(self, blocks: dict[str, RoutedExperts], fmt: int, dtype: torch.dtype) -> None:
        """fmt: the records' format (EXPERT_FORMATS); dtype: the model's, which each tensor is
        rounded to first (as a linear layer is quantized from its loaded weight)."""
        self.blocks, self.fmt, self.dtype = blocks, fmt, dtype
        self.pack = pack_q4 if fmt == NATIVE_Q4 else pack_q8
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._left: dict[str, set[tuple[int, str]]] = {}
        self._waiting: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        for name, block in blocks.items():
            hidden, size = block.cfg.hidden_size, block.cfg.moe_intermediate_size
            n = len(block.held)
            self._stacks[name] = (
                torch.empty(n, records_bytes(fmt, 2 * size, hidden), dtype=torch.uint8),
                torch.empty(n, records_bytes(fmt, hidden, size), dtype=torch.uint8),
            )
            self._left[name] = {(e, p) for e in block.held for p in ("gate", "up", "down")}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep the tensor if it is an expert's of a records block (packing the expert's
        gate and up once both are here); False for any other tensor, which loads as usual."""
        parsed = parse_expert(name)
        if parsed is None or parsed[0] not in self.blocks:
            return False
        prefix, expert, proj = parsed
        block = self.blocks[prefix]
        if expert not in block.held:
            return True  # another rank's expert
        cfg = block.cfg
        rows, cols = (cfg.hidden_size, cfg.moe_intermediate_size)[:: 1 if proj == "down" else -1]
        if tuple(tensor.shape) != (rows, cols):
            raise ModelLoadError(
                f"{name} has shape {tuple(tensor.shape)}; the model expects {(rows, cols)}"
            )
        if (expert, proj) not in self._left[prefix]:
            raise ModelLoadError(f"{name} appears twice in the checkpoint")
        self._left[prefix].discard((expert, proj))
        j = block.held.index(expert)
        gate_up, down = self._stacks[prefix]
        weight = tensor.to(self.dtype)
        if proj == "down":
            down[j] = self.pack(weight)
            return True
        parts = self._waiting.setdefault((prefix, expert), {})
        parts[proj] = weight
        if len(parts) == 2:
            gate_up[j] = self.pack(torch.cat([parts["gate"], parts["up"]]))
            del self._waiting[(prefix, expert)]
        return True

    def records(self) -> dict[str, ExpertRecords]:
        """Each block's records, by module name; a ModelLoadError where the checkpoint lacked
        some expert's tensor."""
        missing = sorted(
            f"{b}.experts.{e}.{p}_proj" for b, left in self._left.items() for e, p in left
        )
        if missing:
            shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} expert tensors: {shown}")
        return {
            name: ExpertRecords(gate_up, down, self.fmt, self.fmt)
            for name, (gate_up, down) in self._stacks.items()
        }
