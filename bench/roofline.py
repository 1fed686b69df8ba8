#!/usr/bin/env python
"""The roofline: this machine's measured limits, what a model asks of them, and the fraction of
the limit a figure reaches (issue 47, item 2).

Limits (`measure_limits`, cached per CPU, its flags and the thread count in limits.json of
the cache folder, `$PYPTO_CACHE_DIR` or ~/.cache/pypto-serving):
- read bandwidth: GB/s at which the threads find the largest value of a 1 GiB float32 array
  (torch's amax or NumPy's max on a share each, whichever is faster, best of 5: a lower bound;
  this machine's own decode step has read faster than either);
- GEMM peaks: GFLOP/s of a 4,096-cube matmul in bfloat16 (oneDNN: AMX tiles where the CPU has
  them, AVX512-BF16 or AVX2 where not) and float32, and GOP/s of an int8 one
  (`torch._int_mm`), best of 3.

A model's demands (`Demand`, from a GGUF file's tensors as stored, or an HF directory's
safetensors as stored): the bytes of weights a decoded token reads (every matrix it multiplies
by once; the embedding's one row; a MoE's used share of its experts), the KV bytes each token
of context adds to a decode's reads (bf16), and the FLOPs a token costs (2 per weight it is
multiplied by, plus attention's 4 per head dimension per earlier token).

    python bench/roofline.py                                   # this machine's limits
    python bench/roofline.py --model FILE.gguf --decode-tok-s 43.8 --prefill 2048:13.4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LIMITS_FILE = "limits.json"
ISA_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2")


@dataclass(frozen=True)
class Limits:
    """What this machine does at most with `threads` threads."""

    cpu: str
    isa: str
    """The /proc/cpuinfo flags among ISA_FLAGS, space-separated."""
    threads: int
    read_gb_s: float
    bf16_gflop_s: float
    fp32_gflop_s: float
    int8_gop_s: float | None


def cpu_name_and_isa() -> tuple[str, str]:
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, " ".join(f for f in ISA_FLAGS if f in flags)


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _numpy_max_s(data: Any, threads: int) -> float:
    """Best of 5 seconds for `threads` threads to take NumPy's max of a share of `data` each
    (its max releases the GIL)."""
    import numpy as np

    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        return _timed(lambda: list(pool.map(np.max, parts)), 5)


def measure_limits(threads: int, size_mib: int = 1024, gemm: int = 4096) -> Limits:
    """Measure the limits with `threads` threads (`size_mib`, `gemm`: smaller for a quick
    look, as the tests take)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(size_mib << 18, dtype=torch.float32)  # MiB of float32
    data.amax()  # touched
    read = data.numel() * 4 / min(_timed(data.amax, 5), _numpy_max_s(data.numpy(), threads))
    read /= 1e9
    del data

    def peak(dtype: torch.dtype) -> float:
        a = torch.randn(gemm, gemm).to(dtype)
        b = torch.randn(gemm, gemm).to(dtype)
        torch.matmul(a, b)  # oneDNN's first call picks and builds its kernel
        return 2 * gemm**3 / _timed(lambda: torch.matmul(a, b), 3) / 1e9

    int8 = None
    try:
        a = torch.randint(-127, 127, (gemm, gemm), dtype=torch.int8)
        torch._int_mm(a, a)
        int8 = 2 * gemm**3 / _timed(lambda: torch._int_mm(a, a), 3) / 1e9
    except (RuntimeError, AttributeError):  # not offered for this CPU or build
        pass
    cpu, isa = cpu_name_and_isa()
    return Limits(cpu, isa, threads, read, peak(torch.bfloat16), peak(torch.float32), int8)


def limits(threads: int | None = None, fresh: bool = False) -> Limits:
    """This machine's limits, measured once per CPU, flags and thread count (cached)."""
    from pypto_serving.paths import cache_dir

    cache = cache_dir() / LIMITS_FILE
    threads = threads or len(os.sched_getaffinity(0))
    cpu, isa = cpu_name_and_isa()
    key = f"{cpu} | {isa} | {threads}"
    cached: dict[str, Any] = {}
    if cache.is_file():
        try:
            cached = json.loads(cache.read_text())
        except ValueError:
            cached = {}
    if not fresh and key in cached:
        return Limits(**cached[key])
    found = measure_limits(threads)
    cached[key] = asdict(found)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(cached, indent=2) + "\n")
    return found


def best(*found: Limits) -> Limits:
    """Each limit's highest measurement (this VM's read bandwidth moved 29-53 GB/s within
    minutes: a figure is held against the best the machine showed around it)."""
    first = found[0]
    int8 = [f.int8_gop_s for f in found if f.int8_gop_s is not None]
    return Limits(
        first.cpu,
        first.isa,
        first.threads,
        max(f.read_gb_s for f in found),
        max(f.bf16_gflop_s for f in found),
        max(f.fp32_gflop_s for f in found),
        max(int8) if int8 else None,
    )


@dataclass(frozen=True)
class Demand:
    """What one token asks of the machine."""

    weight_bytes: float
    """Bytes of weights a decoded token reads."""
    kv_bytes_per_token: float
    """Bytes of KV (bf16) each earlier token adds to a decode's reads."""
    flops: float
    """FLOPs of a token's matmuls (2 per weight multiplied)."""
    expert_flops: float
    """Of which a MoE's routed experts' (its used share)."""
    attention_flops_per_token: float
    """FLOPs of a token's attention per earlier token (4 per head dimension, every layer)."""

    def decode_bytes(self, context: int) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * context

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs of a prompt of `tokens` (each token attending to those before it)."""
        return tokens * self.flops + self.attention_flops_per_token * tokens * (tokens + 1) / 2


def _kv_and_attention(layers: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    return layers * kv_heads * head_dim * 2 * 2, layers * heads * head_dim * 4


def gguf_demand(path: Path) -> Demand:
    """A GGUF file's demand: its matrices as stored."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.get_field("general.architecture").contents())

    def field(key: str, default: int | None = None) -> int:
        f = reader.get_field(f"{arch}.{key}")
        if f is None:
            assert default is not None, key
            return default
        return int(f.contents())

    used = field("expert_used_count", 0) / max(field("expert_count", 1), 1)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    weight_bytes = flops = expert_flops = 0.0
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        if len(dims) < 2:
            continue  # norms: read, but a rounding error beside the matrices
        share = used if "_exps." in t.name else 1.0
        if t.name == "token_embd.weight" and not tied:
            weight_bytes += t.n_bytes / dims[1]  # the lookup's one row
            continue
        weight_bytes += t.n_bytes * share
        flops += 2 * math.prod(dims) * share
        expert_flops += 2 * math.prod(dims) * share if "_exps." in t.name else 0
    heads = field("attention.head_count")
    head_dim = field("attention.key_length", field("embedding_length") // heads)
    kv, attention = _kv_and_attention(
        field("block_count"), heads, field("attention.head_count_kv", heads), head_dim
    )
    return Demand(weight_bytes, kv, flops, expert_flops, attention)


QUANTIZED_BYTES = {"int4": (0.625, 1.0625), "int4-w8a8": (0.625, 1.0625), "int8": (1.0625,) * 2}
"""Bytes a weight is read in under our --quantization, (the layers' matrices, the LM head):
the native step's Q4 records (320 bytes per 16 rows x 32 inputs) and Q8 records (544), the
head kept in Q8 under the int4 forms."""


def hf_demand(model_dir: Path, quantization: str | None = None) -> Demand:
    """An HF directory's demand: its safetensors' matrices in the dtype stored, or in the
    form our `quantization` (QUANTIZED_BYTES) reads them in."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    used = config.get("num_experts_per_tok", 0) / max(
        config.get("num_experts") or config.get("num_local_experts") or 1, 1
    )
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}
    tensors: dict[str, tuple[list[int], int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open is not a dict)
                part = f.get_slice(name)
                tensors[name] = (part.get_shape(), sizes[part.get_dtype()])
    tied = "lm_head.weight" not in tensors
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    matrices, lm_head = QUANTIZED_BYTES[quantization] if quantization else (None, None)
    weight_bytes = flops = expert_flops = 0.0
    for name, (dims, size) in tensors.items():
        if len(dims) < 2:
            continue
        share = used if ".experts." in name else 1.0
        elements = math.prod(dims)
        if name == "model.embed_tokens.weight" and not tied:
            weight_bytes += size * dims[1]
            continue
        read = (lm_head if name == head else matrices) or size
        weight_bytes += elements * read * share
        flops += 2 * elements * share
        expert_flops += 2 * elements * share if ".experts." in name else 0
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv, attention = _kv_and_attention(
        config["num_hidden_layers"], heads, config.get("num_key_value_heads", heads), head_dim
    )
    return Demand(weight_bytes, kv, flops, expert_flops, attention)


def demand(model: Path, quantization: str | None = None) -> Demand:
    """A GGUF file's or HF directory's demand (quantization: ours, of a directory; a GGUF
    file is read as stored)."""
    return gguf_demand(model) if model.suffix == ".gguf" else hf_demand(model, quantization)


def decode_fraction(tok_s: float, need: Demand, machine: Limits, context: int = 0) -> float:
    """The read bandwidth a single stream's `tok_s` uses, as a fraction of the limit."""
    return tok_s * need.decode_bytes(context) / 1e9 / machine.read_gb_s


def mixed_peak(need: Demand, peak_gflop_s: float, experts_gop_s: float) -> float:
    """The limit of a model whose routed experts compute at `experts_gop_s` (int8: a GGUF
    file's experts on our records) and the rest at `peak_gflop_s`: the rate at which both
    limits together would run a token's FLOPs."""
    rest = need.flops - need.expert_flops
    return need.flops / (rest / peak_gflop_s + need.expert_flops / experts_gop_s)


def prefill_fraction(tokens: int, seconds: float, need: Demand, peak_gflop_s: float) -> float:
    """The GEMM rate a prompt of `tokens` computed in `seconds` reaches, as a fraction of
    `peak_gflop_s` (the dtype's limit the engine computes in)."""
    return need.prefill_flops(tokens) / seconds / 1e9 / peak_gflop_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, help="default: the CPUs this process may use")
    p.add_argument("--fresh", action="store_true", help="measure again (not the cached limits)")
    p.add_argument("--model", type=Path, help="a GGUF file or HF directory")
    p.add_argument("--decode-tok-s", type=float, help="a single stream's decode tok/s")
    p.add_argument("--context", type=int, default=0, help="the decode's mean context")
    p.add_argument(
        "--prefill",
        help="TOKENS:SECONDS of a prompt alone (its TTFT), against the bf16 GEMM limit",
    )
    p.add_argument(
        "--quantization",
        choices=sorted(QUANTIZED_BYTES),
        help="an HF directory's weights as ours reads them under this --quantization "
        "(default: as stored; a GGUF file is read as stored)",
    )
    args = p.parse_args(argv)
    machine = limits(args.threads, args.fresh)
    print(f"{machine.cpu} ({machine.isa}), {machine.threads} threads:")
    print(f"  read bandwidth {machine.read_gb_s:.1f} GB/s")
    print(f"  GEMM bf16 {machine.bf16_gflop_s:.0f} GFLOP/s, float32 {machine.fp32_gflop_s:.0f}")
    if machine.int8_gop_s is not None:
        print(f"  GEMM int8 {machine.int8_gop_s:.0f} GOP/s")
    if args.model is None:
        return 0
    need = demand(args.model, args.quantization)
    print(f"{args.model.name}: {need.weight_bytes / 1e6:.1f} MB of weights a decoded token,")
    print(f"  {need.kv_bytes_per_token / 1e3:.1f} KB of KV a token of context,")
    print(f"  {need.flops / 1e9:.2f} GFLOP a token's matmuls")
    if args.decode_tok_s:
        share = decode_fraction(args.decode_tok_s, need, machine, args.context)
        print(f"decode {args.decode_tok_s} tok/s: {share:.0%} of the read bandwidth")
    if args.prefill:
        tokens, seconds = args.prefill.split(":")
        share = prefill_fraction(int(tokens), float(seconds), need, machine.bf16_gflop_s)
        print(f"prefill of {tokens} tokens in {seconds} s: {share:.0%} of the bf16 GEMM limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
