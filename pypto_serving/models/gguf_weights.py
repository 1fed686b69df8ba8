"""`--quantization gguf`: a GGUF file's own Q4_1 and Q8_0 matrices, served as they are stored.

llama.cpp runs a Q4_1 file's matrices as Q4_1. The conversion (gguf_convert.py) dequantizes
them for the Hugging Face directory, and `--quantization int4` would quantize those bf16
values a second time. Instead the conversion keeps each Q4_1 / Q8_0 matrix's stored parts
(`BLOCKS_FILE`: 4-bit or int8 values, an fp16 scale and, for Q4_1, an fp16 minimum per row and
32 inputs) when every matrix the model multiplies by is one of the two, and here they become
the native decode step's records exactly (`q4_records`, `q8_records`: the same formats, 16
rows to a record), fused as the model fuses its projections (q/k/v, gate/up), the tied head
taking the embedding's. The step then computes what llama.cpp computes for a token (int8
activations per 32 inputs, the file's weights), and wherever the native GEMM builds the same
records serve the wider steps too (the run plan's `records_only`): the layers they stand for
are never loaded in bf16. A mixture of experts' experts become records the same way, a MoE
block's stacked one expert a row (`stored_expert_records`), multiplied in its custom op
(ops/moe.py); its router, which llama.cpp keeps in F32, stays in the model's dtype. `auto`, the
default, takes this wherever the native step runs, and for a MoE wherever the native GEMM
builds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pypto_serving.errors import ModelLoadError
from pypto_serving.models.gguf_convert import BLOCKS_FILE, BLOCKS_INDEX, blocks_files
from pypto_serving.models.llama import RoutedExperts
from pypto_serving.ops.linear import (
    NATIVE_Q4,
    NATIVE_Q8,
    Linear,
    q4_records,
    q8_records,
    records_bytes,
)
from pypto_serving.ops.moe import ExpertRecords


def stored_keys(model_dir: Path) -> dict[str, Path]:
    """The stored parts' names (`<HF name>.q`, `.scale`, `.min`) and the file holding each
    (`gguf_convert.blocks_files`); {} where none were kept or they cannot be read."""
    found: dict[str, Path] = {}
    try:
        for path in blocks_files(Path(model_dir)):
            with safe_open(str(path), "pt") as f:
                found |= dict.fromkeys(f.keys(), path)
    except (OSError, ValueError, KeyError):
        return {}
    return found


def parts_file(model_dir: Path) -> str:
    """The stored parts' file as messages name it: BLOCKS_FILE, or the index of its shards."""
    return BLOCKS_FILE if (Path(model_dir) / BLOCKS_FILE).is_file() else BLOCKS_INDEX


def has_blocks(model_dir: Path) -> bool:
    """Whether `model_dir` is a GGUF conversion whose every multiplied matrix was kept as
    stored (Q4_1 or Q8_0)."""
    return bool(stored_keys(model_dir))


def record_sources(
    model: nn.Module, model_dir: Path, fused: dict[str, tuple[str, int]]
) -> dict[str, list[str]]:
    """Each Linear's checkpoint tensors by module name, whose stored matrices make its records
    (`fused`: the loader's map of HF projections onto fused Linears; a tied head takes the
    embedding's), each one stored in one form. Needs only the model's structure (a model on
    the meta device will do)."""
    keys = stored_keys(model_dir)
    parts_of: dict[str, list[tuple[int, str]]] = {}
    for hf, (target, index) in fused.items():
        parts_of.setdefault(target, []).append((index, hf))
    out: dict[str, list[str]] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        sources = [f"{name}.weight"]
        if leaf in parts_of:
            sources = [f"{name[: -len(leaf)]}{hf}.weight" for _, hf in sorted(parts_of[leaf])]
        elif leaf == "lm_head" and f"{name}.weight.q" not in keys:
            sources = ["model.embed_tokens.weight"]  # tied
        missing = [s for s in sources if f"{s}.q" not in keys]
        if missing or len({f"{s}.min" in keys for s in sources}) != 1:
            raise ModelLoadError(
                f"{parts_file(model_dir)} in {model_dir} has no single stored form for {name} "
                f"({', '.join(missing) or 'Q4_1 and Q8_0 parts'}): drop --quantization gguf"
            )
        out[name] = sources
    return out


def embedding_in_head(model_dir: Path, sources: dict[str, list[str]]) -> bool:
    """Whether the LM head's records are made from the embedding's stored Q8_0 matrix (a tied
    model, `record_sources`): the lookup can then read its rows there (`q8_rows`), exactly
    the values of the bf16 embedding, which need not be loaded at all."""
    return sources.get("lm_head") == [
        "model.embed_tokens.weight"
    ] and "model.embed_tokens.weight.min" not in stored_keys(model_dir)


def stored_records(
    model: nn.Module, model_dir: Path, sources: dict[str, list[str]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Each Linear's records by module name, in `Linear.quantized_tensors` form ({"native.F":
    records}), from the stored matrices of its checkpoint tensors (`record_sources`). Made
    CHUNK_ROWS rows at a time into the layer's records, the files mapped only meanwhile, so
    that loading holds little more than the records themselves."""
    keys = stored_keys(model_dir)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, parts in sources.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Linear)
        fmt = _format(keys, parts)
        size = records_bytes(fmt, layer.out_features, layer.in_features)
        records = torch.empty(size, dtype=torch.uint8)
        with _stored(keys, parts) as part:
            shape = (layer.out_features, layer.in_features)
            _write_records(part, parts, shape, fmt, records, name)
        out[name] = {f"native.{fmt}": records}
    return out


def expert_sources(model: nn.Module, model_dir: Path) -> dict[str, list[list[str]]]:
    """Each MoE block's (`RoutedExperts`, by module name) checkpoint tensors whose stored
    matrices make its experts' records: for each expert it holds, in order, gate_up's (gate,
    up) and down's; {} for a model without experts. Needs only the model's structure."""
    keys = stored_keys(model_dir)
    out: dict[str, list[list[str]]] = {}
    for name, block in model.named_modules():
        if not isinstance(block, RoutedExperts):
            continue
        prefix = f"{name}.experts"
        out[name] = [
            [f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")] for e in block.held
        ]
        missing = [s for each in out[name] for s in each if f"{s}.q" not in keys]
        if missing:
            raise ModelLoadError(
                f"{parts_file(model_dir)} in {model_dir} has no stored form for {name}'s "
                f"experts ({', '.join(missing[:3])}): drop --quantization gguf"
            )
    return out


def stored_expert_records(
    model: nn.Module, model_dir: Path, sources: dict[str, list[list[str]]]
) -> dict[str, ExpertRecords]:
    """Each MoE block's experts as records (`ExpertRecords`), by module name, from the stored
    matrices `expert_sources` named for it (the stored parts' index read once for all)."""
    keys = stored_keys(model_dir)
    out: dict[str, ExpertRecords] = {}
    for name, each in sources.items():
        block = model.get_submodule(name)
        assert isinstance(block, RoutedExperts)
        hidden, size = block.cfg.hidden_size, block.cfg.moe_intermediate_size
        stacks, formats = [], []
        for projections, shape in (((0, 1), (2 * size, hidden)), ((2,), (hidden, size))):
            chosen = [[expert[i] for i in projections] for expert in each]
            found = {_format(keys, [s]) for parts in chosen for s in parts}
            if len(found) != 1:
                raise ModelLoadError(
                    f"{parts_file(model_dir)} in {model_dir}: the experts of {name} are stored "
                    "in more than one form (Q4_1 and Q8_0): drop --quantization gguf"
                )
            fmt = found.pop()
            stack = torch.empty(len(chosen), records_bytes(fmt, *shape), dtype=torch.uint8)
            with _stored(keys, [s for parts in chosen for s in parts]) as part:
                for j, parts in enumerate(chosen):
                    _write_records(part, parts, shape, fmt, stack[j], parts[0])
            stacks.append(stack)
            formats.append(fmt)
        out[name] = ExpertRecords(stacks[0], stacks[1], formats[0], formats[1])
    return out


def _format(keys: dict[str, Path], parts: list[str]) -> int:
    """The records' format of stored matrices `parts`: NATIVE_Q4 (Q4_1) or NATIVE_Q8."""
    return NATIVE_Q4 if f"{parts[0]}.min" in keys else NATIVE_Q8


@contextlib.contextmanager
def _stored(keys: dict[str, Path], sources: list[str]) -> Iterator[Callable[[str], Any]]:
    """part(key): a stored tensor's slice, the files holding `sources`' parts mapped while the
    context lasts."""
    with contextlib.ExitStack() as stack:
        files = {
            path: stack.enter_context(safe_open(str(path), "pt"))
            for path in {
                keys[f"{s}.{kind}"]
                for s in sources
                for kind in ("q", "scale", "min")
                if f"{s}.{kind}" in keys
            }
        }
        yield lambda key: files[keys[key]].get_slice(key)


def _write_records(
    part: Callable[[str], Any],
    parts: list[str],
    shape: tuple[int, int],
    fmt: int,
    records: torch.Tensor,
    name: str,
) -> None:
    """Write into `records` (uint8, `_size` bytes) the records in format `fmt` of the stored
    matrices `parts` stacked by rows, which must make a matrix of `shape` (`name`'s, for the
    message), made CHUNK_ROWS rows at a time."""
    n, k = shape
    shapes = [part(f"{s}.q").get_shape() for s in parts]
    if sum(r for r, _ in shapes) != n or {c for _, c in shapes} != {k}:
        raise ModelLoadError(
            f"the stored parts of {name} are {[tuple(t) for t in shapes]}, the model's {(n, k)}"
        )
    at = 0
    for first in range(0, n, CHUNK_ROWS):
        rows = range(first, min(first + CHUNK_ROWS, n))
        q, scale = (_rows(part, parts, shapes, rows, kind) for kind in ("q", "scale"))
        if fmt == NATIVE_Q4:
            chunk = q4_records(q, scale, _rows(part, parts, shapes, rows, "min"))
        else:
            chunk = q8_records(q, scale)
        records[at : at + chunk.numel()] = chunk
        at += chunk.numel()
    assert at == records.numel(), (name, at, records.numel())


CHUNK_ROWS = 1024
"""Rows of a matrix made into records at a time (a multiple of 16: a chunk's records follow
the previous chunk's)."""


def _rows(
    part: Callable[[str], Any], parts: list[str], shapes: list[list[int]], rows: range, kind: str
) -> torch.Tensor:
    """Rows `rows` of the matrices `parts` stacked, from their stored `kind` (q, scale, min);
    part(key): the stored tensor's slice."""
    pieces, start = [], 0
    for source, (count, _) in zip(parts, shapes, strict=True):
        lo, hi = max(rows.start - start, 0), min(rows.stop - start, count)
        if lo < hi:
            pieces.append(part(f"{source}.{kind}")[lo:hi])
        start += count
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
