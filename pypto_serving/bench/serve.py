"""`pypto bench serve`: load an OpenAI-compatible server (ours or `vllm serve`) and time it.

Every request streams; its TTFT, inter-token latencies, TPOT and end-to-end latency are taken
on the client (serve_client.py). Requests arrive as a seeded Poisson process of
`--request-rate` (default: all at once) with at most `--max-concurrency` in flight. Failed
requests are counted with their reasons and left out of every latency and token figure.
The summary is printed as a table; `--result-json` adds the per-request records and `--plot`
draws latency CDFs and output throughput over time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pypto_serving.bench import report
from pypto_serving.bench.datasets import WORKLOADS, sampling_vocab
from pypto_serving.bench.serve_client import (
    RequestRecord,
    Target,
    fetch_model_name,
    get_models,
    make_client,
    run_load,
)
from pypto_serving.bench.serve_datasets import (
    DATASETS,
    Session,
    check_dataset,
    default_endpoint,
    multi_turn_sessions,
    random_sessions,
    shared_prefix_sessions,
    workload_sessions,
)
from pypto_serving.errors import PyptoError
from pypto_serving.flags import positive_int
from pypto_serving.http_client import normalize_base_url

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
SLO_METRICS = ("ttft", "tpot", "e2e")
MAX_REASONS_SHOWN = 5


@dataclass(slots=True)
class LatencySummary:
    mean_ms: float
    median_ms: float
    p99_ms: float


@dataclass(slots=True)
class ServeResult:
    benchmark: str
    base_url: str
    endpoint: str
    model: str
    dataset: str
    request_rate: float | None
    """Requests (sessions) per second; null: all sent at once."""
    max_concurrency: int | None
    num_requests: int
    successful: int
    failed: int
    duration_s: float
    requests_per_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    prompt_tokens: int
    output_tokens: int
    ttft: LatencySummary | None
    tpot: LatencySummary | None
    itl: LatencySummary | None
    e2e: LatencySummary | None
    slo_ms: dict[str, float] = field(default_factory=dict)
    goodput_requests_per_s: float | None = None
    """Successful requests meeting every --slo target, per second (null without --slo)."""
    failure_reasons: dict[str, int] = field(default_factory=dict)
    ttft_first_turn_median_ms: float | None = None
    ttft_later_turns_median_ms: float | None = None
    cached_prompt_fraction: float | None = None
    """Prompt tokens the server reported cached / prompt tokens (null if it reports none)."""
    cached_fraction_per_tier: dict[str, float] = field(default_factory=dict)
    """The same per KV tier, when the server reports tiers (pypto's usage extension)."""
    requests: list[dict[str, Any]] = field(default_factory=list)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


BACKENDS = {"openai": "completions", "openai-chat": "chat"}
"""vLLM's `--backend` names of the two endpoints."""


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "serve", help="serving: stream requests to a running OpenAI-compatible server"
    )
    server = p.add_argument_group("server")
    server.add_argument(
        "--base-url", default=DEFAULT_BASE_URL, help=f"the server (default: {DEFAULT_BASE_URL})"
    )
    server.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        help="/v1/completions or /v1/chat/completions "
        "(default: completions, chat for --dataset multi-turn)",
    )
    server.add_argument(
        "--backend",
        choices=list(BACKENDS),
        help="vLLM's spelling of --endpoint: openai (completions) or openai-chat (chat)",
    )
    server.add_argument(
        "--model-name", help="the served model's name (default: the first of GET /v1/models)"
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $OPENAI_API_KEY)",
    )
    server.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a response's next bytes (default: 600)",
    )
    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        "--dataset-name",  # vLLM's spelling (its bench serve)
        default="random",
        help=f"{' | '.join(DATASETS)} (default: random)",
    )
    data.add_argument(
        "--model",
        default="default",
        help="the model whose tokenizer builds the prompts (default: default)",
    )
    data.add_argument("--tokenizer", help="a Hugging Face directory (default: --model's)")
    data.add_argument(
        "--num-prompts", type=positive_int, default=100, help="requests (default: 100)"
    )
    data.add_argument(
        "--input-len",
        "--random-input-len",
        type=positive_int,
        default=256,
        help="prompt tokens (shared-prefix: the unique suffix; multi-turn: each user turn; "
        "default: 256)",
    )
    data.add_argument(
        "--output-len",
        "--random-output-len",
        type=positive_int,
        default=128,
        help="max_tokens (default: 128)",
    )
    data.add_argument(
        "--prefix-len",
        "--random-prefix-len",
        type=non_negative_int,
        default=256,
        help="shared-prefix: its tokens (default: 256)",
    )
    data.add_argument(
        "--num-conversations",
        type=positive_int,
        default=8,
        help="multi-turn: conversations (default: 8)",
    )
    data.add_argument(
        "--turns", type=positive_int, default=4, help="multi-turn: user turns (default: 4)"
    )
    data.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        metavar="S",
        help="multi-turn: seconds between a reply and the next user turn (default: 0)",
    )
    load = p.add_argument_group("load and sampling")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (multi-turn: conversations); default inf: all at once",
    )
    load.add_argument(
        "--max-concurrency", type=positive_int, help="most requests in flight (default: no cap)"
    )
    load.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    load.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly --output-len tokens"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    out = p.add_argument_group("results")
    out.add_argument(
        "--slo",
        nargs="+",
        metavar="METRIC:MS",
        help="goodput targets, any of ttft:MS tpot:MS e2e:MS",
    )
    out.add_argument(
        "--result-json",
        "--json",
        dest="result_json",
        type=Path,
        help="write the summary and every request's record to this JSON file",
    )
    out.add_argument("--plot", type=Path, help="draw latency CDFs and throughput to this PNG")


def parse_slo(items: Sequence[str] | None) -> dict[str, float]:
    """{'ttft': ms, ...} from ['ttft:200', 'e2e:5000']."""
    slo: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        try:
            target = float(value)
        except ValueError:
            target = math.nan
        if not sep or name not in SLO_METRICS or not target > 0 or math.isinf(target):
            raise PyptoError(
                f"bad --slo {item!r}: expected METRIC:MS with METRIC one of "
                f"{', '.join(SLO_METRICS)} and MS a positive number, e.g. ttft:500"
            )
        if name in slo:
            raise PyptoError(f"--slo gives {name} twice")
        slo[name] = target
    return slo


def summarize_latency(values_s: Sequence[float]) -> LatencySummary | None:
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=float) * 1000
    return LatencySummary(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Success and every given target met (a one-token answer has no TPOT: it passes)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    return all((v := values[m]) is None or v * 1000 <= t for m, t in slo.items())


def median_ms(values_s: Sequence[float]) -> float | None:
    return float(np.median(values_s)) * 1000 if values_s else None


def summarize(
    records: list[RequestRecord],
    duration: float,
    slo: dict[str, float],
    info: dict[str, Any],
) -> ServeResult:
    ok = [r for r in records if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    per_s = 1 / duration if duration > 0 else 0.0
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    first = [r.ttft_s for r in ok if r.ttft_s is not None and r.turn == 0]
    later = [r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0]
    multi_turn = info["dataset"] == "multi-turn"
    reported = [r for r in ok if r.cached_tokens is not None]
    reported_prompt = sum(r.prompt_tokens for r in reported)
    per_tier: Counter[str] = Counter()
    for r in reported:
        per_tier.update(r.cached_tokens_per_tier)
    return ServeResult(
        benchmark="serve",
        **info,
        num_requests=len(records),
        successful=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        requests_per_s=len(ok) * per_s,
        output_tok_per_s=output_tokens * per_s,
        total_tok_per_s=(prompt_tokens + output_tokens) * per_s,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft=summarize_latency(ttft),
        tpot=summarize_latency([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=summarize_latency([gap for r in ok for gap in r.itl_s]),
        e2e=summarize_latency([r.e2e_s for r in ok if r.e2e_s is not None]),
        slo_ms=slo,
        goodput_requests_per_s=sum(meets_slo(r, slo) for r in ok) * per_s if slo else None,
        failure_reasons=dict(Counter(r.error for r in records if not r.success).most_common()),
        ttft_first_turn_median_ms=median_ms(first) if multi_turn else None,
        ttft_later_turns_median_ms=median_ms(later) if multi_turn else None,
        cached_prompt_fraction=(
            sum(r.cached_tokens or 0 for r in reported) / reported_prompt
            if reported_prompt
            else None
        ),
        cached_fraction_per_tier={
            tier: n / reported_prompt for tier, n in per_tier.items() if reported_prompt
        },
        requests=[asdict(r) for r in records],
    )


def table_rows(r: ServeResult) -> list[tuple[str, str]]:
    rows = [
        ("endpoint", r.endpoint),
        ("model", r.model if len(r.model) <= 24 else "…" + r.model[-23:]),
        ("dataset", r.dataset),
        ("request rate (/s)", "inf" if r.request_rate is None else f"{r.request_rate:g}"),
        ("max concurrency", str(r.max_concurrency or "-")),
        ("successful requests", str(r.successful)),
        ("failed requests", str(r.failed)),
        ("duration (s)", f"{r.duration_s:.2f}"),
        ("requests/s", f"{r.requests_per_s:.2f}"),
        ("output tok/s", f"{r.output_tok_per_s:.1f}"),
        ("total tok/s", f"{r.total_tok_per_s:.1f}"),
        ("prompt tokens", str(r.prompt_tokens)),
        ("output tokens", str(r.output_tokens)),
    ]
    for name, s in (("TTFT", r.ttft), ("TPOT", r.tpot), ("ITL", r.itl), ("E2E", r.e2e)):
        if s is not None:
            rows += [
                (f"{name} mean (ms)", f"{s.mean_ms:.1f}"),
                (f"{name} median (ms)", f"{s.median_ms:.1f}"),
                (f"{name} p99 (ms)", f"{s.p99_ms:.1f}"),
            ]
    if r.dataset == "multi-turn":
        for label, value in (
            ("TTFT median, first turns (ms)", r.ttft_first_turn_median_ms),
            ("TTFT median, later turns (ms)", r.ttft_later_turns_median_ms),
        ):
            rows.append((label, "-" if value is None else f"{value:.1f}"))
    if r.cached_prompt_fraction is not None:
        rows.append(("prompt tokens cached (%)", f"{100 * r.cached_prompt_fraction:.1f}"))
        for tier, fraction in r.cached_fraction_per_tier.items():
            rows.append((f"  of which from {tier} (%)", f"{100 * fraction:.1f}"))
    if r.goodput_requests_per_s is not None:
        slo = " ".join(f"{k}:{v:g}" for k, v in r.slo_ms.items())
        rows += [("SLO (ms)", slo), ("goodput (req/s)", f"{r.goodput_requests_per_s:.2f}")]
    return rows


def write_failure_reasons(reasons: dict[str, int]) -> None:
    if not reasons:
        return
    lines = ["failure reasons (count  reason):"]
    lines += [f"{n:>6}  {reason}" for reason, n in list(reasons.items())[:MAX_REASONS_SHOWN]]
    if len(reasons) > MAX_REASONS_SHOWN:
        lines.append(f"        ... and {len(reasons) - MAX_REASONS_SHOWN} other reasons")
    sys.stdout.write("\n".join(lines) + "\n")


def import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PyptoError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def output_throughput_over_time(
    records: list[RequestRecord], duration: float
) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts s, output tok/s per bin): each text chunk's tokens land at its arrival."""
    times, tokens = [], []
    for r in records:
        if not r.success or r.ttft_s is None or not r.completion_tokens:
            continue
        arrivals = r.start_s + r.ttft_s + np.concatenate(([0.0], np.cumsum(r.itl_s)))
        times.append(arrivals)
        tokens.append(np.full(len(arrivals), r.completion_tokens / len(arrivals)))
    width = max(duration / 50, 0.01) if duration < 50 else 1.0
    edges = np.arange(0.0, max(duration, width) + width, width)
    if not times:
        return edges[:-1], np.zeros(len(edges) - 1)
    counts, _ = np.histogram(np.concatenate(times), edges, weights=np.concatenate(tokens))
    return edges[:-1], counts / width


def plot(result: ServeResult, records: list[RequestRecord], path: Path) -> None:
    """Latency CDFs (TTFT, TPOT, E2E) and output throughput over time, as one PNG."""
    plt = import_pyplot()
    ok = [r for r in records if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, values) in zip(
        axes.flat,
        (
            ("TTFT", [r.ttft_s for r in ok if r.ttft_s is not None]),
            ("TPOT", [r.tpot_s for r in ok if r.tpot_s is not None]),
            ("E2E latency", [r.e2e_s for r in ok if r.e2e_s is not None]),
        ),
        strict=False,
    ):
        ms = np.sort(np.asarray(values, dtype=float) * 1000)
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    starts, rate = output_throughput_over_time(records, result.duration_s)
    ax = axes.flat[3]
    ax.step(starts, rate, where="post")
    ax.set(title="output throughput", xlabel="time since start (s)", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(
        f"pypto bench serve: {result.dataset}, {result.endpoint}, {result.model} "
        f"({result.successful} ok, {result.failed} failed)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_sessions(args: argparse.Namespace, endpoint: str) -> list[Session]:
    from pypto_serving.models.default_model import resolve_model_path
    from pypto_serving.models.loader import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(args.tokenizer or args.model))
    vocab = sampling_vocab(tokenizer, len(tokenizer))
    chat = endpoint == "chat"
    if args.dataset == "random":
        return random_sessions(
            tokenizer, vocab, args.num_prompts, args.input_len, args.output_len, args.seed, chat
        )
    if args.dataset in WORKLOADS:
        return workload_sessions(tokenizer, args.dataset, args.num_prompts, args.output_len, chat)
    if args.dataset == "shared-prefix":
        return shared_prefix_sessions(
            tokenizer,
            vocab,
            args.num_prompts,
            args.prefix_len,
            args.input_len,
            args.output_len,
            args.seed,
            chat,
        )
    return multi_turn_sessions(
        tokenizer,
        vocab,
        args.num_conversations,
        args.turns,
        args.input_len,
        args.output_len,
        args.seed,
    )


async def resolve_model_name(
    target: Target, given: str | None, transport: httpx.AsyncBaseTransport | None
) -> str:
    """--model-name, or the server's first model; fails clearly when the server is away."""
    async with make_client(target, transport) as client:
        if given is None:
            return await fetch_model_name(client, target.base_url)
        await get_models(client, target.base_url)
        return given


async def play(
    target: Target,
    sessions: list[Session],
    args: argparse.Namespace,
    transport: httpx.AsyncBaseTransport | None,
) -> tuple[list[RequestRecord], float]:
    from tqdm import tqdm

    total = sum(len(s.user_turns) for s in sessions)
    with tqdm(total=total, desc="requests", file=sys.stderr, disable=None) as bar:
        async with make_client(target, transport) as client:
            return await run_load(
                client,
                target,
                sessions,
                args.request_rate,
                args.max_concurrency,
                args.seed,
                on_request_done=lambda: bar.update(1),
                think_time_s=args.think_time,
            )


def run(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> int:
    """The benchmark; `transport` replaces the network (tests pass a fake server)."""
    if args.backend is not None and args.endpoint not in (None, BACKENDS[args.backend]):
        raise PyptoError(f"--backend {args.backend} and --endpoint {args.endpoint} disagree")
    endpoint = args.endpoint or BACKENDS.get(args.backend or "") or default_endpoint(args.dataset)
    check_dataset(args.dataset, endpoint)
    slo = parse_slo(args.slo)
    if not (args.think_time >= 0 and math.isfinite(args.think_time)):
        raise PyptoError(f"--think-time must be a number of seconds >= 0, got {args.think_time}")
    if not args.request_rate > 0:
        raise PyptoError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not args.timeout > 0:
        raise PyptoError(f"--timeout must be > 0, got {args.timeout}")
    if args.plot is not None:
        import_pyplot()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    target = Target(
        normalize_base_url(args.base_url),
        endpoint,
        model="",
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )
    target.model = asyncio.run(resolve_model_name(target, args.model_name, transport))
    sessions = build_sessions(args, endpoint)
    records, duration = asyncio.run(play(target, sessions, args, transport))
    info = {
        "base_url": target.base_url,
        "endpoint": endpoint,
        "model": target.model,
        "dataset": args.dataset,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
    }
    result = summarize(records, duration, slo, info)
    report("pypto bench serve", table_rows(result), asdict(result), args.result_json)
    write_failure_reasons(result.failure_reasons)
    if args.plot is not None:
        plot(result, records, args.plot)
    if not result.successful:
        reason = next(iter(result.failure_reasons), "no request was sent")
        raise PyptoError(f"all {result.num_requests} requests failed; most common reason: {reason}")
    return 0
