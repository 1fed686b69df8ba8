"""An engine on the AVX2 paths, run as a child process by test_cpu_isa.py: PYPTO_CPU_ISA=avx2,
ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 are in its environment before torch
loads, so torch's kernels (oneDNN's int8 GEMM among them) run their AVX2 code too.

`python isa_checks.py MODEL_DIR`: the decisions of an AVX2 CPU are taken (bf16 weights in
panels for the native GEMM instead of oneDNN's packing, 7-bit w8a8 inputs or weights, or 8 bits
both in two GEMMs for w8a8's head, queries and keys, native kernels for x86-64-v3), then bf16,
each quantization and the int8 KV cache follow the same engine in float32, greedy, by the
top-5 rule of the bf16 tests. Prints one line per run; exits non-zero (an assertion) on a
difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from checkpoints import assert_top5_rule

from pypto_serving import LLM, SamplingParams
from pypto_serving.device import (
    cpu_flags,
    cpu_isa,
    cpu_march,
    int8_gemm_full_range,
    int8_gemm_saturates,
    linear_packing,
)
from pypto_serving.ops.linear import Linear, int8_linear, quantize_w8a8

RUNS: dict[str, dict[str, str]] = {
    "auto": {"dtype": "auto"},  # bf16 weights, computed in float32 by the native kernels
    "bfloat16": {},
    "bfloat16-compiled": {"enforce_eager": False},  # Inductor's graphs around the panel GEMM
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "w8a8": {"quantization": "w8a8"},
    "int4-w8a8": {"quantization": "int4-w8a8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
}
KNOBS = {"enforce_eager": True, "num_kv_pages": 64, "page_size": 16}


def check_decisions() -> None:
    """The AVX2 decisions, and torch itself on its AVX2 code."""
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert cpu_isa() == "avx2" and cpu_march() == ("-march=x86-64-v3",)
    assert not any(f.startswith(("avx512", "amx")) for f in cpu_flags())
    assert linear_packing(torch.device("cpu"), torch.bfloat16) == "panels"
    assert not int8_gemm_full_range()
    # oneDNN's AVX2 int8 GEMM sums pairs of u8 x s8 products in int16: full-range inputs would
    # saturate it; 7-bit inputs beside 8-bit weights keep it exact, extreme rows included
    torch.manual_seed(0)
    x = torch.randn(17, 256).bfloat16()
    x[:, 0], x[:, 1] = 100, -100  # every row's extremes: its u8 values 127 and 0
    weight = torch.randn(32, 256)
    weight[:, 2] = 50  # +127 in every row
    q, scale, row_sums, low = quantize_w8a8(weight)
    assert q.abs().max() == 127 and row_sums is not None and low is None
    got = int8_linear(x, q, scale, row_sums).double()
    lo = x.double().amin(1, keepdim=True)
    step = (x.double().amax(1, keepdim=True) - lo) / 127
    u = torch.round((x.double() - lo) / step)
    exact = ((u * step + lo) @ q.double().T) * scale.double()
    assert ((got - exact).norm() / exact.norm()).item() < 4e-3  # the output's bf16 rounding
    # a split weight (the head, queries and keys): full-range inputs and 8-bit weights, exact
    # in two GEMMs (2 x high + low) where one GEMM of the whole weight saturates
    x[:, 2:4], weight[:, 3] = 120, 50  # every row's largest: +127 against +127, twice
    high, scale, row_sums, low = quantize_w8a8(weight, split=True)
    assert row_sums is None and low is not None and high.min() >= -64 and high.max() <= 63
    whole = 2 * high + low
    assert whole.abs().max() == 127 and torch.equal(whole, quantize_w8a8(weight, True)[0])
    got = int8_linear(x, high, scale, None, low).double()
    row_scale = x.double().abs().amax(1, keepdim=True) / 127
    exact = (torch.round(x.double() / row_scale) @ whole.double().T) * row_scale * scale.double()
    assert ((got - exact).norm() / exact.norm()).item() < 4e-3
    xq = torch.round(x.float() / (x.float().abs().amax(1, keepdim=True) / 127)).to(torch.int8)
    exact = torch.equal(torch._int_mm(xq, whole.t()), xq.long().mm(whole.long().t()).int())
    # oneDNN's AVX2 GEMM (an AVX-512 host capped to AVX2) saturates here; torch's own int8 GEMM
    # on an AVX2-only CPU (AMD Zen 3) does not: the probe says which, and the split is exact
    # on both
    assert exact == (not int8_gemm_saturates())


def main(model_dir: str) -> None:
    check_decisions()
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(3 + 11 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    with LLM(model_dir, dtype="float32", **KNOBS) as llm:
        expected = llm.generate(prompts, params, use_tqdm=False)
    for name, extra in RUNS.items():
        with LLM(model_dir, **({"dtype": "bfloat16"} | KNOBS | extra)) as llm:
            got = llm.generate(prompts, params, use_tqdm=False)
            linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
            # bf16 weights in panels for the native GEMM (w8a8's wide matmuls run in int8;
            # int4's and int8's records, their only weights, dequantized into float32 panels
            # as they run)
            if name in ("int4", "int8"):
                assert llm.engine.plan.records_wide == "panels"
                assert all(m.packed is None and m.wide == "panels" for m in linears)
            else:
                wide_int8 = name.endswith("w8a8")
                assert all((m.packed is None) == wide_int8 for m in linears)
                assert all(m.packed is None or not m.packed.is_mkldnn for m in linears)
            if name.endswith("w8a8"):
                # each layer: 7-bit inputs (8-bit weights and their row sums), 7-bit weights,
                # or (w8a8's head, queries and keys) 8 bits both in a split weight
                for m in linears:
                    q, _, row_sums, low, _ = m.int8
                    assert (low is not None) == (m.exact_int8 and name == "w8a8")
                    if low is not None:
                        assert row_sums is None and q.abs().max() <= 64
                    elif row_sums is None:
                        assert q.abs().max() <= 64
                    else:
                        assert torch.equal(row_sums, q.sum(1, dtype=torch.int32))
            native = llm.engine.attention.native_decode
            assert llm.engine.dtype == torch.bfloat16  # auto too, the native kernels at hand
        diverged = assert_top5_rule(expected, got)
        print(f"{name}: follows float32 (diverged {diverged}/{len(prompts)}, native {native})")


if __name__ == "__main__":
    main(sys.argv[1])
