"""Linear layers (plain, and split across a tensor-parallel group) and the vocab-parallel
embedding; weights can be repacked once for the CPU's bf16 GEMM (oneDNN, or our panel GEMM),
or quantized.

A plain bf16 `F.linear` on CPU reorders its weight on every call; packing it once at load
time makes decode-sized matmuls about 1.6x faster. The packed weight is an opaque oneDNN
tensor, so the matmul runs as the custom op `pypto::packed_linear`, which torch.compile
treats as a black box. oneDNN packs bf16 only on CPUs with AVX-512 (BW, VL, DQ) or
AVX-NE-CONVERT; elsewhere (AVX2) bf16 weights are packed in panels for native/gemm.cpp
(`pack_panels`: [ceil(N / 16), K, 16] bf16), which computes in float32 with FMAs, each
output one chain over the inputs whatever the rows: `pypto::panel_linear`. Both forms live in
`Linear.packed` and run through `dense_linear`. Which, if any, is the run plan's choice
(`device.linear_packing`).

Weight-only quantization (`quantization`: int8 or int4) stores each weight in fewer bits and
multiplies with PyTorch's CPU kernels, which dequantize on the fly: a decode step streams
half (int8) or a quarter (int4) of the bytes of bf16. int8 has one scale per output row;
int4 has a scale and a minimum per group of 32 inputs, as llama.cpp's Q4_1. Activations stay
bf16; under int4 the LM head gets int8. A matmul of one row (a decode of one, which has a
graph of its own) calls the kernel directly; wider ones run as the custom op
`pypto::quantized_linear`. Those kernels only win while a matmul is memory-bound (a few rows:
decode); prefill-sized ones use the packed bf16 weight, kept alongside, so quantization
speeds up decoding and does not save memory.

`w8a8` quantizes activations too: int8 weights (a scale per output row) and each token's
input quantized to int8 when the matmul runs (`int8_linear`), so the matmul itself runs on
the CPU's int8 dot products (AVX512-VNNI), at about twice the bf16 rate: it speeds up the
compute-bound batched steps (prefill, decodes of many). Without them (AVX2) oneDNN sums pairs
of u8 x s8 products in int16, so either the inputs or the weights get 7 bits there: 7-bit
inputs (each token's, from its smallest to its largest value, with the weights' sums per row
kept beside them; `int8_linear`) or 7-bit weights, whichever the calibration text shows costs
the layer less (`calibration.choose_w8a8_inputs`). Under `--quantization w8a8` the layers
where 7 bits cost most (the LM head, and those that make attention's queries and keys:
`Linear.exact_int8`) keep 8 bits both there at the price of a second GEMM: the weight is
split in two halves that the int16 sums hold, 2 x high + low (`quantize_w8a8`'s split). The
inputs are first divided by SmoothQuant's per-channel factors, calibrated at load time
(models/calibration.py).

`int4-w8a8` keeps both forms of each weight and picks by the matmul's row count: int4 up to
QUANTIZED_MAX_ROWS (decoding a few sequences: memory-bound, where int4's fewer bytes win),
w8a8 above (prefill and batched decodes: compute-bound, where int8 dot products win). The
choice is a branch taken when torch.compile traces the layer, so each side fuses into its
graph (executor/compiled.py keeps a graph per side), and no bf16 weight is kept: 0.75x of
bf16's weight bytes. Its LM head is w8a8 alone. Its w8a8 never splits a weight: it is the
fast form, and its accuracy is int4's.

Under --batch-invariant a quantized model (int8, int4, int4-w8a8) keeps each weight in the
native decode step's records alone (`pack_q4`, `pack_q8`), and they serve every matmul of any
rows (`pypto::records_linear`, native/records.h): one kernel, so a row's result does not depend
on the rows beside it.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving import native as native_kernels
from pypto_serving.device import int8_gemm_full_range
from pypto_serving.distributed import Group, tp_all_reduce
from pypto_serving.errors import PyptoError

INT4_GROUP = 32
INT4_INNER_K_TILES = 2
INT4_ROWS = 16
"""int4's packing takes weights of whole blocks of 16 output rows."""
INT8_MULTIPLE = 16
"""int8's kernel (`_weight_int8pack_mm`) reads inputs 16 at a time on AVX-512 CPUs: other
input sizes crash the process there, so none are quantized anywhere."""
QUANTIZED_MAX_ROWS = 8
"""Rows up to which the quantized kernels beat the packed bf16 GEMM (SmolLM2's matrices on
these CPUs: int4 4.0 vs 14.5 ms per token at 1 row, 11.4 vs 13.2 at 8, 23.1 vs 16.7 at 16)."""


@torch.library.custom_op("pypto::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


@packed_linear.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("pypto::panel_linear", mutates_args=())
def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ weight.T (+ bias) through native/gemm.cpp, the weight in panels (`pack_panels`:
    bf16, or float32 under --batch-invariant), in float32; the result in x's dtype."""
    lib = native_kernels.gemm_library()
    assert lib is not None, "panels are only packed where the native GEMM is built"
    xf = x.float().contiguous()
    rows, cols = xf.shape
    width = panels.shape[0] * 16
    out = torch.empty(rows, width)
    assert bias is None or (bias.dtype == panels.dtype and bias.is_contiguous())
    gemm = lib.pypto_panel_gemm_f32 if panels.dtype == torch.float32 else lib.pypto_panel_gemm
    failed = gemm(
        xf.data_ptr(),
        cols,
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        width,
        rows,
        out_features,
        cols,
        torch.get_num_threads(),
    )
    assert not failed, (rows, out_features, cols)
    return (out if width == out_features else out[:, :out_features]).to(x.dtype)


@panel_linear.register_fake
def _(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("pypto::records_linear", mutates_args=())
def records_linear(
    x: torch.Tensor, records: torch.Tensor, fmt: int, out_features: int
) -> torch.Tensor:
    """x @ weight.T through native/records.h's product over the weight's records (`pack_q4`,
    `pack_q8`: fmt NATIVE_Q4 or NATIVE_Q8), x quantized to int8 per group of 32 inputs as the
    native decode step quantizes it; any number of rows, each row's result the same bits
    whatever rows come with it (--batch-invariant's quantized matmuls). In float32."""
    lib = native_kernels.gemm_library()
    assert lib is not None, "records serve every matmul only where the native GEMM is built"
    xf = x.float().contiguous()
    rows, cols = xf.shape
    out = torch.empty(rows, out_features)
    w = native_kernels.Matrix(records.data_ptr(), None, out_features, cols, fmt)
    failed = lib.pypto_packed_product(
        ctypes.byref(w), xf.data_ptr(), rows, out.data_ptr(), torch.get_num_threads()
    )
    assert not failed, (rows, out_features, cols, fmt)
    return out


@records_linear.register_fake
def _(x: torch.Tensor, records: torch.Tensor, fmt: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


@torch.library.custom_op("pypto::dequantized_linear", mutates_args=())
def dequantized_linear(
    x: torch.Tensor,
    records: torch.Tensor,
    fmt: int,
    out_features: int,
    pairs: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x @ weight.T for a weight kept in records alone (`pack_q4`, `pack_q8`), dequantized
    panel by panel as the product runs (native/gemm.cpp's `pypto_records_gemm`: the values
    gguf's dequantization gives, the HF conversion's weights; no copy of the weight is held)
    and multiplied with bf16 activations: pairs, AVX512-BF16 dot products; else float32 FMAs.
    Either way each output is one chain over the inputs whatever the rows, so a row's result
    does not depend on its batch. In `dtype`: float32, or bf16 (each sum rounded as it is
    stored: no float32 copy of a wide step's output)."""
    lib = native_kernels.gemm_library()
    assert lib is not None, "records serve every matmul only where the native GEMM is built"
    assert dtype in (torch.float32, torch.bfloat16), dtype  # what the kernel writes
    rows, cols = x.shape
    width = -(-out_features // 16) * 16
    xs = x.to(torch.bfloat16 if pairs else torch.float32).contiguous()
    out = torch.empty(rows, width, dtype=dtype)
    w = native_kernels.Matrix(records.data_ptr(), None, out_features, cols, fmt)
    bf16_out = dtype == torch.bfloat16
    failed = lib.pypto_records_gemm(
        ctypes.byref(w),
        xs.data_ptr(),
        rows,
        out.data_ptr(),
        bf16_out,
        pairs,
        torch.get_num_threads(),
    )
    assert not failed, (rows, out_features, cols, pairs)
    return out if width == out_features else out[:, :out_features].contiguous()


@dequantized_linear.register_fake
def _(
    x: torch.Tensor,
    records: torch.Tensor,
    fmt: int,
    out_features: int,
    pairs: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=dtype)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 or float32 weight [N, K] as native/gemm.cpp's panels: [ceil(N / 16), K, 16],
    panel p holding output rows 16p .. 16p + 15 input by input (rows past N zero)."""
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise PyptoError(f"the native GEMM takes bf16 or float32 weights, not {weight.dtype}")
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % 16))
    return padded.view(-1, 16, k).transpose(1, 2).contiguous()


def dense_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, form: str
) -> torch.Tensor:
    """x @ weight.T (+ bias) over a packed bf16 weight in `form`: "onednn" (the opaque form)
    or "panels". The form is passed, not read off the tensor: under torch.compile's tracing a
    oneDNN tensor's fake does not say it is one."""
    if form == "onednn":
        return packed_linear(x, packed, bias, out_features)
    return panel_linear(x, packed, bias, out_features)


def dequantizing_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """x @ dequantized(weight).T with PyTorch's CPU kernels: int8 per-row scales (group 0)
    or int4 groups."""
    if group == 0:
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, group, scales)


@torch.library.custom_op("pypto::quantized_linear", mutates_args=())
def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    out_features: int,
    dense: torch.Tensor | None,
) -> torch.Tensor:
    """`dequantizing_matmul`, but with more than QUANTIZED_MAX_ROWS rows (prefill) and the
    packed bf16 weight at hand (oneDNN's or panels), the bf16 GEMM runs instead: the
    dequantizing kernels win only while memory-bound. The choice is made in here, out of
    torch.compile's sight, so it adds no guard."""
    if dense is not None and x.shape[0] > QUANTIZED_MAX_ROWS:  # real tensors in here
        return dense_linear(x, dense, None, out_features, "onednn" if dense.is_mkldnn else "panels")
    return dequantizing_matmul(x, qweight, scales, group)


@quantized_linear.register_fake
def _(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    out_features: int,
    dense: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def quantize_int8(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row, values in [-qmax, qmax]: (int8 [N, K],
    scales [N] in the weight's dtype)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / qmax).clamp(min=1e-10)
    q = (w / scale[:, None]).round().clamp(-qmax, qmax).to(torch.int8)
    return q, scale.to(weight.dtype)


W8A8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""A weight quantized for `int8_linear`: (int8 weight, or its high half where split; float32
scale per output row; the int8 weight's int32 sums per output row where inputs get 7 bits, else
None; the weight's low bits where split, else None)."""


class Int8Form(NamedTuple):
    """A w8a8 layer's `Linear.int8`: `W8A8`'s parts and the smoothing factors, in the order
    `int8_linear` takes them."""

    weight: torch.Tensor
    """The int8 weight, or its high half where split."""
    scale: torch.Tensor
    """float32, per output row."""
    row_sums: torch.Tensor | None
    """The weight's int32 sums per output row where inputs get 7 bits, else None."""
    low: torch.Tensor | None
    """The weight's low bits where split, else None."""
    smooth: torch.Tensor | None
    """The smoothing factors per input channel, or None."""


def quantize_w8a8(
    weight: torch.Tensor, seven_bit_inputs: bool | None = None, split: bool = False
) -> W8A8:
    """`quantize_int8` for `int8_linear`. Inputs get 7 bits where seven_bit_inputs says, by
    default where the CPU's int8 GEMM sums pairs of products in int16 (not
    `device.int8_gemm_full_range()`) unless split. Full-range inputs on such a GEMM get 7-bit
    weights (up to 64: 255 x 64 x 2 < 32768), or with split 8-bit weights in two parts that
    the int16 sums hold, multiplied apart: high = floor(q / 2) in [-64, 63] and low = q - 2 x
    high in {0, 1}. Weights have 8 bits whole elsewhere."""
    full = int8_gemm_full_range()
    split = split and not full
    seven = not (full or split) if seven_bit_inputs is None else seven_bit_inputs
    q, scale = quantize_int8(weight, 127 if full or seven or split else 64)
    if split:
        high = torch.div(q, 2, rounding_mode="floor")
        return high, scale.float(), None, q - 2 * high
    return q, scale.float(), q.sum(1, dtype=torch.int32) if seven else None, None


def quantize_w8a8_rows(
    weight: torch.Tensor, smooth: torch.Tensor | None, split: bool = False
) -> W8A8:
    """`quantize_w8a8` of weight * smooth (SmoothQuant's factors per input column, or None),
    `PACK_ROWS` output rows at a time: the same bits (each row is quantized alone), without a
    float32 copy of a large weight whole (an LM head's: 800 MB at 8B)."""
    factors = 1 if smooth is None else smooth
    parts = [quantize_w8a8(rows.float() * factors, split=split) for rows in weight.split(PACK_ROWS)]
    if len(parts) == 1:
        return parts[0]
    q, scale, sums, low = zip(*parts, strict=True)
    return (
        torch.cat(q),
        torch.cat(scale),
        None if sums[0] is None else torch.cat(cast(tuple[torch.Tensor, ...], sums)),
        None if low[0] is None else torch.cat(cast(tuple[torch.Tensor, ...], low)),
    )


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor | None = None,
    low: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ (qweight * scales).T with x quantized to int8 per row, so the matmul runs on the
    CPU's int8 dot products (AVX512-VNNI): about twice the bf16 rate. Plain tensor ops: under
    torch.compile the quantization fuses into the kernel before (RMSNorm, SiLU) and the
    scaling into the one after.

    Without row_sums each row is scaled by its largest magnitude to [-127, 127]. With them
    (a GEMM that sums pairs of u8 x s8 products in int16: AVX2) each row is mapped from its
    smallest to its largest value onto u8 [0, 127] and handed over as s8 (u - 128), which the
    GEMM turns back into u by adding 128: no pair exceeds int16 with 8-bit weights. Then
    u . w = product + 128 * sum(w), and x ~ lo + scale * u. With low (a split weight,
    `quantize_w8a8`) the full-range product is 2 x (x . high) + x . low, two GEMMs."""
    xf = x.float() if smooth is None else x.float() / smooth
    if row_sums is None:
        scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(xf / scale).to(torch.int8)
        dots = torch._int_mm(xq, qweight.t())
        if low is not None:
            dots = 2 * dots + torch._int_mm(xq, low.t())
        return (dots.float() * (scale * scales)).to(x.dtype)
    lo = xf.amin(-1, keepdim=True)
    scale = (xf.amax(-1, keepdim=True) - lo).clamp(min=1e-12) / 127
    xq = (torch.round((xf - lo) / scale) - 128).to(torch.int8)
    dots = torch._int_mm(xq, qweight.t()) + 128 * row_sums
    return ((dots.float() * scale + lo * row_sums.float()) * scales).to(x.dtype)


def quantize_int4(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs (scale and minimum, as Q4_1), packed for
    the CPU kernel: (packed weight, bf16 scales-and-zeros [K / group, N, 2])."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-10)
    q = ((w - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scales = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(weight.dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
    return packed, scales


NATIVE_Q4, NATIVE_Q8, NATIVE_BF16 = 1, 2, 3
RECORDS_WIDE = ("records", "pairs", "panels")
"""How the graphs may multiply by a layer's records (`Linear.wide`)."""
"""The native decode step's weight formats (native/decode.cpp): 4-bit values with a scale and
a minimum per 32 inputs (llama.cpp's Q4_1), 8-bit values with a scale per 32 (Q8_0), or the
plain bf16 weight, read where it lies."""
RECORD_BYTES = {NATIVE_Q4: 320, NATIVE_Q8: 544}
"""Bytes of a packed record of 16 output rows by 32 inputs, per format."""


def records_bytes(fmt: int, rows: int, cols: int) -> int:
    """Bytes of the records of a [rows, cols] matrix in format `fmt` (rows padded to 16)."""
    return -(-rows // 16) * (cols // INT4_GROUP) * RECORD_BYTES[fmt]


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    """[blocks, 16, groups] -> fp16 bytes [blocks, groups, 32]: a group's 16 rows together."""
    half = t.clamp(-65504, 65504).half().permute(0, 2, 1).contiguous()
    return half.view(torch.uint8).reshape(*half.shape[:2], 32)


def _blocks(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-row values [N, groups * w] as [blocks of 16 rows, 16, groups, w], rows padded with
    zeros to a multiple of 16."""
    n = t.shape[0]
    return F.pad(t, (0, 0, 0, -n % 16)).reshape(-1, 16, groups, t.shape[1] // groups)


def q4_records(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Q4 records (`pack_q4`'s layout) of 4-bit values q [N, K] (0..15), and per row and group
    of 32 inputs an fp16 scale and minimum [N, K / 32]: weight = q * scale + minimum. The
    weights of a GGUF's Q4_1 tensor are these exactly."""
    groups = q.shape[1] // INT4_GROUP
    q = _blocks(q.to(torch.uint8), groups).reshape(-1, 16, groups, 4, 8)
    nibbles = (q[..., :4] | (q[..., 4:] << 4)).permute(0, 2, 3, 1, 4)  # [B, G, c, 16, 4]
    nibbles = nibbles.reshape(q.shape[0], groups, 256)
    scale, low = (_blocks(t.float(), groups)[..., 0] for t in (scale, low))
    return torch.cat([nibbles, _fp16_bytes(scale), _fp16_bytes(low)], -1).flatten()


def q8_records(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q8 records (`pack_q8`'s layout) of int8 values q [N, K] and an fp16 scale per row and
    group of 32 inputs [N, K / 32]: weight = q * scale. A GGUF's Q8_0 tensor is these exactly."""
    groups = q.shape[1] // INT4_GROUP
    u = _blocks(q.to(torch.int8).view(torch.uint8) ^ 0x80, groups)  # q + 128, as bytes
    u = u.reshape(-1, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [B, G, c, 16, 4]
    scale = _blocks(scale.float(), groups)[..., 0]
    return torch.cat([u.reshape(u.shape[0], groups, 512), _fp16_bytes(scale)], -1).flatten()


def q8_rows(records: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `rows` [T] of the [N, k] matrix whose Q8 records (`q8_records`' layout) are
    `records`, as bf16 [T, k]: each weight (u - 128) * scale, one float32 product (as a GGUF's
    Q8_0 dequantizes) rounded to bf16, the HF conversion's very values. A tied model's
    embedding is looked up so in its LM head's records (`VocabParallelEmbedding.q8`)."""
    groups = k // INT4_GROUP
    record = records.view(-1, groups, RECORD_BYTES[NATIVE_Q8])
    block, lane = rows // 16, rows % 16
    values = record[..., :512].unflatten(-1, (8, 16, 4))[block, :, :, lane]  # [T, G, 8, 4]
    scales = record[..., 512:].view(torch.float16)[block, :, lane]  # [T, G]
    weights = (values.int() - 128).float() * scales.float()[..., None, None]
    return weights.reshape(len(rows), k).to(torch.bfloat16)


PACK_ROWS = 4096
"""Rows packed at a time (a multiple of a record's 16): a block's records depend on its 16
rows alone, so a large matrix (an LM head of 100 M weights) is packed in parts, its float32
temporaries a part's (about 1.5 GB less at the peak of a MoE's first quantized load)."""


def pack_q4(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] (K a multiple of 32) as the native step's Q4 records: per block of 16
    rows and group of 32 inputs, 4 x 64 bytes of 4-bit values (lane r, byte j: inputs 8c + j
    and 8c + 4 + j of row r, low and high nibble), then the 16 rows' fp16 scales and fp16
    minimums (weight = q * scale + minimum). Flat uint8, 320 bytes a record."""
    n, k = weight.shape
    if n > PACK_ROWS:
        return torch.cat([pack_q4(part) for part in weight.split(PACK_ROWS)])
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low = w.amin(-1).clamp(-65504, 65504).half().float()
    scale = ((w.amax(-1) - low) / 15).clamp(max=65504).half().float()
    q = torch.where(scale[..., None] > 0, (w - low[..., None]) / scale[..., None], 0)
    return q4_records(q.round().clamp(0, 15).reshape(n, k), scale, low)


def pack_q8(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] (K a multiple of 32) as the native step's Q8 records: per block of 16
    rows and group of 32 inputs, 8 x 64 bytes of int8 values + 128 (lane r: inputs 4c to
    4c + 3 of row r), then the 16 rows' fp16 scales (weight = (u - 128) * scale). Flat uint8,
    544 bytes a record."""
    n, k = weight.shape
    if n > PACK_ROWS:
        return torch.cat([pack_q8(part) for part in weight.split(PACK_ROWS)])
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    scale = (w.abs().amax(-1) / 127).clamp(max=65504).half().float()
    q = torch.where(scale[..., None] > 0, w / scale[..., None], 0).round().clamp(-127, 127)
    return q8_records(q.reshape(n, k), scale)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) with optional oneDNN packing or
    weight-only quantization."""

    packed: torch.Tensor | None = None
    """The bf16 weight packed for a GEMM: oneDNN's opaque form, or panels (`pack_panels`)."""
    packed_form: str = ""
    """Which: "onednn" or "panels" (`pack`'s form)."""
    quantized: tuple[torch.Tensor, torch.Tensor, int] | None = None
    """(weight, scales, group): group 0 is int8 per row, else int4 groups."""
    int8: Int8Form | None = None
    """w8a8: `int8_linear`'s arguments after x."""
    exact_int8: bool = False
    """Set by the model on the LM head and on the layers that make attention's queries and
    keys: where `--quantization w8a8`'s GEMM sums pairs of products in int16 (AVX2), these
    keep 8-bit inputs and weights, in two GEMMs (`quantize_w8a8`'s split), as 7 bits cost the
    logits and the attention scores most (SmolLM2's GPL-3 perplexity, AVX2 build: +1.49 % over
    float32 with 7 bits in every layer, +1.09 % with these exact; AVX-512's w8a8 +1.25 %)."""
    native: tuple[torch.Tensor, int] | None = None
    """(records, NATIVE_Q4 or NATIVE_Q8): the weight packed for the native decode step
    (`pack_q4`, `pack_q8`), which alone reads it unless they are the layer's only form."""
    float_out: bool = False
    """Set by the model on the LM head: where its records are its only form, the logits keep
    their float32 sums (not rounded to bf16 first, where two close logits would often tie)."""
    wide: str = "records"
    """How the graphs multiply by records that are the layer's only form (`RECORDS_WIDE`):
    "records", over the records themselves with activations quantized per 32 (`records_linear`);
    "pairs" or "panels", over the records dequantized per call into bf16 (`dequantized_linear`),
    but for steps of a few rows where `records_few`."""
    records_few: bool = False
    """Where records are the layer's only form and the graphs run the model's decodes too (no
    native decode step: a mixture of experts), steps of up to QUANTIZED_MAX_ROWS rows multiply
    by the records themselves (`records_linear`, as the native step would: a 1536 x 2048 Q4
    matrix, AVX-512, 65 vs 209 us a row), wider ones (prefill) as `wide` says."""

    def pack(self, form: str = "onednn") -> None:
        """Repack the (loaded) weight for oneDNN, or in panels for the native GEMM (`form`
        "panels"); the plain weight stays for tying/loading. The form is the run plan's
        (`device.linear_packing`: oneDNN's bf16 only where oneDNN packs it)."""
        weight = self.weight.detach()
        self.packed_form = form
        if form == "panels":
            self.packed = pack_panels(weight)
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    @property
    def row_bounds(self) -> tuple[int, ...]:
        """Row counts at which `matmul`'s code branches (when traced): a step of at most
        b rows runs other code than one of more, for each b."""
        if self.quantized is None:
            return (QUANTIZED_MAX_ROWS,) if self.records_few and self.wide != "records" else ()
        return (1,) if self.int8 is None else (1, QUANTIZED_MAX_ROWS)

    def quantize(self, kind: str, smooth: torch.Tensor | None = None, exact: bool = True) -> None:
        """Quantize the (loaded) weight; the plain weight stays for tying/loading. smooth:
        w8a8's factors per input channel (models/calibration.py), None for none. A kind of
        two (int4-w8a8) keeps both forms. exact: w8a8 on an `exact_int8` layer keeps 8 bits
        both on any CPU (`quantize_w8a8`'s split); `pack_linears` says so for --quantization
        w8a8 only: int4-w8a8's w8a8 serves its wide steps, for speed, its accuracy int4's."""
        if "-" in kind:
            for part in kind.split("-"):
                self.quantize(part, smooth, exact)
            return
        weight = self.weight.detach()
        if kind == "w8a8":
            split = exact and self.exact_int8
            self.int8 = Int8Form(*quantize_w8a8_rows(weight, smooth, split), smooth)
            return
        multiple = {"int8": INT8_MULTIPLE, "q4": INT4_GROUP, "q8": INT4_GROUP}.get(
            kind, INT4_GROUP * INT4_INNER_K_TILES
        )
        if self.in_features % multiple:
            raise PyptoError(
                f"{kind} quantization needs input sizes divisible by {multiple}; a layer has "
                f"{self.in_features}",
                "quantization",
            )
        if kind == "int4" and self.out_features % INT4_ROWS:
            raise PyptoError(
                f"int4 quantization needs output sizes divisible by {INT4_ROWS}; a layer has "
                f"{self.out_features}",
                "quantization",
            )
        if kind == "int8":
            self.quantized = (*quantize_int8(weight), 0)
        elif kind == "q4":  # the native decode step's forms
            self.native = (pack_q4(weight), NATIVE_Q4)
        elif kind == "q8":
            self.native = (pack_q8(weight), NATIVE_Q8)
        else:
            self.quantized = (*quantize_int4(weight), INT4_GROUP)

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        """The quantized forms as named tensors, to be kept on disk (`load_quantized` takes
        them back)."""
        out: dict[str, torch.Tensor] = {}
        if self.quantized is not None:
            out["quantized.weight"], out["quantized.scales"], _ = self.quantized
        if self.int8 is not None:  # int8.weight, int8.scale, and the parts it has
            out |= {f"int8.{k}": t for k, t in self.int8._asdict().items() if t is not None}
        if self.native is not None:
            out[f"native.{self.native[1]}"] = self.native[0]
        return out

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `quantized_tensors` of an earlier load (`tensors`) are this layer's shapes."""
        return bool(tensors) and all(
            t.numel() == records_bytes(int(part.split(".")[1]), self.out_features, self.in_features)
            if part.startswith("native.")
            else "weight" not in part or t.shape[0] == self.out_features
            for part, t in tensors.items()
        )

    def load_quantized(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `quantized_tensors` gave (the group size follows from the scales:
        one per output row is int8, groups of inputs int4)."""
        if "quantized.weight" in tensors:
            scales = tensors["quantized.scales"]
            group = 0 if scales.dim() == 1 else self.in_features // scales.shape[0]
            self.quantized = (tensors["quantized.weight"], scales, group)
        if "int8.weight" in tensors:
            self.int8 = Int8Form(
                tensors["int8.weight"],
                tensors["int8.scale"],
                tensors.get("int8.row_sums"),
                tensors.get("int8.low"),
                tensors.get("int8.smooth"),
            )
        for fmt in (NATIVE_Q4, NATIVE_Q8):
            if f"native.{fmt}" in tensors:
                self.native = (tensors[f"native.{fmt}"], fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), through the quantized or packed weight when there is one;
        in x's dtype (float32 for `float_out` records)."""
        # int4-w8a8 picks by rows: under torch.compile a trace-time branch (and a guard, so
        # only where both forms exist: a w8a8 layer must not get a graph per side)
        if self.int8 is not None and (self.quantized is None or x.shape[0] > QUANTIZED_MAX_ROWS):
            out = int8_linear(x, *self.int8)
            return out if bias is None else out + bias
        if self.quantized is not None:
            if x.shape[0] == 1 or self.int8 is not None:  # the kernel itself, no custom op
                out = dequantizing_matmul(x, *self.quantized)
            else:
                out = quantized_linear(x, *self.quantized, self.out_features, self.packed)
            return out if bias is None else out + bias
        if self.packed is not None:
            return dense_linear(x, self.packed, bias, self.out_features, self.packed_form)
        if self.native is not None:  # its records alone: every matmul
            dtype = torch.float32 if self.float_out else x.dtype
            few = self.records_few and x.shape[0] <= QUANTIZED_MAX_ROWS
            if self.wide == "records" or few:
                out = records_linear(x, *self.native, self.out_features).to(dtype)
            else:
                pairs = self.wide == "pairs"
                out = dequantized_linear(x, *self.native, self.out_features, pairs, dtype)
            return out if bias is None else out + bias
        return F.linear(x, self.weight, bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across the tensor-parallel group: each rank
    multiplies its slice, an all-reduce sums the partial products (in float32), and the bias
    is added once, after the sum. With a group of one it is a plain Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Group) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp_size = tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = tp_all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across the tensor-parallel group
    (padded to a multiple of its size): a rank looks up the ids in its range, zeros for the
    others, and an all-reduce completes every row. The parameter keeps nn.Embedding's name."""

    q8: torch.Tensor | None = None
    """Where the weight is None: the Q8 records (`q8_records`) of the tied LM head, which hold
    the same matrix (a GGUF's Q8_0 token embedding, served from its records alone): rows are
    looked up there (`q8_rows`)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Group) -> None:
        super().__init__()
        self.tp_size = tp.size
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows `ids` (each within its shard)."""
        if self.q8 is None:
            return F.embedding(ids, self.weight)
        return q8_rows(self.q8, ids, self.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        rows = self.rows(local.clamp(0, self.shard - 1))
        return tp_all_reduce(rows * inside[:, None])


def _weight_unread(int8: bool, records: bool, quantized: bool, native: bool) -> bool:
    """Whether a Linear's matmuls all run on its other forms (`int8`: w8a8's; `records`: the
    native step's; `quantized`: weight-only int4/int8), never on its bf16 weight. `matmul`
    never reads the weight of a layer with an int8 form (its first two branches serve every
    row count); the native decode step (`native`) reads a layer's records, or else its bf16
    weight, so there only int4-w8a8's layers and the w8a8-q8 heads (int8 form and records)
    go without it."""
    return int8 and (not native or (records and not quantized))


def drop_unread_weights(model: nn.Module, native: bool) -> None:
    """Drop the bf16 weight of every Linear whose matmuls all run on its other forms
    (`_weight_unread`), so that it is not held beside them; a tied head's stays with the
    embedding that shares it. After any calibration, which reads the weights."""
    unread = [
        layer
        for layer in model.modules()
        if isinstance(layer, Linear)
        and layer.weight is not None
        and _weight_unread(
            layer.int8 is not None, layer.native is not None, layer.quantized is not None, native
        )
    ]
    for layer in unread:
        layer.register_parameter("weight", None)


def weights_unread(quantization: str, native: bool) -> bool:
    """Whether `drop_unread_weights` drops every Linear's bf16 weight (a tied head's aside)
    under `quantization` (not `records_only`): the rule `_weight_unread` applied to the forms
    `quantized_kind` gives a layer that is not the head."""
    parts = set(quantized_kind(False, quantization, native, False).split("-"))
    return _weight_unread(
        "w8a8" in parts, bool(parts & {"q4", "q8"}), bool(parts & {"int4", "int8"}), native
    )


def quantized_kind(head: bool, quantization: str, native: bool, records_only: bool) -> str:
    """The form `Linear.quantize` gives a layer (`head`: the LM head) under `quantization`, as
    `pack_linears` says."""
    if records_only:
        return "q8" if head or quantization == "int8" else "q4"
    if head and quantization == "int4":
        return "q8" if native else "int8"
    if head and quantization == "int4-w8a8":
        return "w8a8-q8" if native else "w8a8"  # int8, and its GEMV beats the int8 kernel's
    return quantization.replace("int4", "q4") if native else quantization


def pack_linears(
    model: nn.Module,
    quantization: str | None = None,
    smooth: dict[Linear, torch.Tensor] | None = None,
    saved: dict[str, dict[str, torch.Tensor]] | None = None,
    native: bool = False,
    pack: str | None = None,
    records_only: bool = False,
    wide: str = "records",
) -> int:
    """Pack in the form `pack` names (the run plan's choice, `device.linear_packing`: "onednn"
    or "panels"; None: wide matmuls run on the plain or quantized weights) and quantize every
    `Linear` of the model; returns how many there were. Under int4 the LM head gets int8, as
    llama.cpp keeps its output tensor above 4 bits (Q8_0 in SmolLM2's Q4_1 file): the logits are
    where small models lose most to quantization; under int4-w8a8 it gets w8a8, whose one-row
    matmul is 1.4x the weight-only int8 kernel's (the head is a fifth of SmolLM2's weights).
    w8a8 and int4-w8a8 keep no bf16 weight packed (their wide matmuls run in int8), and take
    each layer's smoothing factors. saved: each layer's `quantized_tensors` by module name, from
    an earlier load, taken instead of quantizing. native: the model's decodes of a few run
    through the native decode step (executor/native_decode.py), so the int4 of int4 and
    int4-w8a8 is its Q4 (`pack_q4`) and the head gets its Q8 too: the compiled graphs then never
    meet int4, and their wide form (the packed bf16 weight, or w8a8) serves every step they
    run. records_only (--batch-invariant with int8, int4 or int4-w8a8): each weight is kept
    in the native step's records alone (int4's and int4-w8a8's Q4, int8's and every head's
    Q8) and they serve every matmul, whatever its rows (`records_linear`): one product, so a
    row's result does not depend on its batch. wide: how the graphs multiply by such
    records (`Linear.wide`, the run plan's `records_wide`); where they run the decodes too (not
    `native`), steps of a few rows over the records themselves (`Linear.records_few`)."""
    head = getattr(model, "lm_head", None)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    int8_wide = quantization is not None and quantization.endswith("w8a8")
    records_only = records_only and quantization not in (None, "w8a8")
    for name, layer in layers:
        if pack is not None and not int8_wide and not records_only:
            layer.pack(pack)  # quantized layers keep it for prefill-sized matmuls
        if quantization is None:
            continue
        if saved is not None:
            layer.load_quantized(saved[name])
            continue
        if layer.weight is None and layer.native is not None and records_only:
            continue  # packed as the checkpoint streamed (models/loader.py)
        if layer.weight is None and layer.int8 is not None:
            continue  # quantized as the checkpoint streamed, calibrated layer by layer
        if layer.weight is None:
            raise PyptoError(f"{name} has no weight to quantize: its records were not given")
        kind = quantized_kind(layer is head, quantization, native, records_only)
        layer.quantize(kind, (smooth or {}).get(layer), exact=quantization == "w8a8")
    if records_only:  # the records are the weight now: no bf16 copy beside them
        for _, layer in layers:
            layer.register_parameter("weight", None)
            layer.wide = wide
            layer.records_few = not native
    return len(layers)
