"""The native paged attention kernels (native_attention.cpp): built once, loaded with ctypes.

PyTorch cannot read keys and values where they lie (pages scattered through the cache), so its
path gathers each sequence's pages into a padded batch first. For decodes, which are
memory-bound, that gather and the padded reads cost more than the attention itself; for
prefill chunks, the padded, masked flash attention does up to 3x the useful work. The kernels
read each page in place, over torch's own OpenMP threads: decodes one query per sequence,
prefill chunks in tiles of queries with the causal mask skipping pages past a tile's end.

The library is compiled on first use with the C++ compiler Inductor also uses (`$CXX`, else
g++), for this CPU (-march=native) and for one attention shape (query heads per KV head and
head_dim as constants, so loops unroll and the decode queries stay in registers; about a
second of compiling). It is cached under `cache_dir()/kernels` by a key of the source, flags,
compiler and the CPU's flags, so a restart only loads it. Without a compiler, or when the
build fails, `library()` is None (said once in the log) and attention stays on the PyTorch
path; both paths are tested against a float64 reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

import torch

from pypto_serving.device import cpu_flags, use_native_attention
from pypto_serving.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP, MAX_PAGE = 256, 16, 256
INT8_SCALE_BYTES = 4
"""An int8 cache row is head_dim int8 values, then their float32 scale."""


def build(group: int, head_dim: int, out_dir: Path, compiler: str | None = None) -> Path | None:
    """The library for `group` query heads per KV head and `head_dim`, in `out_dir` (built now
    unless already there), or None when there is no compiler or the build fails (logged)."""
    compiler = compiler or os.environ.get("CXX", "g++")
    found = shutil.which(compiler)
    if found is None:
        log.warning("no C++ compiler %r: attention stays on PyTorch's", compiler)
        return None
    try:
        version = subprocess.run(
            [found, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("C++ compiler %s unusable (%s): attention stays on PyTorch's", found, e)
        return None
    flags = (*FLAGS, f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags), found, version, *sorted(cpu_flags())):
        key.update(part.encode() if isinstance(part, str) else part)
    target = out_dir / f"attention-g{group}-d{head_dim}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        run = subprocess.run(
            [found, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True
        )
        if run.returncode != 0:
            log.warning(
                "building the attention kernels failed; attention stays on PyTorch's:\n%s",
                run.stderr.strip()[-2000:],
            )
            return None
        os.replace(built, target)  # atomic: processes building at once never see half a file
    log.info("built the attention kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target


_library_lock = threading.Lock()


def library(group: int, head_dim: int) -> ctypes.CDLL | None:
    """The loaded library for this attention shape (built on first need), or None. Takes a
    lock: the engine starts the build in a background thread while it loads the model."""
    with _library_lock:
        return _library(group, head_dim)


@cache
def _library(group: int, head_dim: int) -> ctypes.CDLL | None:
    path = build(group, head_dim, cache_dir() / "kernels")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("cannot load %s (%s): attention stays on PyTorch's", path, e)
        return None
    fn = lib.pypto_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 6]
    fn.argtypes += [ctypes.c_int64, ctypes.c_float]
    for store in (lib.pypto_store_kv, lib.pypto_store_kv_int8):
        store.restype = None
        store.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_int, ctypes.c_int]
        store.argtypes += [ctypes.c_int64] * 3
    return lib


def library_for(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
) -> ctypes.CDLL | None:
    """The library for a model's attention where the kernels apply (the CPU, float32 or
    bfloat16, head_dim a multiple of 16 up to 256, up to 16 query heads per KV head, pages of
    up to 256 tokens), built or loaded now; None means PyTorch's attention (logged)."""
    if not use_native_attention(device):
        return None
    group = heads // kv_heads
    if (
        dtype not in DTYPES
        or head_dim % 16
        or head_dim > MAX_HEAD_DIM
        or heads % kv_heads
        or group > MAX_GROUP
        or page_size > MAX_PAGE
    ):
        log.info(
            "attention on the PyTorch path: the native kernels do not take %s, "
            "head_dim %d, %d query heads per KV head or pages of %d",
            dtype,
            head_dim,
            group,
            page_size,
        )
        return None
    return library(group, head_dim)


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
