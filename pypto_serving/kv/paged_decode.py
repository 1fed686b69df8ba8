"""The native decode attention kernel (paged_decode.cpp): built once, loaded through ctypes.

Decode attention is memory-bound: each decoding sequence reads all of its keys and values once
per layer. PyTorch cannot read them where they lie (pages scattered through the cache), so its
path gathers them into a padded batch first and reads everything twice more. The kernel reads
each page in place, with an online softmax, over torch's own OpenMP threads.

The library is compiled on first use with the C++ compiler Inductor also uses (`$CXX`, else
g++), for this CPU (-march=native) and for one attention shape (query heads per KV head and
head_dim as constants, so the loops unroll and the queries stay in registers; half a second of
compiling). It is cached under `cache_dir()/kernels` by a key of the source, flags, compiler
and the CPU's flags, so a restart only loads it. Without a compiler, or
when the build fails, `library()` is None (said once in the log) and attention stays on the
PyTorch path; both paths are tested against each other.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

from pypto_serving.device import cpu_flags
from pypto_serving.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP, MAX_PAGE = 256, 16, 256


def build(group: int, head_dim: int, out_dir: Path, compiler: str | None = None) -> Path | None:
    """The library for `group` query heads per KV head and `head_dim`, in `out_dir` (built now
    unless already there), or None when there is no compiler or the build fails (logged)."""
    compiler = compiler or os.environ.get("CXX", "g++")
    found = shutil.which(compiler)
    if found is None:
        log.warning("no C++ compiler %r: decode attention stays on PyTorch's", compiler)
        return None
    try:
        version = subprocess.run(
            [found, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("C++ compiler %s unusable (%s): decode attention stays on PyTorch's", found, e)
        return None
    flags = (*FLAGS, f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags), found, version, *sorted(cpu_flags())):
        key.update(part.encode() if isinstance(part, str) else part)
    target = out_dir / f"paged_decode-g{group}-d{head_dim}-{key.hexdigest()[:16]}.so"
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
                "building the decode attention kernel failed; attention stays on PyTorch's:\n%s",
                run.stderr.strip()[-2000:],
            )
            return None
        os.replace(built, target)  # atomic: processes building at once never see half a file
    log.info("built the decode attention kernel in %.1f s: %s", time.perf_counter() - start, target)
    return target


@cache
def library(group: int, head_dim: int) -> ctypes.CDLL | None:
    """The loaded library for this attention shape (built on first need), or None."""
    path = build(group, head_dim, cache_dir() / "kernels")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("cannot load %s (%s): decode attention stays on PyTorch's", path, e)
        return None
    fn = lib.pypto_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 6, ctypes.c_int64]
    fn.argtypes += [ctypes.c_float]
    return lib


def supports(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, page_size: int) -> bool:
    """Whether the kernel can be built for these shapes (else the PyTorch path serves)."""
    return (
        dtype in DTYPES
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and page_size <= MAX_PAGE
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Attention of one query per sequence: q [B, H, D] over the first ctx_lens[b] tokens of
    sequence b, whose pages are block_table [B, W] (int64) in the caches [Hkv, slots, D] of one
    layer. Returns [B, H, D]. `lib` must be the library built for these shapes; the tensors are
    on the CPU, the caches and tables contiguous."""
    q = q.contiguous()
    batch, heads, dim = q.shape
    kv_heads, slots, _ = k_cache.shape
    out = torch.empty_like(q)
    failed = lib.pypto_paged_decode(
        DTYPES[q.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        ctx_lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_table.shape[1],
        page_size,
        slots * dim,
        dim**-0.5,
    )
    if failed:
        raise ValueError(
            f"the decode attention library was not built for q {tuple(q.shape)}, "
            f"{kv_heads} KV heads, pages of {page_size}"
        )
    return out
