"""The native CPU kernels: one C++ library, built once per machine and loaded with ctypes.

- `attention.cpp`: paged attention over the KV pages in place (decodes, prefill chunks) and
  the K/V writes; called by the attention operator (`kv/native_attention.py`). A step's
  decodes split their contexts into spans by `spans.h`'s plan, which decode.cpp includes too.
- `gemm.cpp`: matmuls of many rows over bf16 weights in panels, in float32 (where oneDNN
  cannot pack bf16: AVX2 CPUs), each output one chain of FMAs whatever the batch, and
  records.h's product over 4-bit and 8-bit records for any number of rows (--batch-invariant's
  quantized matmuls); its own library (`gemm_library`), called by `ops/linear.py`.
- `decode.cpp`: the fused decode step, the whole forward of a step of a few decodes in one
  call over weights packed by `ops/linear.py`; its matmuls are records.h's (4-bit and 8-bit
  records: AVX512-VNNI dot products, AVX2's vpmaddubsw/vpmaddwd or AVX-VNNI, plain loops
  elsewhere; bf16 weights: AVX512-BF16 dot products, or widened to float32 and FMAs on AVX2);
  called by `executor/native_decode.py`.
- `compressed.cpp`: DeepSeek-V4's compressed attention (the window's rows, the entries, the
  indexer's top k, the sinks) of decodes and prefill chunks, in blocks of a sequence's
  consecutive queries over the kind's pages in place; its own library
  (`compressed_library`), called by `kv/kinds/compressed.py`.
- `shm.cpp`: the collectives between the ranks of one machine over a shared-memory segment
  (all-reduce, all-gather, broadcast: spin, then yield, then nap); its own library
  (`shm_library`), called by `shm_collectives.py`.

The library is compiled on first use with the C++ compiler Inductor also uses (`$CXX`, else
g++), for this CPU's ISA, which picks each kernel's code path (`device.cpu_march`:
-march=native, or x86-64-v3 for an AVX2 CPU, with AVX-VNNI where it has it; PYPTO_CPU_ISA
included), and for one attention shape (query heads per KV head and head_dim as constants, so
loops unroll and the decode queries stay in registers; a few seconds of compiling). The fused
decode step depends on no shape: it is compiled once into an object that every shape's library
links (both compile at once where the object is new).
It is cached under `cache_dir()/kernels` by a key of the sources, flags, compiler and the
CPU's flags, so a restart only loads it (loading a library runs its code: one is only
loaded from a cache folder no other user can write, and only if it is this user's file that no
one else can write; elsewhere it is built in a private temporary folder instead). Without a
compiler, or when the build fails, `library()` is None (said once in the log) and attention
stays on PyTorch's path, the decode steps on the compiled graphs. Work is split over the OpenMP
team that torch itself uses (the library links the libgomp torch has loaded).
"""

from __future__ import annotations

import atexit
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

from pypto_serving.device import cpu_flags, cpu_march
from pypto_serving.paths import trusted_cache_dir, untrusted

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("attention.cpp"),)
"""The kernels built per attention shape (GROUP and HEAD_DIM defined)."""
SHAPE_FREE_SOURCES = (Path(__file__).with_name("decode.cpp"),)
"""Linked into every attention shape's library but touched by no shape constant: each is
compiled once into an object kept beside the libraries (`decode-<key>.o`), so a new shape
compiles attention.cpp alone."""
GEMM_SOURCES = (Path(__file__).with_name("gemm.cpp"),)
"""The panel GEMM and the product over records, which no shape constant touches: one library
for every model."""
SHM_SOURCES = (Path(__file__).with_name("shm.cpp"),)
"""The shared-memory collectives: one library for every model."""
COMPRESSED_SOURCES = (Path(__file__).with_name("compressed.cpp"),)
"""DeepSeek-V4's compressed attention: one library for every model."""
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


def compiler(name: str | None = None) -> str | None:
    """The C++ compiler's path (`name`, else `$CXX`, else g++), or None where there is none."""
    return shutil.which(name or os.environ.get("CXX", "g++"))


def build(
    group: int,
    head_dim: int,
    out_dir: Path,
    cxx: str | None = None,
    extra_flags: tuple[str, ...] = (),
    source_dir: Path | None = None,
) -> Path | None:
    """The library for `group` query heads per KV head and `head_dim`, in `out_dir` (built now
    unless already there), or None when there is no compiler or the build fails (logged).
    extra_flags: appended to the compiler's (tests build the portable code paths with
    `-mno-avx512vnni`). source_dir: a folder holding other versions of these sources (and
    their headers), built instead (`bench/native_rows.py --against` builds a revision's)."""
    defines = (f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}")
    name = f"kernels-g{group}-d{head_dim}"
    sources: tuple[Path, ...] = SOURCES
    shape_free: tuple[Path, ...] = SHAPE_FREE_SOURCES
    if source_dir is not None:
        sources = tuple(source_dir / s.name for s in sources)
        shape_free = tuple(source_dir / s.name for s in shape_free)
    return _build(sources, defines, name, out_dir, cxx, extra_flags, shape_free)


def build_gemm(
    out_dir: Path, cxx: str | None = None, extra_flags: tuple[str, ...] = ()
) -> Path | None:
    """The panel GEMM's library (gemm.cpp) in `out_dir`, as `build`."""
    return _build(GEMM_SOURCES, (), "gemm", out_dir, cxx, extra_flags)


def build_shm(out_dir: Path, cxx: str | None = None) -> Path | None:
    """The shared-memory collectives' library (shm.cpp) in `out_dir`, as `build`."""
    return _build(SHM_SOURCES, (), "shm", out_dir, cxx, ())


def build_compressed(
    out_dir: Path, cxx: str | None = None, extra_flags: tuple[str, ...] = ()
) -> Path | None:
    """The compressed attention's library (compressed.cpp) in `out_dir`, as `build`."""
    return _build(COMPRESSED_SOURCES, (), "compressed", out_dir, cxx, extra_flags)


def _headers(sources: tuple[Path, ...]) -> list[Path]:
    """The headers the sources may include: every .h beside them (records.h, which decode.cpp
    and gemm.cpp include; spans.h, attention.cpp's and decode.cpp's), so a build of another
    folder's sources is keyed by its own."""
    return sorted({h for s in sources for h in s.parent.glob("*.h")})


def _key(sources: tuple[Path, ...], flags: tuple[str, ...], found: str, version: str) -> str:
    """What a build's output depends on: its sources and the headers beside them, the flags,
    the compiler and the CPU's flags."""
    key = hashlib.sha256()
    texts = (s.read_bytes() for s in (*sources, *_headers(sources)))
    parts: list[bytes | str] = [*texts, " ".join(flags), found, version]
    for part in parts:
        key.update(part.encode() if isinstance(part, str) else part)
    for flag in sorted(cpu_flags()):
        key.update(flag.encode())
    return key.hexdigest()[:16]


def _kept(path: Path) -> bool:
    """Whether `path` was built before and may be used (this user's, writable by no one else)."""
    if not path.exists():
        return False
    why = untrusted(path)
    if why is not None:
        log.warning("not using %s (%s): building it again", path, why)
    return why is None


def _build(
    sources: tuple[Path, ...],
    defines: tuple[str, ...],
    name: str,
    out_dir: Path,
    cxx: str | None,
    extra_flags: tuple[str, ...],
    shape_free: tuple[Path, ...] = (),
) -> Path | None:
    """Compiles `sources` (with `defines`) and whichever `shape_free` object is not kept yet,
    at once (one compiler each), then links them into the library."""
    found = compiler(cxx)
    if found is None:
        log.warning("no C++ compiler %r: the native kernels are off", cxx or "g++")
        return None
    try:
        version = subprocess.run(
            [found, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("C++ compiler %s unusable (%s): the native kernels are off", found, e)
        return None
    flags = (*FLAGS, *cpu_march(), *extra_flags)
    target = out_dir / f"{name}-{_key(sources + shape_free, flags + defines, found, version)}.so"
    if _kept(target):
        return target
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        jobs: list[tuple[subprocess.Popen[str], Path, Path | None]] = []  # (compiler, out, kept)

        def compile_(source: Path, obj: Path, kept: Path | None, more: tuple[str, ...]) -> None:
            argv = [found, *flags, *more, "-c", "-o", str(obj), str(source)]
            proc = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            jobs.append((proc, obj, kept))

        objects = []
        for source in shape_free:  # one object for every shape, kept beside the libraries
            shared = out_dir / f"{source.stem}-{_key((source,), flags, found, version)}.o"
            if not _kept(shared):
                compile_(source, Path(tmp) / shared.name, shared, ())
            objects.append(shared)
        for source in sources:
            obj = Path(tmp) / f"{source.stem}.o"
            compile_(source, obj, None, defines)
            objects.append(obj)
        failed = []
        for proc, obj, _ in jobs:
            err = proc.communicate()[1]
            if proc.returncode != 0:
                failed.append(err or f"{obj.name}: the compiler exited with {proc.returncode}")
        built = Path(tmp) / target.name
        if not failed:
            for _, obj, kept in jobs:
                if kept is not None:
                    obj.chmod(0o600)  # linked into a library this process loads: as private
                    os.replace(obj, kept)
            link = [found, *flags, "-o", str(built), *map(str, objects)]
            run = subprocess.run(link, capture_output=True, text=True)
            if run.returncode != 0:
                failed.append(run.stderr)
        if failed:
            log.warning(
                "building the native kernels failed; they are off:\n%s",
                "\n".join(failed).strip()[-2000:],
            )
            return None
        built.chmod(0o700)  # only this user may change what it loads
        os.replace(built, target)  # atomic: processes building at once never see half a file
    log.info("built the native kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target


def _open(path: Path) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("cannot load %s (%s): the native kernels are off", path, e)
        return None


def load(path: Path) -> ctypes.CDLL | None:
    """The library at `path` with its entry points' signatures, or None (logged)."""
    lib = _open(path)
    if lib is None:
        return None
    c_int, c_int64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn = lib.pypto_paged_attention
    fn.restype = c_int
    fn.argtypes = [c_int, c_int, *[ptr] * 7, *[c_int] * 6, c_int64, ctypes.c_float]
    for store in (lib.pypto_store_kv, lib.pypto_store_kv_int8):
        store.restype = None
        store.argtypes = [c_int, *[ptr] * 5, c_int, c_int, *[c_int64] * 3]
    lib.pypto_decode_step.restype = c_int
    lib.pypto_decode_step.argtypes = [ptr, ptr]
    lib.pypto_native_max_rows.restype = c_int
    lib.pypto_native_max_rows.argtypes = []
    lib.pypto_native_wide_rows.restype = c_int
    lib.pypto_native_wide_rows.argtypes = []
    return lib


def load_gemm(path: Path) -> ctypes.CDLL | None:
    """The panel GEMM's library at `path` with its signatures, or None (logged)."""
    lib = _open(path)
    if lib is None:
        return None
    c_int, ptr = ctypes.c_int, ctypes.c_void_p
    for fn in (lib.pypto_panel_gemm, lib.pypto_panel_gemm_f32):
        fn.restype = c_int
        fn.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ctypes.c_int64, *[c_int] * 4]
    lib.pypto_packed_product.restype = c_int
    lib.pypto_packed_product.argtypes = [ptr, ptr, c_int, ptr, c_int]
    lib.pypto_moe_records.restype = c_int
    lib.pypto_moe_records.argtypes = [
        ptr,
        ctypes.c_int64,
        ptr,
        ctypes.c_int64,
        ptr,
        c_int,
        ptr,
        c_int,
        ptr,
        ptr,
        c_int,
        ptr,
        c_int,
    ]
    lib.pypto_records_gemm.restype = c_int
    lib.pypto_records_gemm.argtypes = [ptr, ptr, c_int, ptr, c_int, c_int, c_int]
    lib.pypto_records_pairs_built.restype = c_int
    lib.pypto_records_pairs_built.argtypes = []
    return lib


def load_shm(path: Path) -> ctypes.CDLL | None:
    """The shared-memory collectives' library at `path` with its signatures, or None."""
    lib = _open(path)
    if lib is None:
        return None
    c_int, c_int64, ptr, c_double = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    who = ctypes.POINTER(c_int)
    lib.pypto_shm_bytes.restype = c_int64
    lib.pypto_shm_bytes.argtypes = [c_int, c_int64]
    lib.pypto_shm_attach.restype = ptr
    lib.pypto_shm_attach.argtypes = [c_int, c_int, c_int, c_int64]
    lib.pypto_shm_detach.restype = None
    lib.pypto_shm_detach.argtypes = [ptr]
    lib.pypto_shm_all_reduce.restype = c_int
    lib.pypto_shm_all_reduce.argtypes = [ptr, ptr, ptr, c_int64, c_double, who]
    lib.pypto_shm_all_gather.restype = c_int
    lib.pypto_shm_all_gather.argtypes = [ptr, ptr, ptr, c_int64, c_int64, c_double, who]
    lib.pypto_shm_broadcast.restype = c_int
    lib.pypto_shm_broadcast.argtypes = [ptr, ptr, c_int64, c_int, c_double, who]
    return lib


def load_compressed(path: Path) -> ctypes.CDLL | None:
    """The compressed attention's library at `path` with its signature, or None (logged)."""
    lib = _open(path)
    if lib is None:
        return None
    c_int, c_int64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn = lib.pypto_compressed_attention
    fn.restype = c_int
    fn.argtypes = [
        *[c_int] * 4,  # dtype, queries, heads, dim
        *[ptr] * 4,  # q, sinks, seqs, positions
        c_int,  # window
        ptr,  # rows
        *[c_int64] * 2,  # row_width, row_offset
        ptr,  # block_table
        c_int64,  # table_width
        *[c_int] * 2,  # page, ratio
        ptr,  # entries
        *[c_int64] * 2,  # page_width, entry_offset
        ptr,  # entry_table
        c_int64,  # entry_table_width
        *[c_int] * 2,  # index_heads, index_dim
        *[ptr] * 2,  # index_q, index_weights
        c_int64,  # index_offset
        c_int,  # topk
        ptr,  # out
    ]
    return lib


class Matrix(ctypes.Structure):
    """records.h's Matrix: a weight as its products read it (records, or bf16 rows)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("format", ctypes.c_int32),
    ]


_library_lock = threading.Lock()


def library(group: int, head_dim: int) -> ctypes.CDLL | None:
    """The loaded library for this attention shape (built on first need), or None. Takes a
    lock: the engine starts the build in a background thread while it loads the model."""
    with _library_lock:
        return _library(group, head_dim)


@cache
def _library(group: int, head_dim: int) -> ctypes.CDLL | None:
    path = build(group, head_dim, _out_dir())
    return None if path is None else load(path)


def gemm_library() -> ctypes.CDLL | None:
    """The loaded panel GEMM (built on first need), or None (no compiler, or it failed)."""
    with _library_lock:
        return _gemm_library()


@cache
def _gemm_library() -> ctypes.CDLL | None:
    path = build_gemm(_out_dir())
    return None if path is None else load_gemm(path)


def shm_library() -> ctypes.CDLL | None:
    """The loaded shared-memory collectives (built on first need), or None (no compiler, or
    it failed)."""
    with _library_lock:
        return _shm_library()


@cache
def _shm_library() -> ctypes.CDLL | None:
    path = build_shm(_out_dir())
    return None if path is None else load_shm(path)


def compressed_library() -> ctypes.CDLL | None:
    """The loaded compressed attention (built on first need), or None (no compiler, or it
    failed)."""
    with _library_lock:
        return _compressed_library()


@cache
def _compressed_library() -> ctypes.CDLL | None:
    path = build_compressed(_out_dir())
    return None if path is None else load_compressed(path)


@cache
def _out_dir() -> Path:
    """Where the libraries are built: the trusted cache, else a private temporary folder."""
    out_dir = trusted_cache_dir("kernels")
    if out_dir is None:  # said in the log: built where no one else can plant a library
        out_dir = Path(tempfile.mkdtemp(prefix="pypto-kernels-"))
        atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    return out_dir
