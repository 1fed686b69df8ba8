"""The native decode attention kernel against PyTorch's path and a float64 reference.

Pages are scattered at random through the cache, contexts end anywhere within a page, and the
shapes cover grouped-query ratios, head sizes and page sizes; each case is computed three ways:
the kernel reading pages in place, PyTorch's gather + batched matmuls, and float64 attention
over each sequence's keys and values gathered token by token.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pypto_serving.executor.paged import native_decode_kernel
from pypto_serving.kv import paged_decode
from pypto_serving.kv.paged_attention import _Group
from pypto_serving.models.config import ModelConfig

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(q, k_cache, v_cache, block_table, ctx_lens, page_size):
    """float64 attention of each sequence's one query over its keys, gathered token by token."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = []
    for b, ctx in enumerate(ctx_lens.tolist()):
        pos = torch.arange(ctx)
        slots = block_table[b, pos // page_size] * page_size + pos % page_size
        keys = k_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [H, ctx, D]
        values = v_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hcd->hc", q[b].double(), keys) * q.shape[-1] ** -0.5
        out.append(torch.einsum("hc,hcd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def make_case(seed, batch, kv_heads, group, head_dim, page_size, max_ctx, dtype):
    g = torch.Generator().manual_seed(seed)
    ctx_lens = torch.randint(1, max_ctx + 1, (batch,), generator=g)
    width = int((ctx_lens.max() + page_size - 1) // page_size)
    num_pages = batch * width + 3
    k_cache = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g).to(dtype)
    q = (torch.randn(batch, kv_heads * group, head_dim, generator=g) * 2).to(dtype)
    block_table = torch.randperm(num_pages, generator=g)[: batch * width].view(batch, width)
    return q, k_cache, v_cache, block_table, ctx_lens


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    batch=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([16, 32, 64, 128]),
    page_size=st.sampled_from([16, 64]),
    max_ctx=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernel_matches_pytorch_and_float64(
    seed, batch, kv_heads, group, head_dim, page_size, max_ctx, dtype
):
    q, k_cache, v_cache, block_table, ctx_lens = make_case(
        seed, batch, kv_heads, group, head_dim, page_size, max_ctx, dtype
    )
    lib = paged_decode.library(group, head_dim)
    assert lib is not None, "the kernel must build on this machine (g++ is what Inductor uses)"
    ones = torch.ones(batch, dtype=torch.long)
    native = _Group(page_size, kv_heads, block_table, ones, ctx_lens, slice(0, batch), 1, lib)
    plain = _Group(page_size, kv_heads, block_table, ones, ctx_lens, slice(0, batch), 1)
    got = native.attend(q, k_cache, v_cache)
    want = reference(q, k_cache, v_cache, block_table, ctx_lens, page_size)
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(plain.attend(q, k_cache, v_cache).double(), want, atol=tol, rtol=tol)


def test_a_library_refuses_shapes_it_was_not_built_for():
    q, k_cache, v_cache, block_table, ctx_lens = make_case(0, 2, 2, 2, 64, 16, 40, torch.float32)
    lib = paged_decode.library(4, 64)  # built for 4 query heads per KV head, not 2
    with pytest.raises(ValueError, match="not built for"):
        paged_decode.paged_decode(lib, q, k_cache, v_cache, block_table, ctx_lens, 16)


def test_the_library_is_built_once_then_reused(tmp_path: Path):
    first = paged_decode.build(2, 32, tmp_path)
    assert first is not None and first.exists()
    stamp = first.stat().st_mtime_ns
    assert paged_decode.build(2, 32, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert paged_decode.build(2, 64, tmp_path) != first  # another shape, another library
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".so")] == []


def test_without_a_working_compiler_attention_stays_on_pytorch(tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING):
        assert paged_decode.build(3, 64, tmp_path, compiler="no-such-compiler-here") is None
        assert "no C++ compiler" in caplog.text
        broken = tmp_path / "cxx"
        broken.write_text(
            '#!/bin/sh\n[ "$1" = --version ] && echo "cxx 1.0" && exit 0\n'
            "echo 'cxx: cannot compile' >&2\nexit 1\n"
        )
        broken.chmod(0o755)
        assert paged_decode.build(3, 64, tmp_path / "out", compiler=str(broken)) is None
        assert "cannot compile" in caplog.text
    assert not list((tmp_path / "out").glob("*.so"))


def _config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=heads * head_dim,
        intermediate_size=64,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
        rope_inv_freq=(1.0,) * (head_dim // 2),
        rope_scaling=1.0,
        eos_token_ids=(2,),
        torch_dtype="float32",
    )


def test_the_executor_uses_the_kernel_only_where_it_applies(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert native_decode_kernel(_config(9, 3, 64), cpu, torch.bfloat16, 64) is not None
    with caplog.at_level(logging.INFO):
        assert native_decode_kernel(_config(4, 1, 8), cpu, torch.float32, 64) is None
    assert "head_dim 8" in caplog.text
    assert native_decode_kernel(_config(9, 3, 64), cpu, torch.float16, 64) is None
    assert native_decode_kernel(_config(9, 3, 64), torch.device("meta"), torch.float32, 64) is None
    monkeypatch.setitem(os.environ, "PYPTO_NATIVE_ATTENTION", "0")
    assert native_decode_kernel(_config(9, 3, 64), cpu, torch.bfloat16, 64) is None
