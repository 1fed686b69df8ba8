"""Quantized weights kept across starts: `quantize_cached` quantizes a model's linear layers
(`ops/linear.pack_linears`, after w8a8's calibration) or reads back what an earlier start
kept under `cache_dir()/quantized`, keyed by everything that shapes the result. The same file
keeps a MoE block's experts made records while the checkpoint was read
(models/quantized_experts.py), which a later load takes back first (`cached_experts`)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pypto_serving.config import CALIBRATED_QUANTIZATIONS
from pypto_serving.device import cpu_isa, int8_gemm_full_range
from pypto_serving.distributed import ParallelGroups
from pypto_serving.errors import ModelLoadError
from pypto_serving.models import calibration
from pypto_serving.models.llama import CausalLM, RoutedExperts
from pypto_serving.models.tensor_files import MALFORMED, read_header, read_tensors, write_tensors
from pypto_serving.ops.linear import Linear, drop_unread_weights, pack_linears, records_bytes
from pypto_serving.ops.moe import ExpertRecords
from pypto_serving.paths import cache_dir, trusted_cache_dir, write_atomically

log = logging.getLogger(__name__)

QUANTIZED_FORMAT = 3
"""Bumped when what `Linear.quantized_tensors` keeps changes meaning (3: experts' records)."""
EXPERT_PARTS = ("experts.gate_up", "experts.down")
"""A MoE block's records in the file: `<block>/experts.gate_up.<format>`, and down's."""


def quantized_cache_path(
    model: CausalLM,
    digest: str,
    quantization: str,
    groups: ParallelGroups,
    native: bool,
    records_only: bool = False,
) -> Path:
    """Where `quantize_cached` keeps a model's quantized weights: keyed by the checkpoint's
    digest, this rank's share of it, the quantization, the code that quantizes (ops/linear.py,
    models/calibration.py and its text, and the model's own file, which marks its layers) and
    the torch version and CPU that packed them. The layers marked to keep 8 bits both under
    w8a8 (`Linear.exact_int8`) are keyed by name too: a mark can be set outside the model's
    own file (llama.py marks the LM head of every model built on it)."""
    key = hashlib.blake2b(digest_size=16)
    key.update(digest.encode())
    model_file = inspect.getfile(type(model))
    for source in map(Path, (pack_linears.__code__.co_filename, calibration.__file__, model_file)):
        key.update(source.read_bytes())
    marked = [n for n, m in model.named_modules() if isinstance(m, Linear) and m.exact_int8]
    key.update("|".join(marked).encode())
    key.update(calibration.TEXT.read_bytes())
    ranks = [(g.rank, g.size) for g in (groups.tp, groups.pp, groups.ep)]
    key.update(
        f"{QUANTIZED_FORMAT}|{quantization}|{native}|{records_only}|{model.cfg!r}|{ranks}|{torch.__version__}|"
        f"{torch.backends.cpu.get_cpu_capability()}|{cpu_isa()}|{int8_gemm_full_range()}|"
        f"{next(model.parameters()).dtype}".encode()
    )
    return cache_dir() / "quantized" / f"{key.hexdigest()}.safetensors"


def _trusted(path: Path) -> bool:
    """Whether the quantized weights' file `path` is in a cache folder no other user could
    write into (`trusted_cache_dir`): only then is it read or written."""
    return trusted_cache_dir(path.parent.name) == path.parent


def quantize_cached(
    model: CausalLM,
    path: Path,
    quantization: str,
    tokenizer: Callable[[], Any],
    native: bool = False,
    pack: str | None = None,
    records_only: bool = False,
    records_wide: str = "records",
    layerwise: calibration.LayerwiseQuantization | None = None,
) -> None:
    """Quantize the model's linear layers (`pack_linears`, after w8a8's calibration), or take
    the result of an earlier start from `cache_dir()/quantized`: reading it back is ~0.2 s
    where quantizing SmolLM2 is 1-2 s and calibrating ~2 s more. A file that does not fit the
    model (or cannot be read) is made again; a cache folder another user could write into is
    neither read nor written (`trusted_cache_dir`). path: the file, `quantized_cache_path` of
    the model as built; tokenizer: loads its tokenizer (for w8a8's calibration);
    pack: the run plan's choice of packing for the bf16 weights (`pack_linears`); records_only:
    the native step's records serve every matmul (`pack_linears`; no calibration then), the
    graphs multiplying by them as records_wide says (`Linear.wide`). layerwise: where the
    layers were calibrated and quantized as the checkpoint streamed
    (`calibration.LayerwiseQuantization`), what gives the LM head's factors and choice
    instead of calibrating the model whole."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    packs = functools.partial(
        pack_linears,
        model,
        quantization,
        native=native,
        pack=pack,
        records_only=records_only,
        wide=records_wide,
    )
    if not (_trusted(path) and path.is_file() and _took_kept(path, layers, packs)):
        _quantize(model, layers, path, quantization, tokenizer, records_only, layerwise, packs)
    drop_unread_weights(model, native)


def _took_kept(path: Path, layers: dict[str, Linear], packs: Callable[..., int]) -> bool:
    """Whether the layers' forms were taken from the kept file `path` (`packs`: `pack_linears`
    as `quantize_cached` calls it); False where they do not fit or the file cannot be read
    (deleted then: it is in our own folder, `_trusted`)."""
    try:
        saved: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
        # read, not mapped (`read_tensors`); a MoE block's experts the load took first
        # (`cached_experts`)
        wanted = lambda key: not key.partition("/")[2].startswith(EXPERT_PARTS)  # noqa: E731
        for key, tensor in read_tensors(path, wanted):
            name, _, part = key.partition("/")
            saved[name][part] = tensor
        if all(layers[n].fits(parts) for n, parts in saved.items()):
            packs(saved=saved)
            return True
        log.warning("the quantized weights in %s do not fit the model: quantizing", path)
    except (OSError, *MALFORMED) as e:
        log.warning("unreadable quantized weights %s (%s): quantizing again", path, e)
        path.unlink(missing_ok=True)
    return False


def _quantize(
    model: CausalLM,
    layers: dict[str, Linear],
    path: Path,
    quantization: str,
    tokenizer: Callable[[], Any],
    records_only: bool,
    layerwise: calibration.LayerwiseQuantization | None,
    packs: Callable[..., int],
) -> None:
    """`quantize_cached`'s quantizing of the model's `layers` (by name), after w8a8's
    calibration or the LM head's where the rest was calibrated `layerwise`; the forms are
    then kept in `path` where it is trusted (`_trusted`)."""
    if any(m.weight is None and not m.quantized_tensors() for m in layers.values()):
        raise ModelLoadError(  # dropped as the checkpoint streamed, for the file's forms
            f"the kept quantized weights in {path} could not be read after the load let go "
            "of the checkpoint's weights: start again, and it quantizes anew"
        )
    kept = None  # layers with 7-bit inputs, where an int16-pair GEMM chose
    if layerwise is not None:
        packs(layerwise.head())
        kept = layerwise.choose_head()
    elif quantization in CALIBRATED_QUANTIZATIONS and not records_only:
        tokens = calibration.calibration_tokens(tokenizer())  # one rank (validate)
        packs(calibration.smoothing_factors(model, tokens))
        if not int8_gemm_full_range():
            kept = calibration.choose_w8a8_inputs(model, tokens)
    else:
        packs(None)
    if kept is not None:
        log.info(
            "w8a8 on an int8 GEMM without int8 dot products: %d layers with 8-bit inputs and "
            "weights (two GEMMs), %d with 7-bit inputs, the rest with 7-bit weights",
            sum(m.int8 is not None and m.int8.low is not None for m in layers.values()),
            kept,
        )
    tensors = {
        f"{name}/{part}": t.contiguous()
        for name, m in layers.items()
        for part, t in m.quantized_tensors().items()
    }
    for name, block in model.named_modules():
        if isinstance(block, RoutedExperts) and (r := block.records) is not None:
            tensors[f"{name}/{EXPERT_PARTS[0]}.{r.gate_up_format}"] = r.gate_up
            tensors[f"{name}/{EXPERT_PARTS[1]}.{r.down_format}"] = r.down
    try:
        if _trusted(path):
            # written tensor by tensor (no second copy of them all); replicas quantizing at
            # once each rename a whole file into place
            write_atomically(path, functools.partial(write_tensors, tensors=tensors))
    except OSError as e:
        log.warning(
            "cannot keep the quantized weights in %s (%s): quantizing again next start", path, e
        )


def kept_forms_fit(path: Path, model: CausalLM) -> bool:
    """Whether `quantize_cached` will take every linear layer's quantized forms from the kept
    file `path` (`quantized_cache_path`): it is trusted, its header reads, and each layer's
    parts there have the layer's shapes (`Linear.fits`). The load may then drop each bf16
    weight as soon as it is filled, unquantized."""
    if not _trusted(path) or not path.is_file():
        return False
    try:
        header = read_header(path)
    except (OSError, *MALFORMED):
        return False
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, info in header.items():
        name, _, part = key.partition("/")
        if key != "__metadata__" and not part.startswith(EXPERT_PARTS):
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list):
                return False
            parts.setdefault(name, {})[part] = torch.empty(shape, device="meta")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    return parts.keys() == layers.keys() and all(layers[n].fits(p) for n, p in parts.items())


def cached_experts(
    path: Path, blocks: dict[str, RoutedExperts], fmt: int
) -> dict[str, ExpertRecords] | None:
    """The experts' records of `blocks` (by module name) that an earlier load kept in the
    quantized weights' file `path` (`quantized_cache_path`), in format `fmt`; None where the
    file is missing, untrusted or unreadable, or lacks any of them in the blocks' shapes."""
    if not _trusted(path) or not path.is_file():
        return None
    want = {f"{name}/{part}.{fmt}" for name in blocks for part in EXPERT_PARTS}
    try:
        found = dict(read_tensors(path, want.__contains__))
    except (OSError, *MALFORMED) as e:
        log.warning("unreadable quantized experts in %s (%s): quantizing them again", path, e)
        return None
    out: dict[str, ExpertRecords] = {}
    for name, block in blocks.items():
        hidden, size = block.cfg.hidden_size, block.cfg.moe_intermediate_size
        shapes = ((2 * size, hidden), (hidden, size))
        stacks = []
        for part, shape in zip(EXPERT_PARTS, shapes, strict=True):
            stack = found.get(f"{name}/{part}.{fmt}")
            if stack is None or stack.shape != (len(block.held), records_bytes(fmt, *shape)):
                return None
            stacks.append(stack)
        out[name] = ExpertRecords(stacks[0], stacks[1], fmt, fmt)
    return out
