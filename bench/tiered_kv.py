#!/usr/bin/env python
"""Tiered KV on vs off: multi-turn chats whose working set is several times the device budget.

Starts `pypto serve` on the default model twice, one after the other, with the same small
device KV budget (`--num-kv-pages`): once with the CPU and SSD tiers (pages pushed out of the
device are loaded back when their conversation returns) and once without (they are dropped,
so a returning conversation recomputes its history). Both runs play the same
`pypto bench serve --dataset multi-turn` load and report TTFT of first and returning turns,
throughput, and where the cached prompt tokens came from (usage's per-tier extension).

    python bench/tiered_kv.py --markdown tiers.md
    python bench/tiered_kv.py --conversations 16 --request-rate 0 --think-time 5   # saturated
    python bench/tiered_kv.py --conversations 4 --turns 2 --think-time 1   # a quick look
    python bench/tiered_kv.py --against HEAD~1 --rounds 3   # tiers on: this code vs HEAD~1's

With `--against REV` it compares, tiers on in both, this checkout's code with git revision
REV's (its `pypto_serving` exported to a temporary folder that the server imports first),
alternating the two `--rounds` times on the same machine: medians per side.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serve_side_by_side import (
    PORT,
    add_output_args,
    emit,
    lookup,
    model_dir,
    report_of,
    server_command,
    serving,
)
from side_by_side import markdown_report, ratio

METRICS = (  # (path in the `pypto bench serve` result JSON, title, format)
    ("ttft_later_turns_median_ms", "TTFT median, returning turns (ms)", "{:.0f}"),
    ("ttft_first_turn_median_ms", "TTFT median, first turns (ms)", "{:.0f}"),
    ("ttft.median_ms", "TTFT median, all (ms)", "{:.0f}"),
    ("ttft.p99_ms", "TTFT p99, all (ms)", "{:.0f}"),
    ("output_tok_per_s", "output tok/s", "{:.1f}"),
    ("duration_s", "duration (s)", "{:.1f}"),
    ("cached_prompt_fraction", "prompt tokens cached (%)", "{:.1%}"),
    ("cached_fraction_per_tier.device", "… from device (%)", "{:.1%}"),
    ("cached_fraction_per_tier.cpu", "… from cpu (%)", "{:.1%}"),
    ("cached_fraction_per_tier.ssd", "… from ssd (%)", "{:.1%}"),
    ("failed", "failed requests", "{:.0f}"),
)


def page_tokens_of_working_set(args: argparse.Namespace) -> int:
    """Prompt tokens of every conversation's last turn (template tokens not counted)."""
    last = (args.turns - 1) * (args.input_len + args.output_len) + args.input_len
    return args.conversations * last


def workload_of(args: argparse.Namespace) -> dict[str, Any]:
    """The chats' shape, for the report."""
    return {
        "conversations": args.conversations,
        "turns": args.turns,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "working_set_tokens": page_tokens_of_working_set(args),
        "device_tokens": args.device_pages * 64,
    }


def bench(args: argparse.Namespace, out: Path | None, conversations: int, turns: int) -> Any:
    cmd = [sys.executable, "-m", "pypto_serving.cli", "bench", "serve"]
    cmd += ["--base-url", f"http://127.0.0.1:{PORT}", "--dataset", "multi-turn"]
    cmd += ["--num-conversations", str(conversations), "--turns", str(turns)]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--think-time", str(args.think_time), "--ignore-eos", "--seed", str(args.seed)]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    if args.request_rate:
        cmd += ["--request-rate", str(args.request_rate)]
    cmd += ["--result-json", str(out)] if out else []
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, stdout=sys.stderr, check=True, timeout=3600)
    return json.loads(out.read_text()) if out else None


def run(
    name: str, flags: str, args: argparse.Namespace, tmp: Path, code: Path | None = None
) -> dict[str, Any]:
    """One server (this checkout's code, or the package exported to `code`) under the chats."""
    cmd, env = server_command("ours", model_dir(), flags)
    if code is not None:
        env = {**env, "PYTHONPATH": str(code)}
    result: dict[str, Any] = {}
    with serving(cmd, env, args.startup_timeout, result) as started:
        if not started:
            return result
        warmup = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000})
        bench(warmup, None, 2, 1)  # other conversations, untimed
        result["run"] = bench(args, tmp / f"{name}.json", args.conversations, args.turns)
    return result


def table(
    results: dict[str, dict[str, Any]],
    metrics: tuple[tuple[str, str, str], ...] = METRICS,
    names: tuple[str, str] = ("tiers on", "tiers off"),
    keys: tuple[str, str] = ("on", "off"),
    ratio_title: str = "off / on",
) -> list[str]:
    """Markdown rows of results[keys[0]] and results[keys[1]] side by side (named `names`),
    and for times the second's over the first's."""
    lines = [f"| metric | {names[0]} | {names[1]} | {ratio_title} |", "|---|---|---|---|"]
    for key, title, fmt in metrics:
        on, off = (lookup(results[k].get("run"), key) for k in keys)
        cells = [fmt.format(v) if v is not None else "—" for v in (on, off)]
        r = ratio(off, on) if "ms" in title else None
        lines.append(f"| {title} | {' | '.join(cells)} | {f'{r:.2f}×' if r else ''} |")
    return lines


def export(rev: str, into: Path) -> Path:
    """`pypto_serving` as git revision `rev` has it, in `into` (a folder to put first on
    PYTHONPATH)."""
    repo = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", rev, "pypto_serving"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric, the median over the runs that have it (a run's result shape)."""
    merged: dict[str, Any] = {}
    for key, _, _ in METRICS:
        values = [v for r in runs if (v := lookup(r.get("run"), key)) is not None]
        if values:
            node = merged
            *path, last = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = statistics.median(values)
    return {"run": merged, "rounds": len(runs)}


def against(args: argparse.Namespace, tiers_on: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """Tiers on, `args.against`'s code and this checkout's, alternating `args.rounds` times."""
    code = export(args.against, tmp / "before")
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for i in range(args.rounds):  # each run its own SSD folder: none finds another's pages
        for side in runs:
            flags = tiers_on.format(ssd=tmp / f"ssd-{side}{i}")
            runs[side].append(
                run(f"{side}{i}", flags, args, tmp, code if side == "before" else None)
            )
    return {side: {**medians(rs), "runs": rs} for side, rs in runs.items()}


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The multi-turn chats' options (what `bench` plays)."""
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--input-len", type=int, default=128, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--think-time", type=float, default=20.0, help="s before each later turn")
    p.add_argument("--max-concurrency", type=int, default=0, help="conversations at once")
    p.add_argument(
        "--request-rate", type=float, default=0.25, help="conversations per s (0: all at once)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--device-pages", type=int, default=32, help="device KV pages (64 tokens)")
    p.add_argument("--cpu-pages", type=int, default=32, help="CPU tier pages (tiers on)")
    p.add_argument("--ssd-bytes", default="4GiB", help="SSD tier budget (tiers on)")
    p.add_argument("--against", metavar="REV", help="tiers on: this code vs git revision REV's")
    p.add_argument("--rounds", type=int, default=1, help="with --against: runs of each side")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    page_bytes = 2 * 30 * 64 * 3 * 64 * 2  # SmolLM2-135M in bf16: K and V, 30 layers, 3 x 64
    device = f"--num-kv-pages {args.device_pages}"
    with tempfile.TemporaryDirectory() as tmp:
        tiers_on = (
            f"{device} --kv-cpu-bytes {args.cpu_pages * page_bytes} "
            f"--kv-ssd-dir {{ssd}} --kv-ssd-bytes {args.ssd_bytes}"
        )
        if args.against:
            results = against(args, tiers_on, Path(tmp))
        else:
            results = {
                "on": run("on", tiers_on.format(ssd=Path(tmp) / "ssd"), args, Path(tmp)),
                "off": run("off", f"{device} --kv-cpu-bytes 0", args, Path(tmp)),
            }
    working_set = page_tokens_of_working_set(args)
    report = report_of(results, workload=workload_of(args))
    about = (
        f"{args.conversations} chats of {args.turns} turns ({args.input_len}-token user "
        f"turns, {args.output_len}-token replies, EOS ignored, {args.think_time:g} s think "
        "time before each later turn), "
        + (
            f"starting at {args.request_rate:g}/s (Poisson); "
            if args.request_rate
            else "all starting at once; "
        )
        + (f"at most {args.max_concurrency} at once; " if args.max_concurrency else "")
        + f"working set ≈ {working_set} tokens = "
        f"{working_set / (args.device_pages * 64):.1f}× the device budget of "
        f"{args.device_pages} pages. Tiers on: + {args.cpu_pages} CPU pages + SSD "
        f"{args.ssd_bytes}; off: device only (prefix caching on in both)."
    )
    if args.against:
        about += (
            f" Both sides tiers on; {args.rounds} alternating rounds, medians: before = "
            f"`{args.against}`'s code, after = this checkout's."
        )
        runs = [r for side in results.values() for r in side["runs"]]
        commands = sorted({r["command"] for r in runs if "command" in r})
        failed = {f"run {i}": r for i, r in enumerate(runs) if "error" in r}
        names = ("after", f"before ({args.against})")
        lines = table(results, names=names, keys=("after", "before"), ratio_title="before / after")
        text = markdown_report("Tiered KV, before vs after", report, about, lines, commands, failed)
    else:
        commands = [r["command"] for r in results.values() if "command" in r]
        failed = {k: r for k, r in results.items() if "error" in r}
        lines = table(results)
        text = markdown_report("Tiered KV on vs off", report, about, lines, commands, failed)
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
