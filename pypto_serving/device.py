"""Device and dtype choice, in one place: CPU here, CUDA where a GPU exists."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
from functools import cache

import torch

from pypto_serving.errors import PyptoError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other spellings of --dtype."""


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when a GPU is present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise PyptoError(f"invalid device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PyptoError(f"device {name!r} requested but no CUDA GPU is available")
    return device


def available_memory(device: torch.device) -> int:
    """Bytes of memory free for this process to take now: a GPU's free memory, or the CPU's
    MemAvailable (what Linux can give without swapping)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# The CPU's instruction sets, decided here for the whole package: dtype "auto", oneDNN's bf16
# packing (linear_packing), the native kernels' -march (native/__init__.py) and Inductor's
# vector width (executor/compiled.py) all ask `cpu_flags()` / `cpu_isa()`.

CPU_ISA_ENV = "PYPTO_CPU_ISA"
"""Caps the ISA the package uses (x86): `avx2` masks the CPU's flags to x86-64-v3's exactly,
so any CPU above it (AVX-512, AVX-VNNI, AMX) takes every decision an AVX2-only one (AMD Zen 3)
takes (tests use it); `default` to x86-64-v2's. Torch itself is told by ATEN_CPU_CAPABILITY
and ONEDNN_MAX_CPU_ISA, which must be set before torch loads (importing pypto_serving first
sets them from this variable)."""
CPU_ISAS = ("default", "avx2", "avx512")
"""x86 levels, lowest first: x86-64-v2 (SSE4.2), x86-64-v3 (AVX2, FMA, F16C, BMI), AVX-512
(F, BW, VL, DQ). Names as ATEN_CPU_CAPABILITY's."""
_V2 = frozenset(
    {"fpu", "cx8", "cmov", "mmx", "fxsr", "sse", "sse2", "syscall", "lm", "nx"}
    | {"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"}
)
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
LEVEL_FLAGS = {"default": _V2, "avx2": _V3}
"""The flags (/proc/cpuinfo's names) a cap to an x86 level keeps: x86-64-v2's or x86-64-v3's.
A CPU whose own level is AVX2 keeps all of its flags uncapped: AVX-VNNI (the 256-bit int8 dot
products of Intel's AVX2 cores since Alder Lake) included."""
_LEVEL_NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx2": {"avx2", "fma", "f16c"},
}
_CPUINFO_NAMES = {
    **{f"avx512_{x}": f"avx512{x}" for x in ("f", "bw", "dq", "vl", "cd", "ifma", "vbmi")},
    **{"fma3": "fma", "bmi": "bmi1", "sse3": "pni", "lzcnt": "abm", "sha": "sha_ni"},
}
"""torch.cpu.get_capabilities()'s names that /proc/cpuinfo spells otherwise."""


def _is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


@cache
def _proc_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@cache
def _cpuid_flags() -> dict[str, bool]:
    """What torch's cpuinfo reads from CPUID, in /proc/cpuinfo's names ({} where unknown)."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return {}
    return {_CPUINFO_NAMES.get(k, k): v for k, v in caps.items() if isinstance(v, bool)}


def _level(flags: frozenset[str]) -> str:
    """The x86 level `flags` reach: avx512, avx2 or default."""
    return next((isa for isa, needs in _LEVEL_NEEDS.items() if needs <= flags), "default")


def _isa_cap(flags: frozenset[str]) -> str | None:
    """The level to mask the CPU's `flags` to, or None: PYPTO_CPU_ISA's level wherever it is
    set below avx512; else the ISA torch's own kernels dispatch to (ATEN_CPU_CAPABILITY) where
    that is below the CPU's own level. None off x86 and at AVX-512."""
    if not _is_x86():
        return None
    asked = os.environ.get(CPU_ISA_ENV, "").lower()
    if asked and asked not in CPU_ISAS:
        raise PyptoError(f"{CPU_ISA_ENV}={asked!r}: choose one of {', '.join(CPU_ISAS)}")
    aten = torch.backends.cpu.get_cpu_capability().lower()
    cap = min(asked or "avx512", aten if aten in CPU_ISAS else "avx512", key=CPU_ISAS.index)
    if cap == "avx512" or (cap != asked and cap == _level(flags)):
        return None  # torch at the CPU's own level: nothing to mask
    return cap


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags in /proc/cpuinfo's names: those /proc/cpuinfo lists and CPUID
    (torch's cpuinfo) agrees with (under an emulator such as qemu-user, /proc/cpuinfo is the
    host's and CPUID the emulated CPU's, which the code runs on), masked to the x86 level of
    `_isa_cap()` (PYPTO_CPU_ISA, ATEN_CPU_CAPABILITY)."""
    proc, cpuid = _proc_flags(), _cpuid_flags()
    if proc:
        flags = frozenset(f for f in proc if cpuid.get(f, True))
    else:
        flags = frozenset(f for f, on in cpuid.items() if on)
    cap = _isa_cap(flags)
    return flags if cap is None else flags & LEVEL_FLAGS[cap]


def cpu_isa() -> str:
    """The x86 level `cpu_flags()` reaches: avx512, avx2 or default (also off x86)."""
    return _level(cpu_flags())


def cpu_march() -> tuple[str, ...]:
    """The C++ compiler's flags for code built for `cpu_isa()` (the native kernels): -march=
    native at AVX-512 and off x86; below, the x86-64 level itself, as -march=native would take
    features a cap masks (or the host's under an emulator, where the compiler runs on the
    host), and at AVX2 AVX-VNNI where `cpu_flags()` has it."""
    if not _is_x86() or cpu_isa() == "avx512":
        return ("-march=native",)
    if cpu_isa() == "default":
        return ("-march=x86-64-v2",)
    return ("-march=x86-64-v3", *(["-mavxvnni"] if "avx_vnni" in cpu_flags() else []))


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512_BF16 or AMX), so bf16 pays off."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def cpu_packs_bf16() -> bool:
    """Whether oneDNN can repack bf16 weights here (`mkldnn._reorder_linear_weight`): on x86
    it needs AVX-512 BW, VL and DQ, or AVX-NE-CONVERT, in `cpu_flags()`; and oneDNN itself
    (capped by ONEDNN_MAX_CPU_ISA) must agree."""
    if not torch.backends.mkldnn.is_available():
        return False
    flags = cpu_flags()
    if _is_x86() and not (_LEVEL_NEEDS["avx512"] <= flags or "avx_ne_convert" in flags):
        return False
    onednn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn is None or bool(onednn())


@cache
def int8_gemm_saturates() -> bool:
    """Whether torch._int_mm (oneDNN) gets full-range int8 products wrong: without int8 dot
    products (VNNI) it sums pairs of u8 x s8 products in int16, which saturates."""
    a, b = torch.full((17, 64), 127, dtype=torch.int8), torch.full((64, 16), 127, dtype=torch.int8)
    try:
        return not bool((torch._int_mm(a, b) == 127 * 127 * 64).all())
    except RuntimeError:
        return True


def int8_gemm_full_range() -> bool:
    """Whether w8a8's GEMM (torch._int_mm) multiplies full-range int8 exactly: with int8 dot
    products (AVX512-VNNI, AVX-VNNI or AMX in `cpu_flags()`, and oneDNN's GEMM exact). Without
    them (AVX2) oneDNN adds 128 to each input and sums pairs of u8 x s8 products in int16, so
    w8a8 gives its inputs 7 bits there (`ops.linear.int8_linear`): u8 values up to 127 keep
    every pair within int16 (127 x 127 x 2 < 32768) while the weights keep 8."""
    dot = not cpu_flags().isdisjoint({"avx512_vnni", "avx_vnni", "amx_int8"})
    return dot and not int8_gemm_saturates()


def resolve_dtype(name: str, device: torch.device, native: bool = False) -> torch.dtype:
    """'auto' is `auto_dtype`'s choice; else the dtype named."""
    if name == "auto":
        return auto_dtype(device, native)[0]
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        names = ", ".join([*DTYPES, *DTYPE_ALIASES])
        raise PyptoError(f"unsupported dtype {name!r}; choose one of: auto, {names}")
    return DTYPES[name]


def auto_dtype(device: torch.device, native: bool = False) -> tuple[torch.dtype, str]:
    """The fastest correct dtype here, and why: bfloat16 on CUDA and on CPUs that compute it
    natively (AVX512-BF16, AMX); also on x86 CPUs with AVX2 when the native kernels can be
    built (`native`): bf16 weights are half the bytes a token reads, and the kernels compute
    them in float32 (native/gemm.cpp, native/decode.cpp). Else float32: PyTorch's own bf16
    matmuls there run at a fifth of its float32 ones."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA computes bf16"
    if cpu_has_native_bf16():
        return torch.bfloat16, "the CPU computes bf16 (AVX512-BF16 or AMX)"
    if native and cpu_isa() in ("avx2", "avx512"):
        return (
            torch.bfloat16,
            f"bf16 weights computed in float32 by the native kernels ({cpu_isa()})",
        )
    why = "no C++ compiler for the native kernels" if not native else f"ISA {cpu_isa()}"
    return torch.float32, f"no bf16 compute here ({why})"


def default_num_threads() -> int:
    """The CPU thread count when none is asked for: the cores this process may use."""
    return len(os.sched_getaffinity(0))


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """How bf16 linear weights can be packed for wide matmuls here: "onednn" where oneDNN
    packs bf16 (`cpu_packs_bf16`), "panels" on other CPUs (the native GEMM, native/gemm.cpp,
    if it builds), None off the CPU or for other dtypes. Whether they are is the run plan's
    choice (engine/plan.py)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    return "onednn" if cpu_packs_bf16() else "panels"


def use_native_attention(device: torch.device) -> bool:
    """Whether paged attention can run on the native CPU kernels (native/attention.cpp): on
    the CPU. Elsewhere attention is PyTorch's. Whether it does is the run plan's choice."""
    return device.type == "cpu"


def use_native_decode(device: torch.device) -> bool:
    """Whether decode steps of a few sequences can run as the native CPU step
    (native/decode.cpp; `native_decode.applies` says for which models): on the CPU, where the
    native attention kernels run. Whether they do is the run plan's choice."""
    return use_native_attention(device)


def pin_host_memory(device: torch.device) -> bool:
    """Whether host buffers that feed `device` should be pinned (page-locked): on CUDA only,
    where it makes host <-> device copies fast."""
    return device.type == "cuda"


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU its memory is an anonymous mapping: the OS hands out
    zeroed pages as they are first written, so a KV cache of gigabytes is allocated at once
    (torch.zeros writes every byte first: ~0.5 s for 2 GB here) and resident memory grows
    with what is used."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to give back this way
        return None


def release_freed_memory() -> None:
    """Give the CPU memory that freed tensors leave in glibc's heap back to the system
    (`malloc_trim`): a tensor under malloc's mmap threshold comes from the heap, whose freed
    middle stays resident. A load that quantizes layer by layer frees a layer's bf16 weights
    and float32 temporaries as it goes; without this they kept 0.6-1 GB resident at the 1B
    shape. No-op where the C library is not glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for timing); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_devices(
    num_procs: int, devices: list[str] | None, device: str = "auto"
) -> list[tuple[str, list[int] | None]]:
    """A device for each of `num_procs` processes, and the cores to pin it to (CPU only).

    Given `devices` are used as they are. Otherwise, with `device` auto on a machine with at
    least `num_procs` GPUs, process i gets cuda:i; on the CPU the cores this process may use
    are split into `num_procs` contiguous shares, so the processes' thread teams never
    compete for a core (with fewer cores than processes, none is pinned)."""
    if devices is None:
        if device == "auto" and torch.cuda.is_available():
            found = torch.cuda.device_count()
            if found < num_procs:
                raise PyptoError(
                    f"{num_procs} processes need {num_procs} GPUs, found {found}; "
                    "name the devices to share (devices) or use device cpu"
                )
            devices = [f"cuda:{i}" for i in range(num_procs)]
        else:
            devices = [device] * num_procs
    for name in set(devices):
        resolve_device(name)  # a clear error for a bad or absent device, before any start
    cpu = [i for i, d in enumerate(devices) if resolve_device(d).type == "cpu"]
    cores = sorted(os.sched_getaffinity(0))
    shares: dict[int, list[int] | None] = {}
    if cpu and len(cores) >= len(cpu):
        per = len(cores) // len(cpu)
        shares = {p: cores[k * per : (k + 1) * per] for k, p in enumerate(cpu)}
    return [(d, shares.get(i)) for i, d in enumerate(devices)]
