#!/usr/bin/env python
"""Tensor parallelism on one machine: TP=2 (a rank per core, one thread each) vs TP=1.

Runs `pypto bench latency` (single stream: TTFT and decode tok/s) and `pypto bench offline`
on W1 with `--tp 1` and `--tp 2`, one after the other, and prints the figures with the ratio
TP=2 / TP=1; `--json` / `--markdown` keep them.

SmolLM2-135M cannot be split over 2 ranks (3 KV heads, 9 attention heads), so by default the
model is a random checkpoint of SmolLM2-135M's size and cost with heads that divide: hidden
576, 30 layers, MLP 1536, vocabulary 49152, 12 heads of 48 and 4 KV heads (the same q and KV
widths, 576 and 192, as SmolLM2's 9 x 64 and 3 x 64), bf16, with SmolLM2's tokenizer.
`--model DIR` measures another checkpoint instead.

    python bench/tensor_parallel.py --markdown tp.md
    python bench/tensor_parallel.py --num-prompts 8 --output-len 16 --single-len 32   # quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from data_parallel import OFFLINE_METRICS, rows, run_json
from serve_side_by_side import add_output_args, emit, report_of
from side_by_side import DEFAULT_W1, markdown_report

LATENCY_METRICS = (  # (key in the `pypto bench latency` JSON, title, format)
    ("decode_tok_per_s", "single stream decode tok/s", "{:.1f}"),
    ("tpot_ms", "single stream TPOT ms", "{:.1f}"),
    ("ttft_ms", "single stream TTFT ms", "{:.0f}"),
)


def smollm2_shaped(out: Path) -> Path:
    """A random SmolLM2-135M-sized Llama whose heads divide by 2 (and 4), with its tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pypto_serving.models.default_model import resolve_model_path

    smol = resolve_model_path("default")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=48,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for f in smol.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def measure(args: argparse.Namespace, tp: int, tmp: Path) -> dict[str, Any]:
    bench = [sys.executable, "-m", "pypto_serving.cli", "bench"]
    latency = [
        *bench,
        "latency",
        "--model",
        str(args.model),
        "--input-len",
        str(args.single_input_len),
    ]
    latency += ["--output-len", str(args.single_len), "--iters", str(args.iters)]
    offline = [*bench, "offline", "--model", str(args.model), "--prompts-file", str(args.w1)]
    offline += ["--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
    flags = ["--tp", str(tp)]
    return {
        "latency": run_json([*latency, *flags], tmp / f"lat{tp}.json"),
        "offline": run_json([*offline, *flags], tmp / f"off{tp}.json"),
    }


def table(results: dict[str, Any]) -> list[str]:
    lines = ["| metric | TP=1 | TP=2 | TP=2 / TP=1 |", "|---|---|---|---|"]
    one, two = results["tp1"], results["tp2"]
    for key, title, fmt in LATENCY_METRICS:
        lines.append(rows(title, one["latency"].get(key), two["latency"].get(key), fmt))
    for key, title, fmt in OFFLINE_METRICS:
        lines.append(rows(title, one["offline"].get(key), two["offline"].get(key), fmt))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--w1", type=Path, default=DEFAULT_W1, help="W1 prompts (JSONL)")
    p.add_argument("--num-prompts", type=int, default=64, help="W1 prompts to use")
    p.add_argument("--output-len", type=int, default=128, help="W1 output tokens per prompt")
    p.add_argument("--single-input-len", type=int, default=32)
    p.add_argument("--single-len", type=int, default=256, help="single-stream output tokens")
    p.add_argument("--iters", type=int, default=3, help="single-stream runs (median)")
    p.add_argument("--model", type=Path, help="checkpoint (default: SmolLM2-shaped, see above)")
    add_output_args(p)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = smollm2_shaped(Path(tmp) / "smollm2-shaped")
        results = {f"tp{tp}": measure(args, tp, Path(tmp)) for tp in (1, 2)}
    report = report_of(results)
    model_name = (
        "a random SmolLM2-135M-sized Llama with 12 heads / 4 KV heads (SmolLM2 itself has 3 "
        "KV heads, so no TP=2)"
        if args.model.name == "smollm2-shaped"
        else str(args.model)
    )
    about = (
        f"Single stream: {args.single_input_len} prompt tokens → {args.single_len}, median of "
        f"{args.iters}. W1: {args.num_prompts} prompts × {args.output_len} tokens. Model: "
        f"{model_name}. TP=1 is one "
        "process with a thread per core; TP=2 is two ranks (gloo), each pinned to its own core."
    )
    runs = [r for by_tp in results.values() for r in by_tp.values()]
    commands = [r["command"] for r in runs]
    missing = {f"{tp} {k}": r for tp, v in results.items() for k, r in v.items() if "error" in r}
    text = markdown_report(
        "Tensor parallel: TP=2 vs TP=1", report, about, table(results), commands, missing
    )
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
