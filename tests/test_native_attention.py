"""The native paged attention kernels against PyTorch's path and a float64 reference.

Pages are scattered at random through the cache, contexts and chunks start and end anywhere
within a page, and the shapes cover grouped-query ratios, head sizes and page sizes; each case
is computed three ways: the kernel reading pages in place, PyTorch's gather + batched matmuls
(decodes) or masked flash attention (prefill chunks), and float64 causal attention over each
sequence's keys and values gathered token by token.
"""

from __future__ import annotations

import logging
import platform
import time
from pathlib import Path

import pytest
import torch
from cpu_builds import AVX2_IS_THIS_BUILD
from hypothesis import given, settings
from hypothesis import strategies as st

from pypto_serving import native
from pypto_serving.device import cpu_flags, cpu_isa
from pypto_serving.kv import native_attention
from pypto_serving.kv.paged_attention import _Group

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
PYTORCH_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 5e-2}
"""PyTorch's decode path rounds the softmax probabilities to bf16 before weighting the values
(the native kernels keep them in float32), so over a long context its error grows past one
bf16 step of the output: 0.026 was seen against float64 at context 136."""


def reference(q, k_cache, v_cache, block_table, q_lens, ctx_lens, page_size):
    """float64 causal attention of each sequence's queries (the last q_lens[b] of its ctx_lens[b]
    tokens) over its keys and values, gathered token by token."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out, first = [], 0
    for b, (n, ctx) in enumerate(zip(q_lens.tolist(), ctx_lens.tolist(), strict=True)):
        pos = torch.arange(ctx)
        slots = block_table[b, pos // page_size] * page_size + pos % page_size
        keys = k_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [H, ctx, D]
        values = v_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        queries = q[first : first + n].double().transpose(0, 1)  # [H, n, D]
        scores = queries @ keys.transpose(1, 2) * q.shape[-1] ** -0.5  # [H, n, ctx]
        scores.masked_fill_(pos[None, :] > (ctx - n + torch.arange(n))[:, None], -torch.inf)
        out.append((scores.softmax(-1) @ values).transpose(0, 1))
        first += n
    return torch.cat(out)


def make_case(seed, q_lens, kv_heads, group, head_dim, page_size, max_prefix, dtype):
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.tensor(q_lens)
    ctx_lens = q_lens + torch.randint(0, max_prefix + 1, (len(q_lens),), generator=g)
    width = int((ctx_lens.max() + page_size - 1) // page_size)
    num_pages = len(q_lens) * width + 3
    k_cache = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g).to(dtype)
    q = torch.randn(int(q_lens.sum()), kv_heads * group, head_dim, generator=g) * 2
    table = torch.randperm(num_pages, generator=g)[: len(q_lens) * width]
    return q.to(dtype), k_cache, v_cache, table.view(len(q_lens), width), q_lens, ctx_lens


def decode_case(seed, contexts, kv_heads, group, head_dim, page_size, dtype):
    """make_case's decodes at the given contexts: each sequence's last query."""
    q, k, v, table, q_lens, ctx_lens = make_case(
        seed, contexts, kv_heads, group, head_dim, page_size, 0, dtype
    )
    last = q_lens.cumsum(0) - 1
    return q[last], k, v, table, torch.ones_like(q_lens), ctx_lens


SHAPES = dict(
    seed=st.integers(0, 2**31),
    kv_heads=st.integers(1, 3),
    # (query heads per KV head, head_dim): each a library to build (~5 s on a cold cache), so
    # six pairs that take every group of 1 to 8 and every common head size at least once
    shape=st.sampled_from([(1, 64), (2, 32), (2, 128), (3, 64), (4, 32), (8, 128)]),
    page_size=st.sampled_from([16, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)


def check(q, k_cache, v_cache, block_table, q_lens, ctx_lens, page_size, group, head_dim):
    lib = native.library(group, head_dim)
    assert lib is not None, "the kernels must build here (g++ is what Inductor uses too)"
    tokens, max_q = slice(0, len(q)), int(q_lens.max())
    kernel = _Group(page_size, k_cache.shape[0], block_table, q_lens, ctx_lens, tokens, max_q, lib)
    plain = _Group(page_size, k_cache.shape[0], block_table, q_lens, ctx_lens, tokens, max_q)
    got = kernel.attend(q, k_cache, v_cache)
    want = reference(q, k_cache, v_cache, block_table, q_lens, ctx_lens, page_size)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    tol = PYTORCH_TOLERANCE[q.dtype]
    torch.testing.assert_close(plain.attend(q, k_cache, v_cache).double(), want, atol=tol, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 6), max_ctx=st.integers(1, 300), **SHAPES)
def test_decodes_match_pytorch_and_float64(seed, batch, kv_heads, shape, page_size, max_ctx, dtype):
    group, head_dim = shape
    case = make_case(seed, [1] * batch, kv_heads, group, head_dim, page_size, max_ctx - 1, dtype)
    check(*case, page_size, group, head_dim)


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), max_ctx=st.integers(1_025, 9_000), **SHAPES)
def test_long_decodes_split_into_spans_match_float64(
    seed, batch, kv_heads, shape, page_size, max_ctx, dtype
):
    """Past 1,024 tokens a decode's context is attended in spans (up to 8), merged after."""
    group, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    contexts = [max_ctx, *torch.randint(1, max_ctx + 1, (batch - 1,), generator=g).tolist()]
    q, k, v, table, q_lens, ctx_lens = decode_case(
        seed, contexts, kv_heads, group, head_dim, page_size, dtype
    )
    lib = native.library(group, head_dim)
    assert lib is not None
    got = native_attention.paged_attention(lib, q, k, v, table, ctx_lens, page_size)
    want = reference(q, k, v, table, q_lens, ctx_lens, page_size)
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_a_decode_is_the_same_bits_alone_batched_and_on_any_team():
    """The spans a context splits into follow its length alone: a decode gets the same bits
    alone, among others of every length (one span, several, the most) and on one thread."""
    q, k, v, table, q_lens, ctx_lens = decode_case(
        7, [9_000, 300, 2_049, 1_024, 5_000], 3, 3, 64, 64, torch.float32
    )
    lib = native.library(3, 64)
    assert lib is not None

    def attend(rows: slice) -> torch.Tensor:
        return native_attention.paged_attention(lib, q[rows], k, v, table[rows], ctx_lens[rows], 64)

    batched = attend(slice(0, 5))
    for b in range(5):
        assert torch.equal(attend(slice(b, b + 1)), batched[b : b + 1]), b
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(attend(slice(0, 5)), batched)
    finally:
        torch.set_num_threads(threads)
    want = reference(q, k, v, table, q_lens, ctx_lens, 64)
    torch.testing.assert_close(batched.double(), want, atol=2e-5, rtol=2e-5)


@settings(max_examples=25, deadline=None)
@given(
    q_lens=st.lists(st.integers(2, 90), min_size=1, max_size=4),
    max_prefix=st.integers(0, 150),
    **SHAPES,
)
def test_prefill_chunks_match_pytorch_and_float64(
    seed, q_lens, kv_heads, shape, page_size, max_prefix, dtype
):
    group, head_dim = shape
    case = make_case(seed, q_lens, kv_heads, group, head_dim, page_size, max_prefix, dtype)
    check(*case, page_size, group, head_dim)


@pytest.mark.parametrize("sharpness", [1, 4])  # the queries' scale: weights spread, peaked
@pytest.mark.parametrize("q_len, max_prefix", [(15, 0), (90, 0), (200, 300), (64, 2_000)])
def test_bf16_prefill_errs_only_as_rounding_its_output_does(q_len, max_prefix, sharpness):
    """A bf16 prefill's error against float64 is that of rounding the exact output to bf16
    (within 3 %, over 4 cases): its arithmetic keeps float32's precision, bf16 pair products
    included (rounding the probabilities to one bf16 added 7-10 % to the spread weights)."""
    err, floor = 0.0, 0.0
    lib = native.library(3, 64)
    assert lib is not None
    for seed in range(4):
        q, k, v, table, q_lens, ctx_lens = make_case(
            seed, [q_len], 2, 3, 64, 16, max_prefix, torch.bfloat16
        )
        q = (q.float() * sharpness).bfloat16()
        want = reference(q, k, v, table, q_lens, ctx_lens, 16)
        group = _Group(16, 2, table, q_lens, ctx_lens, slice(0, q_len), q_len, lib)
        err += (group.attend(q, k, v).double() - want).pow(2).sum().item()
        floor += (want.bfloat16().double() - want).pow(2).sum().item()
    assert err <= 1.03**2 * floor, (err / floor) ** 0.5


def test_a_library_refuses_shapes_it_was_not_built_for():
    q, k_cache, v_cache, table, q_lens, ctx_lens = make_case(
        0, [1, 1], 2, 2, 64, 16, 40, torch.float32
    )
    lib = native.library(4, 64)  # built for 4 query heads per KV head, not 2
    with pytest.raises(ValueError, match="not built for"):
        native_attention.paged_attention(lib, q, k_cache, v_cache, table, ctx_lens, 16)
    with pytest.raises(ValueError, match="not built for"):
        native_attention.paged_attention(lib, q, k_cache, v_cache, table, ctx_lens, 16, q_lens)


def test_the_library_is_built_once_then_reused(tmp_path: Path):
    first = native.build(2, 32, tmp_path)
    assert first is not None and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build(2, 32, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    (decode,) = tmp_path.glob("decode-*.o")  # the shape-free decode step, compiled once
    decode_stamp = decode.stat().st_mtime_ns
    assert native.build(2, 64, tmp_path) != first  # another shape, another library
    assert decode.stat().st_mtime_ns == decode_stamp  # linked again, not compiled again
    kept = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert kept == ["decode", "kernels", "kernels"]  # no temporary file left behind


def test_without_a_working_compiler_the_native_kernels_are_off(tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING):
        assert native.build(3, 64, tmp_path, cxx="no-such-compiler-here") is None
        assert "no C++ compiler" in caplog.text
        broken = tmp_path / "cxx"
        broken.write_text(
            '#!/bin/sh\n[ "$1" = --version ] && echo "cxx 1.0" && exit 0\n'
            "echo 'cxx: cannot compile' >&2\nexit 1\n"
        )
        broken.chmod(0o755)
        assert native.build(3, 64, tmp_path / "out", cxx=str(broken)) is None
        assert "cannot compile" in caplog.text
    assert not list((tmp_path / "out").glob("*.so"))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    tokens=st.integers(1, 40),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 64]),
    extra=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_storing_new_keys_and_values_matches_index_copy(
    seed, tokens, kv_heads, head_dim, extra, dtype
):
    """k and v arrive as views into a projection's output (rows wider than their heads)."""
    g = torch.Generator().manual_seed(seed)
    width = (2 * kv_heads + extra) * head_dim
    rows = torch.randn(tokens, width, generator=g).to(dtype)
    k = rows[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = rows[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    k = k.contiguous() if extra % 2 else k  # keys are often fresh tensors (after RoPE)
    slots = torch.randperm(64, generator=g)[:tokens]
    caches = [torch.randn(kv_heads, 64, head_dim, generator=g).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    lib = native.library(1, head_dim)
    assert native_attention.store_kv(lib, k, v, caches[0], caches[1], slots)
    caches[2].index_copy_(1, slots, k.transpose(0, 1))
    caches[3].index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_keys_laid_out_otherwise_are_left_to_the_caller():
    lib = native.library(1, 16)
    k = torch.randn(16, 4, 2).transpose(0, 2)  # [2, 4, 16], heads not 16 apart
    cache = torch.zeros(4, 8, 16)
    slots = torch.tensor([3, 5])
    assert not native_attention.store_kv(lib, k, k.contiguous(), cache, cache.clone(), slots)
    assert not cache.any()


# --- int8 caches: rows of int8 values and their float32 scale ---------------------------------


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """What the kernels store for rows x [..., D]: D int8 values (x * 127 / max|x|, rounded to
    nearest, halves away from zero), then the float32 scale max|x| / 127 as 4 bytes. (The
    compiler may fuse the kernel's multiply and add, which moves a value lying within float32
    rounding of a half by one: `assert_same_rows`.)"""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    r = x * inv
    values = torch.trunc(r + torch.where(r < 0, -0.5, 0.5)).to(torch.int8)
    return torch.cat([values, (amax / 127).view(torch.int8)], -1)


def assert_same_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got[..., -4:], want[..., -4:])  # the scales, bit for bit
    assert (got[..., :-4].int() - want[..., :-4].int()).abs().max() <= 1
    assert (got != want).float().mean() < 0.01


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] int8 rows -> float32 [..., D]: values * scale."""
    return rows[..., :-4].float() * rows[..., -4:].contiguous().view(torch.float32)


def to_int8_caches(lib, k_cache, v_cache):
    """The caches [Hkv, slots, D] quantized by the kernel's own store, all slots at once."""
    heads, slots, dim = k_cache.shape
    caches = [torch.zeros(heads, slots, dim + 4, dtype=torch.int8) for _ in range(2)]
    k, v = k_cache.transpose(0, 1).contiguous(), v_cache.transpose(0, 1).contiguous()
    assert native_attention.store_kv(lib, k, v, *caches, torch.arange(slots))
    return caches


@settings(max_examples=30, deadline=None)
@given(
    q_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    decode=st.booleans(),
    max_prefix=st.integers(0, 150),
    **SHAPES,
)
def test_int8_caches_attend_as_their_dequantized_rows(
    seed, q_lens, decode, kv_heads, shape, page_size, max_prefix, dtype
):
    """Decodes and prefill chunks over int8 caches equal float64 attention over the rows the
    caches stand for; and those rows are each row's int8 rounding."""
    group, head_dim = shape
    q_lens = [1] * len(q_lens) if decode else q_lens
    q, k_cache, v_cache, table, q_lens, ctx_lens = make_case(
        seed, q_lens, kv_heads, group, head_dim, page_size, max_prefix, dtype
    )
    lib = native.library(group, head_dim)
    k8, v8 = to_int8_caches(lib, k_cache, v_cache)
    assert_same_rows(k8, quantize_rows(k_cache))
    assert_same_rows(v8, quantize_rows(v_cache))
    keys, values = dequantize_rows(k8), dequantize_rows(v8)
    assert (keys - k_cache.float()).abs().max() <= k_cache.float().abs().max() / 254 + 1e-6
    got = native_attention.paged_attention(
        lib, q, k8, v8, table, ctx_lens, page_size, None if decode else q_lens
    )
    want = reference(q, keys, values, table, q_lens, ctx_lens, page_size)
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_int8_rows_of_zeros_and_extremes():
    lib = native.library(1, 16)
    rows = torch.zeros(4, 1, 16)
    rows[1, 0, 3] = -2.5  # one value: it is the scale's 127
    rows[2, 0] = torch.linspace(-1, 1, 16)
    rows[3, 0] = 1e-30  # tiny but not zero
    k8, _ = to_int8_caches(lib, rows.transpose(0, 1), rows.transpose(0, 1))
    assert_same_rows(k8, quantize_rows(rows.transpose(0, 1)))
    assert not k8[0, 0].any()  # zeros: values 0, scale 0.0
    assert k8[0, 1, 3] == -127 and dequantize_rows(k8)[0, 1, 3] == -2.5
    torch.testing.assert_close(dequantize_rows(k8)[0, 2], rows[2, 0], atol=1 / 254, rtol=0)


# --- every vector width: the kernels as AVX2 (8 floats) and SSE (4 floats) CPUs build them ----


@pytest.fixture(scope="module", params=["avx2", "default", "avx512-no-bf16"])
def isa_kernels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """build(group, head_dim) -> the kernels as an x86 CPU of this level builds them
    (PYPTO_CPU_ISA: -march=x86-64-v3, 8-float vectors; x86-64-v2, 4-float vectors), which
    every x86-64-v3 machine can run, and on an AVX-512 CPU with bf16 its build without
    (Skylake-X and Ice Lake: no bf16 pair dot products in prefill); the native build (16
    floats with AVX-512, bf16 pairs where the CPU has them) is the rest of this file's."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 levels")
    if request.param == "avx2" and AVX2_IS_THIS_BUILD:
        pytest.skip("this CPU's own build is the AVX2 build, which the rest of the file runs")
    flags: tuple[str, ...] = ()
    if request.param == "avx512-no-bf16":
        if cpu_isa() != "avx512" or "avx512_bf16" not in cpu_flags():
            pytest.skip("not an AVX-512 CPU with bf16: its own build is the rest of the file's")
        flags = ("-mno-avx512bf16",)
    out = tmp_path_factory.mktemp(f"kernels-{request.param}")

    def build(group: int, head_dim: int):
        with pytest.MonkeyPatch.context() as mp:
            if request.param != "avx512-no-bf16":
                mp.setenv("PYPTO_CPU_ISA", request.param)
            path = native.build(group, head_dim, out, extra_flags=flags)
        assert path is not None, "the kernels must build here (g++ is what Inductor uses too)"
        return native.load(path)

    return build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, head_dim", [(3, 64), (2, 16), (8, 128)])
def test_every_vector_width_matches_float64(isa_kernels, group, head_dim, dtype):
    lib = isa_kernels(group, head_dim)
    for seed, q_lens, max_prefix, page_size in [
        (1, [1, 1, 1], 150, 16),
        (2, [37, 90, 5], 150, 16),
        (3, [70, 2], 300, 64),
        (4, [3_000, 1_100, 9], None, 64),  # decodes at these contexts: 3, 2 and 1 spans
    ]:
        if max_prefix is None:
            case = decode_case(seed, q_lens, 2, group, head_dim, page_size, dtype)
        else:
            case = make_case(seed, q_lens, 2, group, head_dim, page_size, max_prefix, dtype)
        q, k, v, table, q_lens, ctx_lens = case
        decode = bool((q_lens == 1).all())
        want = reference(q, k, v, table, q_lens, ctx_lens, page_size)
        for caches in ((k, v), to_int8_caches(lib, k, v)):
            got = native_attention.paged_attention(
                lib, q, *caches, table, ctx_lens, page_size, None if decode else q_lens
            )
            if caches[0].dtype == torch.int8:
                assert_same_rows(caches[0], quantize_rows(k))
                keys, values = (dequantize_rows(c) for c in caches)
                want = reference(q, keys, values, table, q_lens, ctx_lens, page_size)
            tol = TOLERANCE[q.dtype]
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_prefill_attention_built_for_avx2_keeps_pace_with_pytorch(tmp_path, monkeypatch):
    """SmolLM2's shapes (3 query heads per KV head, head_dim 64), float32, one thread: the
    AVX2 build's prefill attention over pages against PyTorch's flash attention over the same
    keys and values laid out densely. Once 15x slower (GCC built the 16-float vectors lane by
    lane on AVX2, which made every 512-token chunk of an 8k prompt 4 s longer than the one
    before); now within 1.5x. Timed alternately, the best of five, so load slows both alike."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 levels")
    monkeypatch.setenv("PYPTO_CPU_ISA", "avx2")
    lib = native.load(native.build(3, 64, tmp_path))
    page, kv_heads, ctx, n = 64, 3, 1024, 256
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(kv_heads, ctx, 64, generator=g) for _ in range(2))
    q = torch.randn(n, 3 * kv_heads, 64, generator=g)
    table = torch.arange(ctx // page).view(1, -1)
    q_lens, ctx_lens = torch.tensor([n]), torch.tensor([ctx])
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]

    def ours():
        return native_attention.paged_attention(lib, q, k, v, table, ctx_lens, page, q_lens)

    def pytorch():
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.testing.assert_close(ours(), pytorch(), atol=2e-5, rtol=2e-5)
        best = {ours: float("inf"), pytorch: float("inf")}
        for _ in range(5):
            for f in best:
                start = time.perf_counter()
                f()
                best[f] = min(best[f], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert best[ours] < 4 * best[pytorch], {f.__name__: t for f, t in best.items()}
