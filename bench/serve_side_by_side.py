#!/usr/bin/env python
"""Serving side by side: `pypto serve` and `vllm serve` under the same `pypto bench serve` load.

Each server is started in turn (never two at once) on the same model directory (the default
model's converted HF directory), waited for until /health answers, warmed with a few untimed
requests, then measured with the issue's workload: random 256-token prompts → 128 tokens,
EOS ignored, at concurrency 1 (8 prompts) and 16 (64 prompts). The same client measures both.
Prints absolute figures and ratios to us; `--json` / `--markdown` keep them.

    python bench/serve_side_by_side.py --markdown serve.md
    python bench/serve_side_by_side.py --engines ours --cases 1:4 --output-len 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from side_by_side import PEERS, VLLM_ENV, machine, markdown_report, ratio

PORT = 8765
NAME = "SmolLM2-135M-Instruct"
METRICS = (  # (path in the `pypto bench serve` result JSON, title, format)
    ("output_tok_per_s", "output tok/s", "{:.1f}"),
    ("ttft.median_ms", "TTFT median ms", "{:.0f}"),
    ("ttft.p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot.median_ms", "TPOT median ms", "{:.1f}"),
    ("itl.median_ms", "ITL median ms", "{:.1f}"),
    ("e2e.median_ms", "E2E median ms", "{:.0f}"),
    ("failed", "failed requests", "{:.0f}"),
)


def lookup(result: dict[str, Any] | None, path: str) -> float | None:
    value: Any = result
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def model_dir() -> Path:
    from pypto_serving.models.default_model import resolve_model_path

    return resolve_model_path("default")


def server_command(engine: str, model: Path, extra: str) -> tuple[list[str], dict[str, str]]:
    if engine == "ours":
        cmd = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
        return [*cmd, "--port", str(PORT), "--served-model-name", NAME, *shlex.split(extra)], {}
    vllm = PEERS / "vllm" / "bin" / "vllm"
    cmd = [str(vllm), "serve", str(model), "--port", str(PORT), "--served-model-name", NAME]
    return [*cmd, "--dtype", "bfloat16", *shlex.split(extra)], VLLM_ENV


def wait_healthy(
    proc: subprocess.Popen[bytes], timeout: float, poll: float = 1.0, port: int = PORT
) -> float:
    """Seconds until the server's /health answers, asked every `poll` seconds."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(poll)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (the server drains and exits), then a kill after a minute."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(args: argparse.Namespace, concurrency: int, prompts: int, out: Path | None) -> Any:
    cmd = [sys.executable, "-m", "pypto_serving.cli", "bench", "serve"]
    cmd += ["--base-url", f"http://127.0.0.1:{PORT}", "--dataset", "random"]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency)]
    cmd += ["--ignore-eos", "--seed", str(args.seed + concurrency)]
    cmd += ["--result-json", str(out)] if out else []
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, stdout=sys.stderr, check=True, timeout=3600)
    return json.loads(out.read_text()) if out else None


@contextmanager
def serving(
    cmd: list[str], env: dict[str, str], timeout: float, result: dict[str, Any], port: int = PORT
) -> Iterator[bool]:
    """Run a server (listening on `port`) until the block ends (SIGINT, then kill). Yields
    whether it started: if not, the block should measure nothing. `result` gets its command,
    its start-up time, or the error that stopped it (at start-up or in the block)."""
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=sys.stderr)
    result["command"] = shlex.join(cmd)
    try:
        started = False
        try:
            result["startup_s"] = wait_healthy(proc, timeout, port=port)
            started = True
        except RuntimeError as e:
            result["error"] = str(e)
        try:
            yield started
        except (RuntimeError, subprocess.SubprocessError) as e:
            result["error"] = str(e)
    finally:
        stop_server(proc)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """--json and --markdown, as every serving bench script takes them."""
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--markdown", type=Path, help="write the table and commands to this file")


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'1:8,16:64' -> [(1, 8), (16, 64)]: (concurrency, prompts) pairs."""
    return [(int(c), int(n)) for c, n in (case.split(":") for case in text.split(","))]


def report_of(results: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The JSON report of a bench script: date, machine, its command line, then `extra`."""
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": shlex.join([sys.executable, *sys.argv]),
        **extra,
        "results": results,
    }


def emit(text: str, report: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the Markdown report; keep it and the figures where --markdown / --json say."""
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)


def run_engine(engine: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    if engine == "vllm" and not (PEERS / "vllm" / "bin" / "vllm").exists():
        return {"skipped": "not installed (../shared/peers/install_vllm_cpu.sh)"}
    cmd, env = server_command(engine, model_dir(), args.ours_args if engine == "ours" else "")
    result: dict[str, Any] = {}
    with serving(cmd, env, args.startup_timeout, result) as started:
        if not started:
            return result
        bench(args, 4, 4, None)  # warm-up, untimed
        for concurrency, prompts in args.cases:
            out = tmp / f"{engine}_c{concurrency}.json"
            result[f"c{concurrency}"] = bench(args, concurrency, prompts, out)
    return result


def table(results: dict[str, dict[str, Any]], cases: list[tuple[int, int]]) -> list[str]:
    engines = [e for e in results if any(f"c{c}" in results[e] for c, _ in cases)]
    others = [e for e in engines if e != "ours"]
    head = ["case", "metric", *engines, *(f"ours/{e}" for e in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, n in cases:
        for key, title, fmt in METRICS:
            vals = {e: lookup(results[e].get(f"c{c}"), key) for e in engines}
            cells = [fmt.format(v) if v is not None else "—" for v in vals.values()]
            ratios = [ratio(vals.get("ours"), vals[e]) for e in others]
            cells += [f"{r:.2f}×" if r is not None else "—" for r in ratios]
            lines.append(f"| c={c} ({n} prompts) | {title} | " + " | ".join(cells) + " |")
    starts = [f"{results[e].get('startup_s', 0):.0f}" for e in engines]
    lines.append("| — | start-up to healthy s | " + " | ".join(starts) + " |" + " |" * len(others))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="ours,vllm", help="of ours, vllm")
    p.add_argument("--cases", default="1:8,16:64", help="concurrency:prompts, comma-separated")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--ours-args", default="", help="extra flags for pypto serve")
    add_output_args(p)
    args = p.parse_args(argv)
    args.cases = parse_cases(args.cases)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {e: run_engine(e, args, Path(tmp)) for e in args.engines.split(",")}
    workload = {"input_len": args.input_len, "output_len": args.output_len}
    report = report_of(results, workload=workload)
    about = (
        f"Random {args.input_len}-token prompts → {args.output_len} tokens, EOS ignored, "
        "greedy, streamed; the same `pypto bench serve` client for every server."
    )
    commands = [r["command"] for r in results.values() if "command" in r]
    missing = {e: r for e, r in results.items() if "skipped" in r or "error" in r}
    text = markdown_report(
        "Serving side by side", report, about, table(results, args.cases), commands, missing
    )
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
