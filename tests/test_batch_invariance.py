"""--batch-invariant: one request's greedy tokens and logprobs are the same bits alone, after a
prefix hit, in a batch of 16, with its prompt chunked, reloaded from the CPU tier and after a
preemption (recomputed), in bf16, float32, w8a8, int8 and int4; int4 without the flag too, but
for the preemption; in this machine's own build
(AVX-512 here) and in the AVX2 build, each in a child process (the AVX2 one with torch on its
AVX2 code). int4-w8a8 under the flag is held to load int4's very records (so int4's runs cover
its bits). The default mode is held to differ somewhere in bf16 (the native decode step's
numerics are not the graphs'), so the test can tell the two apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import build_checkpoint, build_tokenizer
from cpu_builds import AVX2_ENV, AVX2_IS_THIS_BUILD

from pypto_serving import LLM, native
from pypto_serving.device import cpu_flags
from pypto_serving.kv import native_attention
from pypto_serving.kv.paged_attention import StepAttention
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.spec import KVSpec
from pypto_serving.ops.linear import NATIVE_Q4, NATIVE_Q8, Linear

VARIANTS = {
    "bfloat16": {"dtype": "bfloat16"},
    "float32": {"dtype": "float32"},
    "w8a8": {"dtype": "bfloat16", "quantization": "w8a8"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama-wide")
    build_checkpoint("llama-wide", out)
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the module's child processes: each would otherwise build the
    native kernels again (its keys keep the builds and the compiled graphs apart)."""
    return tmp_path_factory.mktemp("cache")


def assert_all_equal(found: dict[str, Any]) -> None:
    alone = found["alone"]
    for name, got in found.items():
        assert got[0] == alone[0], f"{name}: tokens {got[0]} != {alone[0]}"
        assert got[1] == alone[1], f"{name}: logprobs differ from alone's"  # exact floats


def situations_apart(model: Path, knobs: dict[str, Any], tmp: Path, env: dict[str, str]):
    """`invariance_checks.situations` in a child process: its own torch (the AVX2 build's is
    chosen as torch loads) and its own dynamo caches (six engines' graphs per call would
    crowd this process's, which later tests count)."""
    script = Path(__file__).with_name("invariance_checks.py")
    run = subprocess.run(
        [sys.executable, str(script), str(model), json.dumps(knobs)],
        env=os.environ | {"PYPTO_CACHE_DIR": str(tmp)} | env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_request_gets_the_same_bits_in_every_situation(wide_model, cache, variant):
    knobs = VARIANTS[variant] | {"batch_invariant": True}
    assert_all_equal(situations_apart(wide_model, knobs, cache, {}))


@pytest.mark.slow
def test_the_default_mode_does_not_promise_it(wide_model, cache):
    """Without the flag decodes of up to 8 run through the native step and wider steps on the
    graphs: a batch of 16 moves A's logprobs (the check above would fail here)."""
    found = situations_apart(wide_model, {"dtype": "bfloat16"}, cache, {})
    assert any(got[1] != found["alone"][1] for got in found.values())


@pytest.mark.slow
@pytest.mark.parametrize("build", ["own", "avx2"])
@pytest.mark.parametrize("variant", ["int4", "int8"])
def test_records_by_default_get_the_same_bits_but_after_a_preemption(
    wide_model, cache, build, variant
):
    """Without the flag an int4 (int8) model's records serve every matmul (the run plan's
    `records_only`) and every decode runs through the native step, a prefill chunk beside
    decodes on the graphs alone: alone, after a hit, in a batch of 16, chunked and reloaded
    from the CPU tier, A's tokens and logprobs are the same bits. A preemption recomputes A's
    generated tokens on the graphs, whose numerics are not the step's: only the flag promises
    that one."""
    if build == "avx2" and (AVX2_IS_THIS_BUILD or not {"avx2", "fma", "f16c"} <= cpu_flags()):
        pytest.skip("this CPU's own build is the AVX2 build, or it has no AVX2")
    env = AVX2_ENV if build == "avx2" else {}
    found = situations_apart(wide_model, VARIANTS[variant], cache, env)
    found.pop("preempted")
    assert_all_equal(found)


@pytest.mark.slow
@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="the AVX2 build needs an x86-64-v3 CPU"
)
@pytest.mark.skipif(AVX2_IS_THIS_BUILD, reason="this CPU's own build is the AVX2 build")
@pytest.mark.parametrize("variant", ["bfloat16", "w8a8", "int8", "int4"])
def test_the_avx2_build_keeps_it_too(wide_model, cache, variant):
    knobs = VARIANTS[variant] | {"batch_invariant": True}
    assert_all_equal(situations_apart(wide_model, knobs, cache, AVX2_ENV))


def records(llm: LLM) -> dict[str, tuple[int, torch.Tensor]]:
    """Each Linear's one form under the flag: its records and their format."""
    found = {}
    for name, layer in llm.engine.model.named_modules():
        if isinstance(layer, Linear):
            assert layer.packed is None and layer.quantized is None and layer.int8 is None
            assert layer.native is not None, name
            found[name] = (layer.native[1], layer.native[0])
    return found


def test_quantized_models_keep_the_native_steps_records_alone(wide_model, tmp_path, monkeypatch):
    """Under the flag int8, int4 and int4-w8a8 keep one form of each weight, the native decode
    step's records, which serve every matmul: int4's Q4 (its head Q8), int8's Q8; int4-w8a8 takes
    int4's very records (its name's other half, w8a8 for wide steps, is a second kernel)."""
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path))
    got = {}
    for quantization in ("int8", "int4", "int4-w8a8"):
        with LLM(
            str(wide_model),
            dtype="bfloat16",
            quantization=quantization,
            batch_invariant=True,
            enforce_eager=True,
        ) as llm:
            assert llm.engine.plan.pack_linear is None and llm.engine.executor.native is None
            got[quantization] = records(llm)
    formats = {q: {name: fmt for name, (fmt, _) in found.items()} for q, found in got.items()}
    assert set(formats["int8"].values()) == {NATIVE_Q8}
    assert formats["int4"]["lm_head"] == NATIVE_Q8
    assert {f for name, f in formats["int4"].items() if name != "lm_head"} == {NATIVE_Q4}
    for name, (fmt, packed) in got["int4"].items():
        assert got["int4-w8a8"][name][0] == fmt and torch.equal(got["int4-w8a8"][name][1], packed)


def test_the_flag_takes_the_native_gemm_and_no_native_step(wide_model):
    with LLM(str(wide_model), dtype="float32", batch_invariant=True, enforce_eager=True) as llm:
        plan = llm.engine.plan
        assert plan.batch_invariant and plan.pack_linear == "panels" and not plan.native_decode
        assert llm.engine.executor.native is None
        head = llm.engine.model.lm_head
        assert head.packed is not None and head.packed_form == "panels"
        assert head.packed.dtype.is_floating_point and head.packed.dim() == 3


def test_decodes_attend_through_the_prefill_kernel():
    """The decode kernel sums a dot product across vector lanes, the prefill kernel along the
    head: a few float32 ulps apart. Under the flag a decode takes the prefill kernel's path (a
    chunk of one token), so a token attended as a decode and recomputed in a prefill after a
    preemption are the same bits."""
    lib = native.library(2, 64)
    assert lib is not None
    torch.manual_seed(0)
    k, v = torch.randn(2, 1024, 64), torch.randn(2, 1024, 64)
    table = torch.arange(24).view(3, 8)
    ctx, q = torch.tensor([37, 100, 5]), torch.randn(3, 4, 64)
    ones = torch.ones(3, dtype=torch.long)
    decode = native_attention.paged_attention(lib, q, k, v, table, ctx, 16)
    prefill = native_attention.paged_attention(lib, q, k, v, table, ctx, 16, ones)
    assert not torch.equal(decode, prefill) and torch.allclose(decode, prefill, atol=1e-5)
    spec = KVSpec("gqa", 1, 2, 64, 64, 16, torch.float32, num_tensors=2)
    cache = PagedCache(spec, 64, torch.device("cpu"))
    cache.k_cache[0].copy_(k)
    cache.v_cache[0].copy_(v)
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    for as_prefill, want in ((False, decode), (True, prefill)):
        step = StepAttention(cache, pages, ctx - 1, ones, ctx, 3, 1, lib, None, as_prefill)
        got = step.groups[0].attend(q, cache.k_cache[0], cache.v_cache[0])
        assert torch.equal(got, want)
