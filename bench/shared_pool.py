#!/usr/bin/env python
"""A KV pool shared by data-parallel replicas (Mooncake Store) on vs off: multi-turn chats.

Starts a Mooncake master, then `pypto serve` on the default model twice, one after the other,
with two data-parallel replicas, each with the same small device KV budget and no CPU tier:
once with `--kv-remote` (every page a replica computes goes to the shared pool; a returning
conversation loads its history from there, whichever replica it lands on) and once without
(each replica keeps only what its device holds). Requests are spread round robin, as a plain
load balancer in front of a fleet would, so a conversation's turns land on either replica.
Both runs play the same `pypto bench serve --dataset multi-turn` load.

    python bench/shared_pool.py --markdown pool.md
    python bench/shared_pool.py --balance least_pending_tokens   # the router's own choice
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serve_side_by_side import add_output_args, emit, report_of
from side_by_side import markdown_report
from tiered_kv import (
    METRICS,
    add_workload_args,
    page_tokens_of_working_set,
    run,
    table,
    workload_of,
)

POOL_METRICS = (
    *(m for m in METRICS if not m[0].endswith((".cpu", ".ssd"))),
    ("cached_fraction_per_tier.remote", "… from the shared pool (%)", "{:.1%}"),
)


def start_master(port: int) -> subprocess.Popen[bytes]:
    master = Path(sys.executable).with_name("mooncake_master")
    cmd = [str(master), f"--rpc_port={port}", f"--metrics_port={port + 1}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("mooncake_master did not start")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--device-pages", type=int, default=32, help="device KV pages per replica")
    p.add_argument("--pool-bytes", default="1GiB", help="memory each replica lends the pool")
    p.add_argument("--balance", default="round_robin", help="--data-parallel-load-balance")
    p.add_argument("--master-port", type=int, default=50151)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = (
        f"--data-parallel-size 2 --data-parallel-load-balance {args.balance} "
        f"--num-kv-pages {args.device_pages} --kv-cpu-bytes 0"
    )
    pool = (
        f"--kv-remote mooncake://127.0.0.1:{args.master_port} --kv-remote-bytes {args.pool_bytes}"
    )
    os.environ.setdefault("PYPTO_POOL_SECRET", secrets.token_hex(16))  # the replicas' pool
    master = start_master(args.master_port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results: dict[str, dict[str, Any]] = {
                "on": run("on", f"{common} {pool}", args, Path(tmp)),
                "off": run("off", common, args, Path(tmp)),
            }
    finally:
        master.kill()
        master.wait()
    working_set = page_tokens_of_working_set(args)
    workload = workload_of(args) | {"replicas": 2, "load_balance": args.balance}
    report = report_of(results, workload=workload)
    about = (
        f"Two data-parallel replicas ({args.balance}), each {args.device_pages} device pages "
        f"and no CPU tier; {args.conversations} chats of {args.turns} turns "
        f"({args.input_len}-token user turns, {args.output_len}-token replies, EOS ignored, "
        f"{args.think_time:g} s think time), "
        + (f"starting at {args.request_rate:g}/s; " if args.request_rate else "all at once; ")
        + f"working set ≈ {working_set} tokens. Pool on: + a Mooncake master on this machine, "
        f"each replica lending it {args.pool_bytes}; off: each replica's device only."
    )
    commands = [r["command"] for r in results.values() if "command" in r]
    failed = {k: r for k, r in results.items() if "error" in r}
    names = ("shared pool on", "off")
    rows = table(results, POOL_METRICS, names)
    text = markdown_report("Shared KV pool on vs off", report, about, rows, commands, failed)
    emit(text, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
