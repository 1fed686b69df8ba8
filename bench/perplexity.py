#!/usr/bin/env python
"""Perplexity of a model under each quantization, on plain-text files: what a quantization
costs in accuracy, as llama.cpp's `llama-perplexity` reports it.

Each text is tokenized and cut into chunks of --chunk tokens; each chunk runs as one forward
from position 0 (eagerly, dense KV), and every token but a chunk's first is scored. Also
reported: how often each variant's top-1 token agrees with float32's.

The weight-only kinds (int8, int4) use their quantized kernels only for matmuls of a few rows
(decoding); here they are forced onto every row, so the figure is what decoding sees. w8a8
runs the same way in a forward of any size. `int4-native` scores through the native decode
step (executor/native_decode.py, what int4 and int4-w8a8 decode with on the CPU), one token
at a time over the paged KV cache, as a decode would see each: its Q4_1 layers, Q8_0 head
and int8 activations. `gguf-native` does the same with a GGUF file's own Q4_1 / Q8_0
matrices (`--quantization gguf`, auto's choice for such a file: what llama.cpp computes).

    python bench/perplexity.py --text /usr/share/common-licenses/GPL-3 \\
        --quantization none,w8a8,int8,int4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from pypto_serving import LLM, SamplingParams
from pypto_serving.device import linear_packing
from pypto_serving.kv.paged_attention import StepAttention
from pypto_serving.models.default_model import resolve_model_path
from pypto_serving.models.loader import load_model, load_tokenizer
from pypto_serving.ops import linear
from pypto_serving.ops.attention import DenseKV
from pypto_serving.request import Request


def score(model: torch.nn.Module, chunks: list[list[int]]) -> tuple[float, int, torch.Tensor]:
    """(negative log-likelihood summed, tokens scored, top-1 token at every position)."""
    nll, count, tops = 0.0, 0, []
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor(chunk)
            hidden = model(ids, torch.arange(len(chunk)), DenseKV(model.cfg.num_layers))
            logits = model.logits(hidden).float()
            logprobs = torch.log_softmax(logits[:-1], -1)
            nll -= logprobs.gather(1, ids[1:, None]).sum().item()
            count += len(chunk) - 1
            tops.append(logits.argmax(-1))
    return nll, count, torch.cat(tops)


def score_native(llm: LLM, chunks: list[list[int]]) -> tuple[float, int, torch.Tensor]:
    """`score`, each token a step of the native decode step over the engine's KV store."""
    executor = llm.engine.executor
    assert executor.native is not None, "the native decode step does not apply here"
    kv, nll, count, tops = executor.kv, 0.0, 0, []
    with torch.inference_mode():
        for chunk in chunks:
            request = Request("perplexity", chunk, SamplingParams(max_tokens=1))
            assert kv.allocate(request, len(chunk)), "a chunk must fit the KV cache"
            pages = kv.pages([request.request_id])[kv.managers[0].name]  # GQA's one group
            for t in range(len(chunk)):
                one = torch.tensor([t])
                # the attention operator maps the token's slot, as in a step
                step = StepAttention(kv.pool.cache, pages, one, torch.tensor([1]), one + 1, 1, 1)
                logits = executor.native.logits(
                    torch.tensor([chunk[t]]), one, step.slot_mapping, step.block_table, one + 1
                )
                if t + 1 < len(chunk):
                    nll -= torch.log_softmax(logits[0], -1)[chunk[t + 1]].item()
                tops.append(logits[0].argmax().view(1))
            count += len(chunk) - 1
            kv.free(request)
    return nll, count, torch.cat(tops)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--text", action="append", required=True, help="a text file (repeatable)")
    p.add_argument(
        "--quantization",
        default="none,w8a8,int8,int4,int4-native,gguf-native",
        help="comma-separated",
    )
    p.add_argument("--chunk", type=int, default=1024, help="tokens per forward")
    p.add_argument("--max-chunks", type=int, default=6, help="per text file")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    texts = {}
    for path in args.text:
        ids = tokenizer(Path(path).read_text())["input_ids"]
        starts = range(0, len(ids) - args.chunk + 1, args.chunk)
        texts[Path(path).name] = [ids[i : i + args.chunk] for i in starts][: args.max_chunks]
    linear.QUANTIZED_MAX_ROWS = sys.maxsize  # the weight-only kernels on every row
    variants = ["float32", *args.quantization.split(",")]
    reference: dict[str, torch.Tensor] = {}
    results = []
    for variant in variants:
        dtype = torch.float32 if variant == "float32" else torch.bfloat16
        quantization = None if variant in ("float32", "none") else variant
        if variant.endswith("-native"):
            model = LLM(
                str(model_dir), quantization=variant.removesuffix("-native"), enforce_eager=True
            )
        else:
            cpu = torch.device("cpu")  # bf16 packed as the engine packs it (panels on AVX2)
            pack = linear_packing(cpu, dtype)
            model = load_model(model_dir, dtype, cpu, None, quantization, pack=pack)
        for name, chunks in texts.items():
            native = variant.endswith("-native")
            nll, count, top = (score_native if native else score)(model, chunks)
            reference.setdefault(name, top)
            row = {
                "variant": "bfloat16" if variant == "none" else variant,
                "text": name,
                "tokens": count,
                "perplexity": math.exp(nll / count),
                "top1_agreement_with_float32": (top == reference[name]).float().mean().item(),
            }
            results.append(row)
            print(
                f"{row['variant']:>9}  {name:<16} perplexity {row['perplexity']:8.4f}  "
                f"top-1 = float32's {100 * row['top1_agreement_with_float32']:5.1f} %  "
                f"({count} tokens)",
                flush=True,
            )
        if isinstance(model, LLM):
            model.close()
        del model
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
