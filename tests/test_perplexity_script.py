"""bench/perplexity.py: each variant scores a text, the `-native` ones token by token through
the native decode step over the engine's paged KV (they had stopped running when a step's
pages became a list per KV group), within what the quantization allows of bf16's figure."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from pypto_serving import native
from pypto_serving.ops import linear

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import perplexity

MODEL = "qwen3-hd32-gqa4"  # a shape the native decode step runs


@pytest.mark.skipif(native.compiler() is None, reason="the native decode step needs a compiler")
def test_each_variant_scores_the_text_the_native_ones_step_by_step(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_cache
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(7 * i) % 41} x{i % 13}" for i in range(300)))
    out = tmp_path / "scores.json"
    monkeypatch.setattr(linear, "QUANTIZED_MAX_ROWS", linear.QUANTIZED_MAX_ROWS)  # (it sets it)
    argv = ["perplexity.py", "--model", str(tiny_model(MODEL)), "--text", str(text)]
    argv += ["--quantization", "none,int8-native,int4-native", "--chunk", "48"]
    monkeypatch.setattr(sys, "argv", [*argv, "--max-chunks", "2", "--json", str(out)])
    assert perplexity.main() == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"float32", "bfloat16", "int8-native", "int4-native"}
    assert all(r["tokens"] == 2 * 47 for r in rows.values())
    bf16 = math.log(rows["bfloat16"]["perplexity"])
    for variant, share in (("int8-native", 0.02), ("int4-native", 0.1)):
        assert abs(math.log(rows[variant]["perplexity"]) - bf16) < share * bf16, rows
        assert rows[variant]["top1_agreement_with_float32"] > 0.7, rows
