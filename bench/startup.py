#!/usr/bin/env python
"""Start-up to first token of `pypto serve`, cold and warm, timed from the process's start.

Each run starts the server as a new process, polls /health every 0.1 s, and as soon as it
answers sends one streamed chat request; it records when /health first answered and when the
first token arrived. The first run is cold: a fresh `PYPTO_CACHE_DIR` (holding only the
converted model, linked from the usual cache, so no model conversion is timed) and a fresh
`TMPDIR` (where Inductor keeps its precompiled kernel header), so nothing compiled before is
found. The runs after it are warm: the same directories again. Medians of each kind.

    python bench/startup.py --runs 3
    python bench/startup.py --serve-args "--quantization int4-w8a8 --kv-cache-dtype int8"
    python bench/startup.py --serve-args=--no-background-compile --markdown startup.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_side_by_side import (
    NAME,
    PORT,
    add_output_args,
    emit,
    model_dir,
    report_of,
    stop_server,
    wait_healthy,
)

POLL_S = 0.1


def first_token_s(start: float) -> float:
    """Seconds from `start` to the first content chunk of one streamed chat request."""
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                return time.monotonic() - start
    raise RuntimeError("the stream ended without a token")


def one_run(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, float]:
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a full pipe would stall it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(proc, timeout, POLL_S)
            healthy = time.monotonic() - start
            return {"healthy_s": healthy, "first_token_s": first_token_s(start)}
        except RuntimeError as e:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{e}; its log ends:\n{tail}") from None
        finally:
            stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="one cold run, then warm ones (>= 2)")
    p.add_argument("--serve-args", default="", help="extra `pypto serve` flags")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for /health")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.runs < 2:
        p.error("--runs must be >= 2 (one cold run, at least one warm)")
    model = model_dir()  # converted once, outside the timed runs
    cache, tmp = Path(tempfile.mkdtemp(prefix="pypto-cold-")), tempfile.mkdtemp(prefix="tmp-")
    (cache / "models").symlink_to(model.parent)
    env = {**os.environ, "PYPTO_CACHE_DIR": str(cache), "TMPDIR": tmp}
    cmd = [sys.executable, "-m", "pypto_serving.cli", "serve", "--port", str(PORT)]
    cmd += ["--served-model-name", NAME, *shlex.split(args.serve_args)]
    print(f"$ {shlex.join(cmd)}  (PYPTO_CACHE_DIR={cache} TMPDIR={tmp})", file=sys.stderr)
    runs = []
    for i in range(args.runs):
        runs.append({"kind": "cold" if i == 0 else "warm", **one_run(cmd, env, args.timeout)})
        print(f"run {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
    warm = runs[1:]
    lines = [
        "| run | /health answers (s) | first token (s) |",
        "|---|---|---|",
        *(f"| {r['kind']} | {r['healthy_s']:.1f} | {r['first_token_s']:.1f} |" for r in runs),
        "| warm median | {:.1f} | {:.1f} |".format(
            statistics.median(r["healthy_s"] for r in warm),
            statistics.median(r["first_token_s"] for r in warm),
        ),
    ]
    report = report_of({"runs": runs}, serve_command=shlex.join(cmd))
    text = "\n".join([f"`{shlex.join(cmd)}`, timed from the process's start", "", *lines, ""])
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
