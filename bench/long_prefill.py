"""Prefill of one long prompt, step by step: how long the first 2k, 4k, ... tokens take.

    python bench/long_prefill.py --prompt-len 8000 --num-threads 1 --dtype float32
    PYPTO_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python bench/long_prefill.py ...  # as AVX2 CPUs
    python bench/long_prefill.py --against OLD_DIR ...  # A/B: another version's native/*.cpp
    python bench/long_prefill.py --text docs/architecture.md ...  # a prompt of real text

The prompt ([28] * N, as issue 23 sent it, or with --text a file's tokens, repeated to N:
real text's attention is peaked where one token repeated spreads it evenly) is prefilled in
`pypto serve`'s chunks (512 tokens a step, 1024 a step's budget) after an untimed warm-up
request; a prompt of k tokens takes what the first k tokens of the long one take (the same
chunks from position 0), so one run gives every length. With --against, a second engine
attends with the native kernels built from OLD_DIR's sources, and the two step in turn, so
both see the same machine load. Prints one line per step and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--report", default="2048,4096,8000", help="prompt lengths to report")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compiled", action="store_true", help="compile first (else eager)")
    ap.add_argument("--against", type=Path, help="a folder with other native/*.cpp (A/B)")
    ap.add_argument("--text", type=Path, help="prompt: this file's tokens (else [28] * N)")
    args = ap.parse_args()
    if args.text is not None and not args.text.is_file():
        ap.error(f"--text: no file {args.text}")

    import torch

    from pypto_serving.device import cpu_isa
    from pypto_serving.sampling import SamplingParams

    engines = {"current": _engine(args)}
    if args.against is not None:
        engines["against"] = _engine(args, args.against)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    requests, done = {}, {name: {} for name in engines}
    total = dict.fromkeys(engines, 0.0)
    prompt = [28] * args.prompt_len
    if args.text is not None:
        ids = engines["current"].tokenizer.encode(args.text.read_text(), add_special_tokens=False)
        prompt = (ids * (args.prompt_len // len(ids) + 1))[: args.prompt_len]
    for name, llm in engines.items():
        llm.generate([[29] * 64], greedy, use_tqdm=False)  # warm-up: library, threads, pages
        requests[name] = llm.add(prompt, greedy).children[0]
    while any(llm.engine.has_unfinished() for llm in engines.values()):
        for name, llm in engines.items():  # a step each, in turn
            if not llm.engine.has_unfinished():
                continue
            request, start = requests[name], time.perf_counter()
            context = request.num_computed_tokens
            llm.step()
            took = time.perf_counter() - start
            total[name] += took
            done[name][request.num_computed_tokens] = total[name]
            reached = request.num_computed_tokens
            print(f"{name:8s} tokens {context:5d} -> {reached:5d}: {took:6.1f} s")
    summary: dict[str, Any] = {
        "kernels_isa": cpu_isa(),
        "aten_isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "compiled": args.compiled,
    }
    for name, times in done.items():
        lengths = [n for n in map(int, args.report.split(",")) if n <= args.prompt_len]
        reached = {n: next(t for k, t in sorted(times.items()) if k >= n) for n in lengths}
        summary[f"{name}_prefill_s"] = {n: round(t, 2) for n, t in reached.items()}
    print(json.dumps(summary))
    for llm in engines.values():
        llm.close()


def _engine(args: argparse.Namespace, sources: Path | None = None) -> Any:
    """An engine; with `sources`, attending with the native kernels built from them."""
    from pypto_serving import native
    from pypto_serving.engine.llm import LLM
    from pypto_serving.paths import cache_dir

    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.num_threads,
        enforce_eager=not args.compiled,
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=512,
    )
    if sources is not None:
        cfg, ours = llm.engine.model_config, native.SOURCES
        native.SOURCES = tuple(sources / s.name for s in ours)
        try:
            group = cfg.num_heads // cfg.num_kv_heads
            path = native.build(group, cfg.head_dim, cache_dir() / "kernels")
        finally:
            native.SOURCES = ours
        assert path is not None, "the kernels from those sources did not build"
        llm.engine.executor.attention_kernel = native.load(path)
    return llm


if __name__ == "__main__":
    main()
