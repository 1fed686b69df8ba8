"""`pypto bench offline`: throughput of one `LLM.generate` over a whole dataset.

Greedy, EOS ignored, so every request yields exactly `--output-len` tokens. Prompts are
tokenized before the clock starts; an untimed warm-up on other prompts runs first (other
token ids, so the prefix cache cannot help the timed run) and, with `--background-compile`,
until the graphs are ready.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pypto_serving.bench import (
    add_report_flags,
    engine_info,
    peak_rss_mib,
    report,
    start_engine,
    wait_compiled,
)
from pypto_serving.bench.datasets import file_prompts, random_prompts, sampling_vocab
from pypto_serving.errors import PyptoError
from pypto_serving.flags import add_engine_flags, engine_knobs, positive_int

if TYPE_CHECKING:
    from pypto_serving.engine.llm import LLM

DEFAULT_INPUT_LEN = 256
DEFAULT_NUM_PROMPTS = 64
WARMUP_PROMPTS = 4
WARMUP_TOKENS = 4


@dataclass(slots=True)
class OfflineResult:
    benchmark: str
    dataset: str
    num_prompts: int
    output_len: int
    prompt_tokens: int
    output_tokens: int
    mean_prompt_len: float
    elapsed_s: float
    requests_per_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    startup_s: float
    peak_rss_mib: float
    engine: dict[str, Any] = field(default_factory=dict)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("offline", help="throughput: one generate() over many prompts")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset", choices=["random"], default="random", help="random token-id prompts"
    )
    src.add_argument(
        "--prompts-file", type=Path, help="one prompt per line, or JSONL with a 'prompt' field"
    )
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=None,
        help=f"prompt tokens with --dataset random (default: {DEFAULT_INPUT_LEN})",
    )
    p.add_argument("--output-len", type=positive_int, default=128, help="tokens per request")
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help=f"requests (default: {DEFAULT_NUM_PROMPTS}; with --prompts-file: all of the file's)",
    )
    add_report_flags(p)
    add_engine_flags(p)


def read_dataset(args: argparse.Namespace) -> list[str] | None:
    """The prompt texts of --prompts-file (None for --dataset random), checked before start-up."""
    if args.prompts_file is None:
        return None
    if args.input_len is not None:
        raise PyptoError("--input-len applies to --dataset random, not to --prompts-file")
    return file_prompts(args.prompts_file, args.num_prompts)


def tokenize(
    args: argparse.Namespace, texts: list[str] | None, llm: LLM, vocab: list[int]
) -> list[list[int]]:
    """The dataset as token ids (tokenized here, outside the timed region)."""
    if texts is not None:
        return [llm.encode(t) for t in texts]
    n = args.num_prompts or DEFAULT_NUM_PROMPTS
    return random_prompts(vocab, n, args.input_len or DEFAULT_INPUT_LEN, args.seed)


def greedy(output_len: int) -> Any:
    from pypto_serving.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warm_up(llm: LLM, vocab: list[int], prompts: list[list[int]], seed: int) -> None:
    mean_len = max(1, round(sum(map(len, prompts)) / len(prompts)))
    n = min(len(prompts), WARMUP_PROMPTS)
    warm = random_prompts(vocab, n, mean_len, seed + 1_000_003)
    llm.generate(warm, greedy(WARMUP_TOKENS), use_tqdm=False)
    wait_compiled(llm, warm[0])


def measure(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """Seconds for one generate() over every prompt, and the output tokens it produced."""
    gc.collect()
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run(args: argparse.Namespace) -> int:
    texts = read_dataset(args)
    llm, startup = start_engine(engine_knobs(args))
    vocab = sampling_vocab(llm.tokenizer, llm.engine.model_config.vocab_size)
    prompts = tokenize(args, texts, llm, vocab)
    warm_up(llm, vocab, prompts, args.seed)
    elapsed, out_tokens = measure(llm, prompts, args.output_len)
    prompt_tokens = sum(map(len, prompts))
    result = OfflineResult(
        benchmark="offline",
        dataset=str(args.prompts_file) if args.prompts_file else "random",
        num_prompts=len(prompts),
        output_len=args.output_len,
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        mean_prompt_len=prompt_tokens / len(prompts),
        elapsed_s=elapsed,
        requests_per_s=len(prompts) / elapsed,
        output_tok_per_s=out_tokens / elapsed,
        total_tok_per_s=(prompt_tokens + out_tokens) / elapsed,
        startup_s=startup,
        peak_rss_mib=peak_rss_mib(llm),
        engine=engine_info(llm),
    )
    report("pypto bench offline", table_rows(result), asdict(result), args.json)
    return 0


def table_rows(r: OfflineResult) -> list[tuple[str, str]]:
    e = r.engine
    return [
        ("dataset", r.dataset if len(r.dataset) <= 12 else "…" + r.dataset[-11:]),
        ("prompts", str(r.num_prompts)),
        ("mean prompt tokens", f"{r.mean_prompt_len:.1f}"),
        ("output tokens / request", str(r.output_len)),
        ("engine", f"{e['executor']} {e['dtype']}"),
        ("threads", str(e["threads"])),
        ("elapsed (s)", f"{r.elapsed_s:.2f}"),
        ("requests/s", f"{r.requests_per_s:.2f}"),
        ("output tok/s", f"{r.output_tok_per_s:.1f}"),
        ("total tok/s", f"{r.total_tok_per_s:.1f}"),
        ("start-up (s)", f"{r.startup_s:.2f}"),
        ("peak RSS (MiB)", f"{r.peak_rss_mib:.0f}"),
    ]
