"""How fast an overloaded server says no, measured from a separate client process.

    python scripts/overload_latency.py [--model default] [--refusals 200] [--json out.json]

Starts `pypto serve` with `--max-num-seqs 8 --max-queued-requests 8`, fills it with 16 long
streaming requests (8 running, 8 queued), then sends `--refusals` more requests one after the
other, each of which must be refused with 503 and Retry-After, and times each refusal and a
/health probe between them, while the engine is busy with the 16. Finally checks that every
admitted request completed with all its tokens. Prints medians, p99 and max in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from pypto_serving.bench.serve import summarize_latency

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from live_server import pypto_serve

RUNNING, QUEUED, OUTPUT = 8, 8, 256


def summary(values: list[float]) -> dict[str, float]:
    """Median, p99 (as `pypto bench serve` reports them) and max, in ms."""
    latency = summarize_latency(values)
    assert latency is not None
    return {
        "median_ms": round(latency.median_ms, 1),
        "p99_ms": round(latency.p99_ms, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


async def admitted(http: httpx.AsyncClient, url: str, prompt: str) -> int:
    """A long streaming request; returns the number of content chunks it received."""
    body = {"prompt": prompt, "max_tokens": OUTPUT, "ignore_eos": True, "stream": True}
    chunks = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += bool(json.loads(line[6:]).get("choices"))
    return chunks


async def in_flight(http: httpx.AsyncClient, url: str) -> int:
    text = (await http.get(f"{url}/metrics")).text
    return int(
        sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(("pypto_num_requests_running", "pypto_num_requests_waiting"))
        )
    )


async def measure(url: str, refusals: int) -> dict[str, object]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        prompts = [f"Story {i}: once upon a time in a faraway land, " * 8 for i in range(16)]
        background = [asyncio.create_task(admitted(http, url, p)) for p in prompts]
        while await in_flight(http, url) < RUNNING + QUEUED:
            await asyncio.sleep(0.05)
        body = {"prompt": "one more, please", "max_tokens": 16}
        refused, health, statuses = [], [], []
        async with httpx.AsyncClient(timeout=30) as probe:  # its own connection
            for _ in range(refusals):
                start = time.perf_counter()
                r = await probe.post(f"{url}/v1/completions", json=body)
                refused.append(time.perf_counter() - start)
                statuses.append((r.status_code, r.headers.get("retry-after")))
                start = time.perf_counter()
                h = await probe.get(f"{url}/health")
                health.append(time.perf_counter() - start)
                assert h.status_code == 200, h.text
        busy = await in_flight(http, url)
        chunks = await asyncio.gather(*background)
    return {
        "refusals": len(refused),
        "all_503_with_retry_after": all(s == (503, "1") for s in statuses),
        "in_flight_at_the_end_of_the_probes": busy,
        "refusal": summary(refused),
        "health": summary(health),
        "admitted_completed": sum(c == OUTPUT for c in chunks),
        "admitted": len(chunks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--refusals", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    flags = ["--model", args.model, "--max-num-seqs", str(RUNNING)]
    flags += ["--max-queued-requests", str(QUEUED)]
    with pypto_serve(flags) as served:
        result = asyncio.run(measure(served.url, args.refusals))
    result["model"] = args.model
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = result["all_503_with_retry_after"] and result["admitted_completed"] == result["admitted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
