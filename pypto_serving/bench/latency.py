"""`pypto bench latency`: one request at a time, timed through the engine's step loop.

TTFT is the time from queuing the request to its first output token; decode speed is the
tokens after the first over the time after the first; output tok/s is the tokens over the
whole request. Each iteration uses fresh random token ids (so the prefix cache cannot shorten
a prefill), EOS ignored; or with `--workload echo|open` the next of that workload's chat
prompts (`datasets.WORKLOADS`: a given text asked back, or new text), each ending where the
model ends it, for speculative decoding (`--speculative-config`; its drafts' acceptance is
reported); medians over `--iters` are reported.
Start-up to first token is the engine's start-up and a first (warm-up) request's TTFT; with
`--background-compile` that request may run before the graphs are ready, and the timed ones
wait until they are.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pypto_serving.bench import (
    add_report_flags,
    engine_info,
    peak_rss_mib,
    report,
    start_engine,
    wait_compiled,
)
from pypto_serving.bench.datasets import WORKLOADS, chat_prompts, random_prompts, sampling_vocab
from pypto_serving.errors import PyptoError
from pypto_serving.flags import add_engine_flags, engine_knobs, positive_int

if TYPE_CHECKING:
    from pypto_serving.engine.llm import LLM

WARMUP_TOKENS = 4
WARMUP_SEED_OFFSET = 1_000_003


@dataclass(slots=True)
class Timing:
    ttft_s: float
    decode_s: float
    output_tokens: int
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tok_per_s(self) -> float:
        return (self.output_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / (self.ttft_s + self.decode_s)


@dataclass(slots=True)
class LatencyResult:
    benchmark: str
    input_len: int
    output_len: int
    iters: int
    ttft_ms: float
    decode_tok_per_s: float
    output_tok_per_s: float
    tpot_ms: float
    e2e_s: float
    startup_s: float
    first_token_s: float
    """From starting the engine to a first request's first token."""
    peak_rss_mib: float
    ttft_ms_all: list[float] = field(default_factory=list)
    decode_tok_per_s_all: list[float] = field(default_factory=list)
    workload: str = "random"
    output_tokens_all: list[int] = field(default_factory=list)
    draft_acceptance: float | None = None
    """Speculative decoding: the fraction of draft tokens kept (None: not speculating)."""
    mean_accepted_length: float | None = None
    """Tokens per step of a request with drafts (its kept drafts and the one after)."""
    engine: dict[str, Any] = field(default_factory=dict)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("latency", help="single stream: time to first token, decode tok/s")
    p.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens (random)")
    p.add_argument(
        "--workload",
        choices=("random", *WORKLOADS),
        default="random",
        help="random token ids (EOS ignored), or chat prompts asking for a given text back "
        "(echo) or for new text (open), greedy to EOS or --output-len",
    )
    p.add_argument("--output-len", type=positive_int, default=256, help="tokens to generate")
    p.add_argument("--iters", type=positive_int, default=3, help="timed requests (medians)")
    add_report_flags(p)
    add_engine_flags(p)


def time_request(llm: LLM, prompt: list[int], output_len: int, ignore_eos: bool = True) -> Timing:
    """Queue one greedy request and step the engine alone until it finishes."""
    from pypto_serving.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    gc.collect()
    start = time.perf_counter()
    request = llm.add(prompt, params).children[0]
    while not request.output_token_ids and not request.finished:
        llm.step()
    first = time.perf_counter()
    while not request.finished:
        llm.step()
    end = time.perf_counter()
    return Timing(
        first - start, end - first, len(request.output_token_ids), request.output_token_ids
    )


def run(args: argparse.Namespace) -> int:
    if args.output_len < 2:
        raise PyptoError("--output-len must be >= 2 (decode speed needs tokens after the first)")
    llm, startup = start_engine(engine_knobs(args))
    vocab = sampling_vocab(llm.tokenizer, llm.engine.model_config.vocab_size)
    warm = random_prompts(vocab, 1, args.input_len, args.seed + WARMUP_SEED_OFFSET)[0]
    first = startup + time_request(llm, warm, min(args.output_len, WARMUP_TOKENS)).ttft_s
    wait_compiled(llm, warm)
    if args.workload == "random":
        prompts = [
            random_prompts(vocab, 1, args.input_len, args.seed + i)[0] for i in range(args.iters)
        ]
    else:
        chats = chat_prompts(llm.tokenizer, args.workload)
        prompts = [chats[i % len(chats)] for i in range(args.iters)]
    before = llm.engine.stats().spec_decode
    ignore_eos = args.workload == "random"
    timings = [time_request(llm, p, args.output_len, ignore_eos) for p in prompts]
    result = summarize(args, timings, startup, first)
    after = llm.engine.stats().spec_decode
    if after is not None:
        drafts = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
        kept = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        steps = after.num_drafts - (before.num_drafts if before else 0)
        result.draft_acceptance = kept / drafts if drafts else 0.0
        result.mean_accepted_length = 1 + kept / steps if steps else 1.0
    result.engine = engine_info(llm)
    result.peak_rss_mib = peak_rss_mib(llm)
    report("pypto bench latency", table_rows(result), asdict(result), args.json)
    return 0


def summarize(
    args: argparse.Namespace, timings: list[Timing], startup: float, first_token: float
) -> LatencyResult:
    ttft = [t.ttft_s * 1000 for t in timings]
    decode = [t.decode_tok_per_s for t in timings]
    tpot = [1000 * t.decode_s / max(1, t.output_tokens - 1) for t in timings]
    return LatencyResult(
        benchmark="latency",
        input_len=args.input_len,
        output_len=args.output_len,
        iters=len(timings),
        ttft_ms=statistics.median(ttft),
        decode_tok_per_s=statistics.median(decode),
        output_tok_per_s=statistics.median(t.output_tok_per_s for t in timings),
        tpot_ms=statistics.median(tpot),
        e2e_s=statistics.median(t.ttft_s + t.decode_s for t in timings),
        startup_s=startup,
        first_token_s=first_token,
        peak_rss_mib=peak_rss_mib(),
        ttft_ms_all=ttft,
        decode_tok_per_s_all=decode,
        workload=args.workload,
        output_tokens_all=[t.output_tokens for t in timings],
    )


def table_rows(r: LatencyResult) -> list[tuple[str, str]]:
    e = r.engine
    rows = [
        ("workload", r.workload),
        ("prompt tokens", str(r.input_len) if r.workload == "random" else "its chat prompts"),
        ("output tokens", str(r.output_len) if r.workload == "random" else f"<= {r.output_len}"),
        ("iterations", str(r.iters)),
        ("engine", f"{e['executor']} {e['dtype']}"),
        ("threads", str(e["threads"])),
        ("TTFT median (ms)", f"{r.ttft_ms:.1f}"),
        ("decode tok/s median", f"{r.decode_tok_per_s:.1f}"),
        ("output tok/s median", f"{r.output_tok_per_s:.1f}"),
        ("TPOT median (ms)", f"{r.tpot_ms:.1f}"),
        ("end-to-end median (s)", f"{r.e2e_s:.2f}"),
        ("start-up (s)", f"{r.startup_s:.2f}"),
        ("start-up to first token (s)", f"{r.first_token_s:.2f}"),
        ("peak RSS (MiB)", f"{r.peak_rss_mib:.0f}"),
    ]
    if r.draft_acceptance is not None and r.mean_accepted_length is not None:
        rows += [
            ("draft tokens kept", f"{100 * r.draft_acceptance:.1f} %"),
            ("tokens per step with drafts", f"{r.mean_accepted_length:.2f}"),
        ]
    return rows
