"""Device and dtype choice, in one place: CPU here, CUDA where a GPU exists."""

from __future__ import annotations

import math
import mmap
import os
from functools import cache

import torch

from pypto_serving.errors import PyptoError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512_BF16 or AMX), so bf16 pays off."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and on CPUs with native bf16, else float32."""
    if name == "auto":
        native = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise PyptoError(f"unsupported dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def set_num_threads(num_threads: int | None) -> None:
    """Set the CPU thread count (default: the cores this process may use)."""
    if num_threads is None:
        env = os.environ.get("PYPTO_NUM_THREADS")
        num_threads = int(env) if env else len(os.sched_getaffinity(0))
    if num_threads < 1:
        raise PyptoError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)


def use_packed_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """Repack linear weights for oneDNN: CPU, bf16, oneDNN present (PYPTO_PACK_LINEAR=0: off)."""
    if os.environ.get("PYPTO_PACK_LINEAR", "1") == "0":
        return False
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def use_native_attention(device: torch.device) -> bool:
    """Paged attention through the native CPU kernels (native/attention.cpp): on the CPU,
    unless PYPTO_NATIVE_ATTENTION=0. Elsewhere attention is PyTorch's."""
    return device.type == "cpu" and os.environ.get("PYPTO_NATIVE_ATTENTION", "1") != "0"


def use_native_decode(device: torch.device) -> bool:
    """Decode steps of a few sequences through the native CPU step (native/decode.cpp), for
    the models it takes: on the CPU with native attention, unless PYPTO_NATIVE_DECODE=0."""
    return use_native_attention(device) and os.environ.get("PYPTO_NATIVE_DECODE", "1") != "0"


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
