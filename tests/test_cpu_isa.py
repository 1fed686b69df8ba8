"""The CPU's ISA, decided in device.py, and the AVX2 paths, tested on any x86-64-v3 CPU.

PYPTO_CPU_ISA=avx2 masks the CPU's flags to x86-64-v3's, so an AVX-512 machine takes every
decision an AVX2-only one takes: no oneDNN bf16 packing, 7-bit w8a8 weights, the native
kernels built for x86-64-v3, Inductor's vectors at 256 bits. torch is told by
ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, read as it loads: the end-to-end run is a
child process (isa_checks.py) where torch's own kernels run their AVX2 code too. So the AVX2
paths run, held to a reference, on both kinds of machine.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_native_attention import (
    TOLERANCE,
    dequantize_rows,
    make_case,
    reference,
    to_int8_caches,
)

from pypto_serving import device, native
from pypto_serving.device import (
    LEVEL_FLAGS,
    auto_dtype,
    cpu_flags,
    cpu_has_native_bf16,
    cpu_isa,
    cpu_march,
    cpu_packs_bf16,
    int8_gemm_full_range,
    linear_packing,
    resolve_dtype,
)
from pypto_serving.errors import PyptoError
from pypto_serving.executor.compiled import trust_cpu_vector_isa
from pypto_serving.kv import native_attention

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= cpu_flags(),
    reason="the AVX2 paths need an x86-64-v3 CPU",
)
MODEL = "qwen3-hd32-gqa4"  # head_dim 32: the native decode step and attention take it
GROUP, HEAD_DIM = 4, 32
ABOVE_V3 = {"avx_vnni", "avx_ne_convert"}
"""Beside avx512* and amx*: the flags an AVX2-only CPU (AMD Zen 3) lacks that change a
decision (int8 dot products, oneDNN's bf16 packing). The AVX2 cap drops them on every CPU."""
SAPPHIRE_RAPIDS = frozenset(
    {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512vl"}
    | {"avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_int8"}
    | {"amx_bf16", "amx_tile"}
)
ALDER_LAKE = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "avx_vnni"})


def test_the_avx2_cap_masks_the_flags_to_x86_64_v3(monkeypatch):
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    flags = cpu_flags()
    assert flags <= LEVEL_FLAGS["avx2"] and {"avx2", "fma", "f16c", "bmi2"} <= flags
    assert not any(f.startswith(("avx512", "amx")) for f in flags) and not flags & ABOVE_V3
    cpu = torch.device("cpu")
    assert cpu_isa() == "avx2" and cpu_march() == ("-march=x86-64-v3",)
    assert not cpu_packs_bf16() and linear_packing(cpu, torch.bfloat16) == "panels"
    assert resolve_dtype("auto", cpu) == torch.float32  # no native bf16, no native kernels
    # with the native kernels bf16 weights are computed in float32: half the bytes a token reads
    assert auto_dtype(cpu, native=True) == (torch.bfloat16, auto_dtype(cpu, True)[1])
    assert "float32 by the native kernels (avx2)" in auto_dtype(cpu, True)[1]
    assert "no C++ compiler" in auto_dtype(cpu, False)[1]
    assert not int8_gemm_full_range()  # no int8 dot products
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx3")
    with pytest.raises(PyptoError, match="PYPTO_CPU_ISA='avx3': choose one of"):
        cpu_flags()


@pytest.mark.parametrize("aten", ["AVX512", "AVX2"])
def test_the_avx2_cap_means_x86_64_v3_on_a_cpu_with_avx_vnni_too(monkeypatch, aten):
    """A Xeon with AMX and AVX-VNNI under PYPTO_CPU_ISA=avx2 (torch told or not) takes the
    decisions AMD Zen 3 takes: no AVX-VNNI, no 8-bit dot products, the x86-64-v3 build."""
    monkeypatch.setattr(device, "_proc_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(device, "_cpuid_flags", dict)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)
    monkeypatch.delenv("PYPTO_CPU_ISA", raising=False)
    assert cpu_isa() == ("avx512" if aten == "AVX512" else "avx2")
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    assert cpu_flags() == SAPPHIRE_RAPIDS & LEVEL_FLAGS["avx2"] and not cpu_flags() & ABOVE_V3
    assert cpu_isa() == "avx2" and cpu_march() == ("-march=x86-64-v3",)
    assert not cpu_has_native_bf16() and not cpu_packs_bf16()


def test_an_avx2_cpu_with_avx_vnni_keeps_it_unless_capped(monkeypatch):
    """Intel's AVX2 cores (Alder Lake on) are an AVX2 level of their own: uncapped, their
    AVX-VNNI builds the native kernels' vpdpbusd path; PYPTO_CPU_ISA=avx2 drops it as
    everywhere."""
    monkeypatch.setattr(device, "_proc_flags", lambda: ALDER_LAKE)
    monkeypatch.setattr(device, "_cpuid_flags", dict)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.delenv("PYPTO_CPU_ISA", raising=False)
    assert cpu_flags() == ALDER_LAKE and cpu_isa() == "avx2"
    assert cpu_march() == ("-march=x86-64-v3", "-mavxvnni")
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    assert "avx_vnni" not in cpu_flags() and cpu_march() == ("-march=x86-64-v3",)


def test_pypto_cpu_isa_alone_tells_torch_when_imported_first():
    """`import pypto_serving` before torch sets ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA from
    PYPTO_CPU_ISA (unless set): torch's kernels and oneDNN take the AVX2 code too."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    code = (
        "import pypto_serving, torch; from torch.ops import mkldnn; "
        "print(torch.backends.cpu.get_cpu_capability(), mkldnn._is_mkldnn_bf16_supported())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=env | {"PYPTO_CPU_ISA": "avx2"},
        capture_output=True,
        text=True,
    )
    assert run.stdout.split() == ["AVX2", "False"], run.stderr[-2000:]


def test_a_flag_counts_where_cpuid_and_torch_agree(monkeypatch):
    """Under qemu-user /proc/cpuinfo is the host's, CPUID (torch's cpuinfo) the emulated
    CPU's: a flag CPUID denies is dropped. And torch's kernels at AVX2 (ATEN_CPU_CAPABILITY)
    cap the flags as PYPTO_CPU_ISA does."""
    monkeypatch.delenv("PYPTO_CPU_ISA", raising=False)
    capability = "AVX512"  # torch's kernels at AVX-512, unless ATEN_CPU_CAPABILITY says less
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    host = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"} | {"avx512f", "avx512bw"})
    host |= {"avx512vl", "avx512dq"}
    monkeypatch.setattr(device, "_proc_flags", lambda: host | {"avx512_vnni", "amx_int8"})
    haswell = {"avx512f": False, "avx512bw": False, "avx512_vnni": False, "amx_int8": False}
    monkeypatch.setattr(device, "_cpuid_flags", lambda: haswell | {"avx2": True})
    assert cpu_flags() == {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512vl", "avx512dq"}
    assert cpu_isa() == "avx2" and not cpu_packs_bf16() and not int8_gemm_full_range()
    monkeypatch.setattr(device, "_cpuid_flags", dict)  # CPUID unknown: /proc/cpuinfo's
    assert cpu_isa() == "avx512"
    capability = "AVX2"
    assert cpu_flags() == host & LEVEL_FLAGS["avx2"] and cpu_isa() == "avx2"


def test_inductor_vectors_are_256_bits_under_the_avx2_cap(monkeypatch):
    from torch._inductor import config, cpu_vec_isa

    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    with config.patch({"cpp.vec_isa_ok": None, "cpp.simdlen": None}):
        try:
            trust_cpu_vector_isa()
            isa = cpu_vec_isa.pick_vec_isa()
            assert isa.bit_width() == 256 and str(isa) == "avx2"
        finally:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


@pytest.fixture(scope="module")
def avx2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding the native kernels as an AVX2 CPU builds them (x86-64-v3), for
    MODEL's attention shape: the end-to-end child reuses them."""
    cache = tmp_path_factory.mktemp("avx2-cache")
    cache.chmod(0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYPTO_CPU_ISA", "avx2")
        path = native.build(GROUP, HEAD_DIM, cache / "kernels")
    assert path is not None, "the kernels must build here (g++ is what Inductor uses too)"
    return cache


@pytest.fixture(scope="module")
def avx2_kernels(avx2_cache: Path):
    (path,) = (avx2_cache / "kernels").glob("*.so")
    lib = native.load(path)
    assert lib is not None
    return lib


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the code")
def test_the_avx2_kernels_hold_no_avx512_instruction(avx2_cache):
    (path,) = (avx2_cache / "kernels").glob("*.so")
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True
    ).stdout
    assert "%ymm" in code  # AVX2 at work
    evex = re.compile(r"%zmm|%ymm(1[6-9]|2\d|3[01])\b|\{%k[1-7]\}")  # AVX-512's registers
    assert not evex.search(code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 40, 17]], ids=["decodes", "prefill"])
def test_the_avx2_attention_kernels_match_float64(avx2_kernels, dtype, q_lens):
    """Decodes and prefill chunks, float32, bf16 and int8 caches, against float64 attention
    (test_native_attention.py does the same with the kernels built for this CPU)."""
    case_dtype = torch.float32 if dtype == torch.int8 else dtype
    q, k, v, table, lens, ctx = make_case(7, q_lens, 2, GROUP, HEAD_DIM, 16, 90, case_dtype)
    if dtype == torch.int8:
        k, v = to_int8_caches(avx2_kernels, k, v)
    chunks = None if max(q_lens) == 1 else lens
    got = native_attention.paged_attention(avx2_kernels, q, k, v, table, ctx, 16, chunks)
    if dtype == torch.int8:
        k, v = dequantize_rows(k), dequantize_rows(v)
    want = reference(q, k, v, table, lens, ctx, 16)
    tol = TOLERANCE[case_dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_an_avx2_engine_follows_its_float32_self(tiny_model, avx2_cache):
    """A child process with torch on its AVX2 code (isa_checks.py): bf16, int8, int4, w8a8,
    int4-w8a8 and the int8 KV cache, greedy, against float32 by the top-5 rule."""
    env = os.environ | {
        "PYPTO_CPU_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PYPTO_CACHE_DIR": str(avx2_cache),
    }
    script = Path(__file__).with_name("isa_checks.py")
    run = subprocess.run(
        [sys.executable, str(script), str(tiny_model(MODEL))],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("follows float32") == 8, run.stdout  # isa_checks.RUNS
