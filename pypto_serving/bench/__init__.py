"""`pypto bench`: offline throughput (`offline`), single-stream latency (`latency`), and a
client that loads a running OpenAI-compatible server (`serve`, see serve.py).

`offline` and `latency` load the engine once (its construction is reported as start-up time),
warm it up with an untimed run (and, compiling in the background, wait for the graphs), then
time the workload; the result is printed as a table and,
with `--json FILE`, written as JSON with the same numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pypto_serving.engine.process import peak_rss_mib as process_peak_rss_mib

if TYPE_CHECKING:
    from pypto_serving.engine.llm import LLM


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `pypto bench offline|latency|serve` on the top-level subcommands."""
    from pypto_serving.bench import latency, offline, serve

    bench = sub.add_parser("bench", help="benchmark the engine (throughput, latency, serving)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    offline.add_parser(kinds)
    latency.add_parser(kinds)
    serve.add_parser(kinds)


def run_bench(args: argparse.Namespace) -> int:
    from pypto_serving.bench import latency, offline, serve

    commands = {"offline": offline.run, "latency": latency.run, "serve": serve.run}
    return commands[args.bench_command](args)


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")


def start_engine(knobs: dict[str, Any]) -> tuple[LLM, float]:
    """The engine and its start-up time in seconds (model load, KV allocation, warm-up)."""
    from pypto_serving.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(**knobs)
    return llm, time.perf_counter() - start


def wait_compiled(llm: LLM, prompt: list[int]) -> None:
    """With --background-compile: until the engine's graphs are all compiled, send a short
    warm-up request every half second (replicas report their state as they step), so that
    what is timed next runs at full speed."""
    from pypto_serving.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    while llm.engine.stats().compiling:
        time.sleep(0.5)
        llm.generate([prompt], params, use_tqdm=False)


def engine_info(llm: LLM) -> dict[str, Any]:
    import torch

    engine = llm.engine
    return {
        "model_dir": str(llm.model_dir),
        "dtype": str(engine.dtype).removeprefix("torch."),
        # the one the engine took (auto resolved), where it says (not data-parallel replicas)
        "quantization": getattr(engine, "plan", engine.config).quantization,
        "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
        "device": str(engine.device),
        "executor": engine.config.executor,
        "enforce_eager": engine.config.enforce_eager,
        "background_compile": engine.config.background_compile,
        "threads": getattr(engine, "num_threads", None) or torch.get_num_threads(),
        "data_parallel_size": engine.config.parallel.data_parallel_size,
    }


def peak_rss_mib(llm: LLM | None = None) -> float:
    """Peak resident memory so far, in MiB: this process's (`process.peak_rss_mib`; getrusage's
    where /proc cannot say), plus each data-parallel replica's when `llm` has replicas."""
    own = process_peak_rss_mib() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    replicas = getattr(llm.engine, "replicas", []) if llm is not None else []
    return own + sum(r.peak_rss_mib() for r in replicas)


def report(
    title: str, rows: list[tuple[str, str]], result: dict[str, Any], out: Path | None
) -> None:
    """Print `rows` as a two-column table under `title`; write `result` as JSON to `out`."""
    width = max(len(label) for label, _ in rows)
    lines = [title, "-" * max(len(title), width + 14)]
    lines += [f"{label:<{width}}  {value:>12}" for label, value in rows]
    sys.stdout.write("\n".join(lines) + "\n")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
