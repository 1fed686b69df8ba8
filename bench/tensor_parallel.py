#!/usr/bin/env python
"""Tensor parallelism on one machine: TP=2 (a rank per core, one thread each) vs TP=1.

Runs `pypto bench latency` (single stream: TTFT and decode tok/s) with `--tp 1` and `--tp 2`
alternately, `--rounds` times each (medians), then `pypto bench offline` on W1 with each
(unless --no-w1), and prints the figures with the ratio TP=2 / TP=1; `--json` / `--markdown`
keep them.

SmolLM2-135M cannot be split over 2 ranks (3 KV heads, 9 attention heads), so by default the
model is a random checkpoint of SmolLM2-135M's size and cost with heads that divide: hidden
576, 30 layers, MLP 1536, vocabulary 49152, 12 heads of 48 and 4 KV heads (the same q and KV
widths, 576 and 192, as SmolLM2's 9 x 64 and 3 x 64), bf16, with SmolLM2's tokenizer.
`--model DIR` measures another checkpoint instead.

`--paired N` measures single-stream decode as served instead: `pypto serve --tp 1` and
`pypto serve --tp 2` run at once (each idle while the other answers), and N streamed requests
go to each, alternately, one at a time. Each pair is measured within seconds, so a change in
the machine's speed (on a shared virtual machine, from one run to the next by a third)
falls on both of its halves; the report gives each side's median and the median of the
per-pair ratios, and how many pairs TP=2 won.

    python bench/tensor_parallel.py --markdown tp.md
    python bench/tensor_parallel.py --paired 16 --model M   # single stream, as served
    python bench/tensor_parallel.py --rounds 5 --no-w1   # single stream, on a busy machine
    python bench/tensor_parallel.py --num-prompts 8 --output-len 16 --single-len 32   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pypto_serving.bench.serve_client import RequestRecord, Target, make_client, send_request

sys.path.insert(0, str(Path(__file__).parent))
from data_parallel import OFFLINE_METRICS, rows, run_json
from serve_side_by_side import PORT, add_output_args, emit, report_of, serving
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


def isa() -> str:
    """The vector ISA the kernels are built for here, in words."""
    from pypto_serving.device import cpu_flags

    flags = cpu_flags()
    if "avx512f" in flags:
        extra = [n for f, n in (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI")) if f in flags]
        return "AVX-512" + (f" ({', '.join(extra)})" if extra else "")
    return "AVX2" if "avx2" in flags else "no AVX2"


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Single stream `--rounds` times, TP=1 and TP=2 alternately (a fresh engine each, so
    a change of the machine's load falls on both), then W1 once each unless --no-w1."""
    bench = [sys.executable, "-m", "pypto_serving.cli", "bench"]
    latency = [*bench, "latency", "--model", str(args.model)]
    latency += ["--input-len", str(args.single_input_len), "--output-len", str(args.single_len)]
    latency += ["--iters", str(args.iters)]
    offline = [*bench, "offline", "--model", str(args.model), "--prompts-file", str(args.w1)]
    offline += ["--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
    results: dict[str, Any] = {f"tp{tp}": {"latency_runs": []} for tp in (1, 2)}
    for r in range(args.rounds):
        for tp in (1, 2):
            run = run_json([*latency, "--tp", str(tp)], tmp / f"lat{tp}-{r}.json")
            results[f"tp{tp}"]["latency_runs"].append(run)
    for tp in (1, 2):
        runs = [run for run in results[f"tp{tp}"]["latency_runs"] if "error" not in run]
        keys = [key for key, *_ in LATENCY_METRICS]
        results[f"tp{tp}"]["latency"] = {
            k: statistics.median(run[k] for run in runs) for k in keys if runs
        }
        if not args.no_w1:
            off = run_json([*offline, "--tp", str(tp)], tmp / f"off{tp}.json")
            results[f"tp{tp}"]["offline"] = off
    return results


def streamed(port: int, input_len: int, output_len: int) -> dict[str, float]:
    """One streamed completion (greedy, EOS ignored) through `pypto bench serve`'s client: its
    TTFT and decode tok/s (1 / TPOT)."""
    target = Target(f"http://127.0.0.1:{port}", "completions", "tp", ignore_eos=True)
    prompt = "hello " * input_len

    async def one() -> RequestRecord:
        async with make_client(target) as client:
            record = RequestRecord(conversation=0, turn=0)
            return await send_request(client, target, prompt, input_len, output_len, record)

    record = asyncio.run(one())
    if record.ttft_s is None or record.tpot_s is None:
        raise RuntimeError(f"a streamed request failed: {record.error or 'under 2 tokens'}")
    return {"ttft_ms": record.ttft_s * 1000, "decode_tok_per_s": 1 / record.tpot_s}


def measure_paired(args: argparse.Namespace) -> dict[str, Any]:
    """`pypto serve --tp 1` and `--tp 2` at once; `--paired` requests to each, alternately."""
    results: dict[str, Any] = {f"tp{tp}": {"server": {}, "requests": []} for tp in (1, 2)}
    with ExitStack() as stack:
        for tp in (1, 2):
            port = PORT + tp
            cmd = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(args.model)]
            cmd += ["--port", str(port), "--served-model-name", "tp", "--tp", str(tp)]
            server = results[f"tp{tp}"]["server"]
            if not stack.enter_context(serving(cmd, {}, args.startup_timeout, server, port)):
                return results  # it did not start: `server` says why
        for tp in (1, 2):  # untimed: the first request of a server pays for its warm-up
            streamed(PORT + tp, args.single_input_len, 8)
        for i in range(args.paired):
            for tp in (1, 2) if i % 2 == 0 else (2, 1):  # neither always goes first
                run = streamed(PORT + tp, args.single_input_len, args.single_len)
                results[f"tp{tp}"]["requests"].append(run)
                print(f"pair {i} TP={tp}: {run['decode_tok_per_s']:.1f} tok/s", file=sys.stderr)
    if any("error" in results[f"tp{tp}"]["server"] for tp in (1, 2)):
        return results  # a request failed (`serving` kept why): nothing to sum up
    for tp in (1, 2):
        reqs = results[f"tp{tp}"]["requests"]
        results[f"tp{tp}"]["latency"] = {
            k: statistics.median(r[k] for r in reqs) for k in ("decode_tok_per_s", "ttft_ms")
        }
    pairs = [
        two["decode_tok_per_s"] / one["decode_tok_per_s"]
        for one, two in zip(results["tp1"]["requests"], results["tp2"]["requests"], strict=True)
    ]
    results["pairs"] = {
        "ratio_median": statistics.median(pairs),
        "tp2_won": sum(r > 1 for r in pairs),
        "count": len(pairs),
    }
    return results


def paired_table(results: dict[str, Any]) -> list[str]:
    one, two, pairs = results["tp1"]["latency"], results["tp2"]["latency"], results["pairs"]
    return [
        "| metric | TP=1 | TP=2 | TP=2 / TP=1 |",
        "|---|---|---|---|",
        rows("decode tok/s, median", one["decode_tok_per_s"], two["decode_tok_per_s"], "{:.1f}"),
        rows("TTFT ms, median", one["ttft_ms"], two["ttft_ms"], "{:.0f}"),
        f"| decode tok/s, median of the per-pair ratios | | | {pairs['ratio_median']:.2f}× |",
        f"| pairs where TP=2 decoded faster | | | {pairs['tp2_won']} of {pairs['count']} |",
    ]


def table(results: dict[str, Any]) -> list[str]:
    lines = ["| metric | TP=1 | TP=2 | TP=2 / TP=1 |", "|---|---|---|---|"]
    one, two = results["tp1"], results["tp2"]
    for key, title, fmt in LATENCY_METRICS:
        lines.append(rows(title, one["latency"].get(key), two["latency"].get(key), fmt))
    for key, title, fmt in OFFLINE_METRICS if "offline" in one else ():
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
    p.add_argument("--rounds", type=int, default=1, help="single-stream runs of each, alternately")
    p.add_argument("--no-w1", action="store_true", help="single stream only")
    p.add_argument("--model", type=Path, help="checkpoint (default: SmolLM2-shaped, see above)")
    p.add_argument(
        "--paired", type=int, metavar="N", help="N requests to each of two servers, alternately"
    )
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds (--paired)")
    add_output_args(p)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = smollm2_shaped(Path(tmp) / "smollm2-shaped")
        if args.paired:
            return paired(args)
        results = measure(args, Path(tmp))
    report = report_of(results)
    model_name = (
        "a random SmolLM2-135M-sized Llama with 12 heads / 4 KV heads (SmolLM2 itself has 3 "
        "KV heads, so no TP=2)"
        if args.model.name == "smollm2-shaped"
        else str(args.model)
    )
    w1 = "" if args.no_w1 else f"W1: {args.num_prompts} prompts × {args.output_len} tokens. "
    about = (
        f"Single stream: {args.single_input_len} prompt tokens → {args.single_len}, median of "
        f"{args.iters} requests, then the median over {args.rounds} engine runs of each, TP=1 "
        f"and TP=2 alternately. {w1}Model: "
        f"{model_name}. TP=1 is one process with a thread per core; TP=2 is two ranks, each "
        "with one core's share of threads, not pinned, their collectives through shared memory "
        "(gloo for the rest). "
        f"CPU ISA: {isa()}."
    )
    runs = [
        (f"{tp} {k}", run)
        for tp, v in results.items()
        for k, run in [*enumerate(v["latency_runs"]), ("offline", v.get("offline"))]
        if run is not None
    ]
    commands = [run["command"] for _, run in runs]
    missing = {name: run for name, run in runs if "error" in run}
    text = markdown_report(
        "Tensor parallel: TP=2 vs TP=1", report, about, table(results), commands, missing
    )
    emit(text, report, args)
    return 0


def paired(args: argparse.Namespace) -> int:
    results = measure_paired(args)
    servers = {name: results[name]["server"] for name in ("tp1", "tp2")}
    missing = {name: server for name, server in servers.items() if "error" in server}
    if missing:
        print(f"no figures: {missing}", file=sys.stderr)
        return 1
    about = (
        f"Single stream as served: `pypto serve --tp 1` and `--tp 2` both running, "
        f"{args.paired} streamed completions to each ({args.single_input_len} prompt tokens → "
        f"{args.single_len}, greedy, EOS ignored), alternately, one at a time. Model: "
        f"{args.model}. CPU ISA: {isa()}."
    )
    commands = [server["command"] for server in servers.values()]
    report = report_of(results)
    title = "Tensor parallel as served: TP=2 vs TP=1, paired"
    text = markdown_report(title, report, about, paired_table(results), commands, {})
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
