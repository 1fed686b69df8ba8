#!/usr/bin/env python
"""Colocated vs disaggregated (1P1D) serving on the same cores: long prompts arriving while
short chats stream.

Two set-ups of the default model, one after the other, on the same CPUs:
- colocated: one `pypto serve` on all of them;
- 1P1D: a prefill server (`--disaggregation-mode prefill`) on the first half of the CPUs, a
  decode server on the other half, `pypto router` in front, the KV over Mooncake's Transfer
  Engine (TCP on loopback).

Each plays the same load for `--duration-s`: `--chats` closed-loop streamed chats (a fresh
prompt of 64-256 random tokens, `--chat-tokens` tokens out, EOS ignored, then the next) and,
every `--long-every-s`, one long prompt (lengths cycling through `--long-lens`, 16 tokens out).
Every prompt is fresh random tokens (no prefix hit). Reported: TTFT and inter-chunk gaps
(ITL) of the chats, p50 and p99; the long prompts' TTFT; the chats' output tok/s; and, from
the decode server's /metrics, what the handoffs cost (bytes, pages, read time per page and
per request).

    python bench/disaggregation.py --markdown disagg.md --json disagg.json
    python bench/disaggregation.py --duration-s 30 --long-lens 1024 --chats 2   # a quick look
    python bench/disaggregation.py --setups 1P1D --store   # the KV over a Mooncake Store
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_side_by_side import NAME, add_output_args, emit, model_dir, report_of, serving
from shared_pool import start_master

PORTS = {"colocated": 8765, "prefill": 8766, "decode": 8767, "router": 8768, "master": 8770}
VOCAB = (1000, 40000)
"""Random prompt tokens are drawn from here (ordinary tokens of SmolLM2's vocabulary)."""


@dataclass
class Timing:
    """One streamed request: when it was sent, its first token, the gaps between chunks."""

    kind: str
    prompt_len: int
    sent: float
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


async def stream(client: httpx.AsyncClient, url: str, timing: Timing, max_tokens: int) -> None:
    rng = random.Random(f"{timing.kind}{timing.sent}")
    prompt = [rng.randrange(*VOCAB) for _ in range(timing.prompt_len)]
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                timing.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    timing.error = str(event["error"])
                    return
                if not any(c.get("text") for c in event.get("choices", [])):
                    continue
                now = time.monotonic()
                if last is None:
                    timing.first = now
                else:
                    timing.gaps.append(now - last)
                last = now
    except httpx.HTTPError as e:
        timing.error = f"{type(e).__name__}: {e}"


async def play(url: str, args: argparse.Namespace) -> list[Timing]:
    """The load against `url` for args.duration_s; every request's timing."""
    timings: list[Timing] = []
    rng = random.Random(args.seed)
    stop_at = time.monotonic() + args.duration_s

    async def chat(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            t = Timing("chat", rng.randint(64, 256), time.monotonic())
            timings.append(t)
            await stream(client, url, t, args.chat_tokens)

    async def longs(client: httpx.AsyncClient) -> None:
        sent, i = [], 0
        while time.monotonic() < stop_at:
            t = Timing("long", args.long_lens[i % len(args.long_lens)], time.monotonic())
            timings.append(t)
            sent.append(asyncio.create_task(stream(client, url, t, 16)))
            i += 1
            await asyncio.sleep(args.long_every_s)
        await asyncio.gather(*sent)

    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        await asyncio.sleep(args.long_every_s / 2)  # chats first, then the long ones join
        chats = [asyncio.create_task(chat(client)) for _ in range(args.chats)]
        await asyncio.gather(longs(client), *chats)
    return timings


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * p99, "n": len(values)}


def summary(timings: list[Timing], duration_s: float) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None and t.first is not None]
    chats = [t for t in ok if t.kind == "chat"]
    longs = [t for t in ok if t.kind == "long"]
    out: dict[str, Any] = {
        "chat_ttft": percentiles([t.ttft for t in chats if t.ttft is not None]),
        "chat_itl": percentiles([g for t in chats for g in t.gaps]),
        "chat_output_tok_per_s": sum(1 + len(t.gaps) for t in chats) / duration_s,
        "long_ttft": percentiles([t.ttft for t in longs if t.ttft is not None]),
        "long_ttft_by_len_ms": {
            n: 1000 * statistics.median(t.ttft for t in longs if t.prompt_len == n and t.ttft)
            for n in sorted({t.prompt_len for t in longs})
        },
        "failed": [t.error for t in timings if t.error is not None],
    }
    return out


def scrape(port: int) -> dict[str, float]:
    """A server's pypto_kv_transfer_* and prompt-token samples (labels dropped)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("pypto_kv_transfer_", "pypto_prompt_tokens_total")):
            name = line.split("{")[0].split()[0]
            if 'outcome="failed"' in line:
                name += ":failed"
            elif name.endswith("_bucket"):
                continue
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def transfer_costs(d: dict[str, float]) -> dict[str, float] | None:
    pulls = d.get("pypto_kv_transfer_pulls_total", 0.0)
    pages = d.get("pypto_kv_transfer_pulled_pages_total", 0.0)
    if not pulls or not pages:
        return None
    seconds = d["pypto_kv_transfer_read_seconds_sum"]
    mb = d["pypto_kv_transfer_pulled_bytes_total"] / 1e6
    return {
        "handoffs": pulls,
        "failed": d.get("pypto_kv_transfer_pulls_total:failed", 0.0),
        "mb_per_request": mb / pulls,
        "read_ms_per_request": 1000 * seconds / pulls,
        "read_us_per_page": 1e6 * seconds / pages,
        "kb_per_page": 1000 * mb / pages,
        "read_gb_per_s": mb / 1000 / seconds if seconds else 0.0,
    }


def server(role: str, cpus: list[int], extra: list[str], store: str | None = None) -> list[str]:
    cmd = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-m", "pypto_serving.cli"]
    cmd += ["serve", "--model", str(model_dir()), "--port", str(PORTS[role])]
    cmd += ["--served-model-name", NAME, *extra]
    if role in ("prefill", "decode"):
        cmd += ["--disaggregation-mode", role, "--kv-transfer-host", "127.0.0.1"]
        cmd += ["--kv-transfer-store", store] if store else []
    return cmd


def ready(port: int, timeout_s: float = 600) -> None:
    """Wait for the server's background compilation to end, then warm it with one request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        if 'pypto_compiling{model_name="' + NAME + '"} 0.0' in text:
            break
        time.sleep(1)
    body = {"model": NAME, "prompt": "Hello there", "max_tokens": 8}
    httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)


def run_setup(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    result: dict[str, Any] = {"cpus": cpus}
    with ExitStack() as stack:
        if setup == "colocated":
            front = PORTS["colocated"]
            up = stack.enter_context(serving(server("colocated", cpus, []), {}, 900, result, front))
            if not up:
                return result
            ready(front)
        else:
            result["prefill_cpus"], result["decode_cpus"] = cpus[:half], cpus[half:] or cpus
            store = None
            if args.store:  # the handoffs through a Mooncake Store (its master on the prefill CPUs)
                master = start_master(PORTS["master"])
                stack.callback(master.kill)
                store = f"mooncake://127.0.0.1:{PORTS['master']}"
                result["store"] = store
            for role, part in (("prefill", cpus[:half]), ("decode", cpus[half:] or cpus)):
                info: dict[str, Any] = {}
                if not stack.enter_context(
                    serving(server(role, part, [], store), {}, 900, info, PORTS[role])
                ):
                    return result | {"error": f"{role}: {info.get('error')}"}
                ready(PORTS[role])
            front = PORTS["router"]
            cmd = [sys.executable, "-m", "pypto_serving.cli", "router", "--port", str(front)]
            cmd += ["--prefill", f"http://127.0.0.1:{PORTS['prefill']}"]
            cmd += ["--decode", f"http://127.0.0.1:{PORTS['decode']}"]
            if not stack.enter_context(serving(cmd, {}, 120, {}, front)):
                return result | {"error": "the router did not start"}
        before = scrape(PORTS["decode"]) if setup == "1P1D" else {}
        start = time.monotonic()
        timings = asyncio.run(play(f"http://127.0.0.1:{front}", args))
        result |= summary(timings, time.monotonic() - start)
        if setup == "1P1D":
            after = scrape(PORTS["decode"])
            delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
            result["decode_server"] = delta
            result["transfer"] = transfer_costs(delta)
    return result


def fmt(value: Any, pattern: str = "{:.0f}") -> str:
    return "–" if value is None else pattern.format(value)


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    co, dis = results.get("colocated", {}), results.get("1P1D", {})

    def pct(r: dict[str, Any], key: str, p: str) -> Any:
        return (r.get(key) or {}).get(p)

    rows = [
        ("chat TTFT p50 / p99 ms", "chat_ttft"),
        ("chat ITL p50 / p99 ms", "chat_itl"),
        ("long-prompt TTFT p50 / p99 ms", "long_ttft"),
    ]
    lines = [
        f"{args.chats} streamed chats (64-256 random tokens in, {args.chat_tokens} out) and a "
        f"long prompt every {args.long_every_s:g} s ({', '.join(map(str, args.long_lens))} "
        f"tokens, 16 out), {args.duration_s:g} s; colocated on CPUs {co.get('cpus', '–')}, "
        f"1P1D prefill on {dis.get('prefill_cpus')} and decode on {dis.get('decode_cpus')}"
        f"{', the KV through a Mooncake Store' if dis.get('store') else ''}.",
        "",
        "| | colocated | 1P1D | 1P1D / colocated |",
        "|---|---|---|---|",
    ]
    for title, key in rows:
        a = (pct(co, key, "p50_ms"), pct(co, key, "p99_ms"))
        b = (pct(dis, key, "p50_ms"), pct(dis, key, "p99_ms"))
        ratio = " / ".join(
            fmt(y / x if x and y else None, "{:.2f}×") for x, y in zip(a, b, strict=True)
        )
        cells = (
            " / ".join(fmt(v, "{:.1f}" if "ITL" in title else "{:.0f}") for v in pair)
            for pair in (a, b)
        )
        lines.append(f"| {title} | {' | '.join(cells)} | {ratio} |")
    by_len = [r.get("long_ttft_by_len_ms", {}) for r in (co, dis)]
    for n in sorted(set(by_len[0]) | set(by_len[1])):
        a, b = by_len[0].get(n), by_len[1].get(n)
        r = fmt(b / a if a and b else None, "{:.2f}×")
        lines.append(f"| TTFT of {n} tokens, median ms | {fmt(a)} | {fmt(b)} | {r} |")
    a, b = co.get("chat_output_tok_per_s"), dis.get("chat_output_tok_per_s")
    r = fmt(b / a if a and b else None, "{:.2f}×")
    lines.append(f"| chats' output tok/s | {fmt(a, '{:.1f}')} | {fmt(b, '{:.1f}')} | {r} |")
    lines.append(
        f"| failed requests | {len(co.get('failed', []))} | {len(dis.get('failed', []))} | |"
    )
    t = dis.get("transfer")
    if t:
        lines += [
            "",
            f"Handoffs read by the decode server: {t['handoffs']:.0f} ({t['failed']:.0f} "
            f"failed), {t['mb_per_request']:.1f} MB a request on average; reading it "
            f"({'a get from the Mooncake Store' if dis.get('store') else 'Transfer Engine'}) "
            f"took {t['read_ms_per_request']:.1f} ms a request, "
            f"{t['read_us_per_page']:.0f} µs a page of {t['kb_per_page']:.0f} KB "
            f"({t['read_gb_per_s']:.2f} GB/s).",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setups", default="colocated,1P1D", help="which set-ups, in this order")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--chats", type=int, default=4, help="concurrent streamed chats")
    p.add_argument("--chat-tokens", type=int, default=128, help="tokens out per chat")
    p.add_argument("--long-every-s", type=float, default=20.0)
    p.add_argument(
        "--long-lens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2048, 4096, 7680],
        help="long prompts' lengths in tokens, cycled",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--store",
        action="store_true",
        help="1P1D hands the KV over a Mooncake Store (a master started here), not peer to peer",
    )
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {s: run_setup(s, args) for s in args.setups.split(",")}
    text = markdown(results, args)
    emit(text, report_of(results, workload=vars(args) | {"json": None, "markdown": None}), args)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
