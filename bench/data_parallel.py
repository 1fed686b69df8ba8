#!/usr/bin/env python
"""Data parallelism on one machine: DP=2 (one thread per replica) vs DP=1 (all threads).

Two workloads, each run with every configuration one after the other (never two at once):

- offline W1: `pypto bench offline` over the W1 prompts (128 output tokens, greedy, EOS
  ignored), the same command with `--dp 1` and `--dp 2`;
- serving: `pypto serve --dp N` under `pypto bench serve` (random 256-token prompts → 128
  tokens, EOS ignored) at concurrency 1 (8 prompts) and 16 (64 prompts).

Prints absolute figures and the ratio DP=2 / DP=1; `--json` / `--markdown` keep them.

    python bench/data_parallel.py --markdown dp.md
    python bench/data_parallel.py --num-prompts 8 --output-len 16 --cases 4:8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serve_side_by_side import (
    METRICS,
    add_output_args,
    bench,
    emit,
    lookup,
    model_dir,
    parse_cases,
    report_of,
    server_command,
    serving,
)
from side_by_side import DEFAULT_W1, markdown_report, ratio

OFFLINE_METRICS = (  # (key in the `pypto bench offline` JSON, title, format)
    ("output_tok_per_s", "W1 output tok/s", "{:.1f}"),
    ("total_tok_per_s", "W1 total tok/s", "{:.1f}"),
    ("elapsed_s", "W1 elapsed s", "{:.1f}"),
    ("startup_s", "start-up s", "{:.1f}"),
    ("peak_rss_mib", "peak RSS MiB (all processes)", "{:.0f}"),
)


def offline(args: argparse.Namespace, dp: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pypto_serving.cli", "bench", "offline"]
    cmd += ["--prompts-file", str(args.w1), "--num-prompts", str(args.num_prompts)]
    return run_json([*cmd, "--output-len", str(args.output_len), "--dp", str(dp)], out)


def run_json(cmd: list[str], out: Path) -> dict[str, Any]:
    """Run a `pypto bench` command with `--json out`: its command and figures, or the error."""
    cmd = [*cmd, "--json", str(out)]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        subprocess.run(cmd, stdout=sys.stderr, check=True, timeout=3600)
    except subprocess.SubprocessError as e:
        return {"command": shlex.join(cmd), "error": str(e)}
    return {"command": shlex.join(cmd), **json.loads(out.read_text())}


def serve(args: argparse.Namespace, dp: int, tmp: Path) -> dict[str, Any]:
    cmd, env = server_command("ours", model_dir(), f"--dp {dp}")
    result: dict[str, Any] = {}
    with serving(cmd, env, args.startup_timeout, result) as started:
        if not started:
            return result
        bench(args, 4, 4, None)  # warm-up, untimed
        for concurrency, prompts in args.cases:
            out = tmp / f"dp{dp}_c{concurrency}.json"
            result[f"c{concurrency}"] = bench(args, concurrency, prompts, out)
    return result


def rows(title: str, a: Any, b: Any, fmt: str) -> str:
    cells = [fmt.format(v) if v is not None else "—" for v in (a, b)]
    r = ratio(b, a)
    return f"| {title} | {cells[0]} | {cells[1]} | " + (f"{r:.2f}×" if r else "—") + " |"


def table(results: dict[str, Any], cases: list[tuple[int, int]]) -> list[str]:
    lines = ["| metric | DP=1 | DP=2 | DP=2 / DP=1 |", "|---|---|---|---|"]
    one, two = results["offline"]["dp1"], results["offline"]["dp2"]
    for key, title, fmt in OFFLINE_METRICS:
        lines.append(rows(title, one.get(key), two.get(key), fmt))
    one, two = results["serve"]["dp1"], results["serve"]["dp2"]
    for c, n in cases:
        for key, title, fmt in METRICS:
            a, b = lookup(one.get(f"c{c}"), key), lookup(two.get(f"c{c}"), key)
            lines.append(rows(f"serve c={c} ({n} prompts): {title}", a, b, fmt))
    lines.append(
        rows("serve start-up to healthy s", one.get("startup_s"), two.get("startup_s"), "{:.0f}")
    )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--w1", type=Path, default=DEFAULT_W1, help="W1 prompts (JSONL)")
    p.add_argument("--num-prompts", type=int, default=64, help="W1 prompts to use")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--input-len", type=int, default=256, help="serving prompt tokens")
    p.add_argument("--cases", default="1:8,16:64", help="concurrency:prompts, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900)
    add_output_args(p)
    args = p.parse_args(argv)
    args.cases = parse_cases(args.cases)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"offline": {}, "serve": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in (1, 2):
            results["offline"][f"dp{dp}"] = offline(args, dp, Path(tmp) / f"offline{dp}.json")
        for dp in (1, 2):
            results["serve"][f"dp{dp}"] = serve(args, dp, Path(tmp))
    report = report_of(results)
    about = (
        f"Offline: W1 ({args.num_prompts} prompts × {args.output_len} tokens). Serving: random "
        f"{args.input_len}-token prompts → {args.output_len} tokens, streamed. DP=1 runs one "
        "process with a thread per core; DP=2 runs two replica processes, each pinned to "
        "its own core with one thread."
    )
    commands = [r["command"] for part in results.values() for r in part.values() if "command" in r]
    missing = {
        f"{part} {dp}": r
        for part, runs in results.items()
        for dp, r in runs.items()
        if "error" in r
    }
    text = markdown_report(
        "Data parallel: DP=2 vs DP=1", report, about, table(results, args.cases), commands, missing
    )
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
