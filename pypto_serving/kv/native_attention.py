"""The native paged attention kernels (native/attention.cpp), called through ctypes.

PyTorch cannot read keys and values where they lie (pages scattered through the cache), so its
path gathers each sequence's pages into a padded batch first. For decodes, which are
memory-bound, that gather and the padded reads cost more than the attention itself; for
prefill chunks, the padded, masked flash attention does up to 3x the useful work. The kernels
read each page in place, over torch's own OpenMP threads: decodes one query per sequence,
prefill chunks in tiles of queries with the causal mask skipping pages past a tile's end.
The library (`pypto_serving.native`) is built for one attention shape, where the run plan
attends with it (engine/plan.py: on the CPU, a kind with kernels, a shape they `take`); where
it is None (no compiler, a failed build: said once in the log) attention stays on the
PyTorch path; both paths are tested against a float64 reference.
"""

from __future__ import annotations

import ctypes

import torch

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP, MAX_PAGE = 256, 16, 256
INT8_SCALE_BYTES = 4
"""An int8 cache row is head_dim int8 values, then their float32 scale."""


def takes(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, page_size: int) -> bool:
    """Whether the kernels take this attention shape: float32 or bfloat16, head_dim a multiple
    of 16 up to 256, up to 16 query heads per KV head, pages of up to 256 tokens."""
    return (
        dtype in DTYPES
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and page_size <= MAX_PAGE
    )


def paged_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    page_size: int,
    q_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D]: sequence b's queries are the last q_lens[b] of its first
    ctx_lens[b] tokens (q_lens None: one query each, decodes), its tokens after the previous
    sequence's; its pages are block_table [B, W] in one layer's caches [Hkv, slots, D] (int8
    caches: [Hkv, slots, D + 4], see `store_kv`). Causal. Returns [T, H, D]. `lib` must be
    the library built for these shapes; the tensors are on the CPU, and the caches and int64
    tables contiguous."""
    q = q.contiguous()
    heads, dim = q.shape[1:]
    kv_heads, slots, row = k_cache.shape
    out = torch.empty_like(q)
    failed = lib.pypto_paged_attention(
        DTYPES[q.dtype],
        k_cache.dtype == torch.int8,
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        None if q_lens is None else q_lens.data_ptr(),
        ctx_lens.data_ptr(),
        out.data_ptr(),
        len(ctx_lens),
        heads,
        kv_heads,
        dim,
        block_table.shape[1],
        page_size,
        slots * row,
        dim**-0.5,
    )
    if failed:
        raise ValueError(
            f"the attention library was not built for q {tuple(q.shape)}, "
            f"{kv_heads} KV heads, pages of {page_size}"
        )
    return out


def store_kv(
    lib: ctypes.CDLL,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Write k, v [T, Hkv, D] of a step's new tokens into their slots (slot_mapping [T],
    int64, contiguous) of one layer's caches [Hkv, slots, D]; False (nothing written) where k
    or v is not laid out as rows of contiguous heads, for the caller to write them itself.
    Into int8 caches [Hkv, slots, D + 4] each row goes quantized: D int8 values, rounded to
    nearest, then the float32 scale they are multiplied by (the row's largest magnitude / 127)
    in its last 4 bytes."""
    tokens, kv_heads, dim = k.shape
    for t in (k, v):  # heads dim apart (a single head's stride is whatever), values adjacent
        if t.stride(2) != 1 or (kv_heads > 1 and t.stride(1) != dim):
            return False
    int8 = k_cache.dtype == torch.int8
    (lib.pypto_store_kv_int8 if int8 else lib.pypto_store_kv)(
        DTYPES[k.dtype] if int8 else k.element_size(),
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        tokens,
        kv_heads,
        k.stride(0),
        v.stride(0),
        k_cache.shape[1] * k_cache.shape[2],
    )
    return True
