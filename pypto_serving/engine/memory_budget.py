"""vLLM's --gpu-memory-utilization: the KV pool's byte budget from the memory available when
the engine starts, decided once on this machine before any rank starts (so every rank sizes
the same pages)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from pypto_serving import native
from pypto_serving.config import EngineConfig
from pypto_serving.device import auto_dtype, available_memory, resolve_device, resolve_dtype
from pypto_serving.errors import PyptoError
from pypto_serving.models.loader import checkpoint_numel

log = logging.getLogger(__name__)
GIB = 1 << 30


def with_kv_budget(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """`config` with kv_device_bytes set from gpu_memory_utilization: that fraction of the
    memory available now, less the weights the engine will hold (each weight at the run
    dtype's size: an upper bound for a quantized run), per rank. On the CPU every rank of
    every replica shares the machine's memory; on GPUs each rank has its device's, and its
    share of its replica's weights. Unchanged without the flag, or with num_kv_pages."""
    f = config.cache.gpu_memory_utilization
    if f is None or config.cache.num_kv_pages:
        return config
    p = config.parallel
    if p.nnodes > 1:
        raise PyptoError(
            "gpu_memory_utilization is measured on one machine: with nnodes > 1 give "
            "kv_device_bytes (each rank's KV pool) instead",
            "gpu_memory_utilization",
        )
    device = resolve_device(config.device)
    if config.dtype == "auto":
        dtype = auto_dtype(device, config.pack_linear and native.compiler() is not None)[0]
    else:
        dtype = resolve_dtype(config.dtype, device)
    weights = checkpoint_numel(model_dir) * dtype.itemsize
    available = available_memory(device)
    if device.type == "cuda":
        budget = f * available - weights / p.ranks_per_engine
    else:
        budget = (f * available - weights * p.data_parallel_size) / p.world_size
    if budget < GIB / 64:
        raise PyptoError(
            f"gpu_memory_utilization {f} leaves the KV cache {max(budget, 0) / GIB:.2f} GiB "
            f"per rank: {f} of the {available / GIB:.1f} GiB available, less "
            f"{weights / GIB:.2f} GiB of weights; give a larger fraction or kv_device_bytes",
            "gpu_memory_utilization",
        )
    log.info(
        "gpu_memory_utilization %s: a KV pool of %.2f GiB per rank (%s of %.1f GiB available "
        "on %s, less %.2f GiB of weights)",
        f,
        budget / GIB,
        f,
        available / GIB,
        device,
        weights / GIB,
    )
    return replace(config, cache=replace(config.cache, kv_device_bytes=int(budget)))
