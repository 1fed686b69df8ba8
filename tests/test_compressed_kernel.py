"""DeepSeek-V4's native attention (native/compressed.cpp): every query's output (decodes,
several a step, and prefill chunks beside them, each chunk's queries a block at a time)
equals the kind's PyTorch path on the same pages (the window's raw rows, the entries, the
indexer's top k, the sinks), in float32 and bfloat16, on every tiny V4 (window-only, CSA
and HCA layers, top k below and above the entries there are), for the native build and the
AVX2 build; and the greedy tokens of engines with and without it are the same
(tests/test_deepseek_v4.py compares every path with HF's with it on, the run plan's
default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import TINY_DEEPSEEK_V4
from cpu_builds import AVX2_IS_THIS_BUILD
from live_server import tiny_llm

from pypto_serving import SamplingParams
from pypto_serving.kv.kinds.compressed import CompressedStep, Compression, Inputs
from pypto_serving.native import build_compressed, load_compressed

PROMPTS = [[(13 * i + 7 * j) % 300 + 3 for j in range(9 + 17 * i)] for i in range(3)]
"""Three lengths: the decodes complete their windows at different steps."""
PARAMS = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def checked_native(monkeypatch: pytest.MonkeyPatch, library: Any, seen: dict[str, Any]) -> None:
    """Wrap the native path: each call's output against the PyTorch path's, sequence by
    sequence, on the pages as the call left them; `library` (if given) replaces the
    engine's build."""
    native = CompressedStep._attend_native

    def both(
        self: CompressedStep,
        layer: int,
        q: torch.Tensor,
        sinks: torch.Tensor,
        window: int,
        compression: Compression | None,
        inputs: Inputs | None,
    ) -> torch.Tensor:
        if library is not None:
            self.library = library
        out = native(self, layer, q, sinks, window, compression, inputs)
        offset = self.layout.rows[layer]
        raw_rows = self.rows[:, offset : offset + q.shape[-1]]
        nd = self.num_decodes
        for b, (first, count, ctx) in enumerate(self.spans):
            want = torch.cat(
                self._attend_sequence(b, layer, q, raw_rows, sinks, window, compression, inputs)
            )
            got = out[first : first + count].float()
            seen["diff"] = max(seen["diff"], (got - want.float()).abs().max().item())
            seen["decodes" if b < nd else "chunks"] += 1
            seen["longest"] = max(seen["longest"], count)
            seen["mixed"] += 0 < nd < len(self.spans)  # decodes and prefill chunks together
            if compression is not None and compression.indexer is not None:  # more to choose
                seen["chosen"] += ctx // compression.ratio > compression.indexer.topk
        return out

    monkeypatch.setattr(CompressedStep, "_attend_native", both)


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_compressed(tmp_path_factory.mktemp("avx2"), extra_flags=("-march=x86-64-v3",))
    assert path is not None, "the AVX2 build of native/compressed.cpp failed"
    return load_compressed(path)


@pytest.mark.parametrize("name", sorted(TINY_DEEPSEEK_V4))
@pytest.mark.parametrize(
    ("dtype", "build"),
    [
        ("float32", "native"),
        ("bfloat16", "native"),
        pytest.param(
            "float32",
            "avx2",
            marks=pytest.mark.skipif(AVX2_IS_THIS_BUILD, reason="this CPU's build is AVX2's"),
        ),
    ],
)
def test_the_native_kernel_equals_the_pytorch_path(
    tiny_model, monkeypatch, avx2_library, name: str, dtype: str, build: str
) -> None:
    seen = {"diff": 0.0, "decodes": 0, "chunks": 0, "mixed": 0, "chosen": 0, "longest": 0}
    checked_native(monkeypatch, avx2_library if build == "avx2" else None, seen)
    knobs = {"page_size": 6, "max_num_seqs": 3, "max_num_batched_tokens": 12}
    knobs |= {"long_prefill_token_threshold": 12}  # chunks beside decodes in a step
    with tiny_llm(tiny_model(name), dtype=dtype, **knobs) as llm:
        assert llm.engine.attention.own_kernels
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert seen["decodes"] and seen["chunks"] and seen["mixed"]
    assert seen["chosen"]  # the indexer chose too
    assert seen["diff"] < (1e-5 if dtype == "float32" else 1e-2), seen


def test_a_long_chunk_attends_in_several_blocks(tiny_model, monkeypatch) -> None:
    """A prompt of 150 tokens in one step: the kernel's blocks of 64 queries (64, 64, 22),
    each over its own band of rows and the entries so far."""
    seen = {"diff": 0.0, "decodes": 0, "chunks": 0, "mixed": 0, "chosen": 0, "longest": 0}
    checked_native(monkeypatch, None, seen)
    prompts = [[(11 * j) % 300 + 3 for j in range(150)], PROMPTS[1]]
    knobs = {"page_size": 6, "max_num_batched_tokens": 256, "dtype": "float32"}
    with tiny_llm(tiny_model("deepseekv4-swa-csa-hca-hash"), **knobs) as llm:
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert seen["longest"] >= 150 and seen["chosen"] and seen["decodes"], seen
    assert seen["diff"] < 1e-5, seen


def test_without_native_attention_every_query_stays_on_pytorch(tiny_model, monkeypatch):
    calls: list[int] = []
    native = CompressedStep._attend_native
    monkeypatch.setattr(
        CompressedStep,
        "_attend_native",
        lambda self, layer, q, *a: calls.append(len(q)) or native(self, layer, q, *a),
    )
    path: Path = tiny_model("deepseekv4-swa-csa-hca-hash")
    with tiny_llm(path, native_attention=False) as off:
        assert not off.engine.attention.own_kernels
        quiet = [o.outputs[0].token_ids for o in off.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert calls == []
    with tiny_llm(path) as on:
        loud = [o.outputs[0].token_ids for o in on.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert calls and loud == quiet
