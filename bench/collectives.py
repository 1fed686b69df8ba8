#!/usr/bin/env python
"""The latency of one collective between 2 ranks of this machine: shared memory vs gloo.

Starts two processes (each pinned to its own core, one thread, as TP=2 runs its ranks) twice:
once with the transport `init_distributed` chooses (shared memory on one machine) and once
with PYPTO_TP_COLLECTIVES=gloo. Each times the calls the model makes (`tp_all_reduce`, the
custom op, and `tp_all_gather`), the all-reduce without the op's dispatch (the transport's
own call, as the native decode step makes it from C++, but through ctypes) and the step
broadcast's header: `--calls` calls after a warm-up, `--rounds` times; the table shows rank
0's median microseconds per call.

    python bench/collectives.py --markdown collectives.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serve_side_by_side import add_output_args, emit, report_of

ROOT = Path(__file__).resolve().parents[1]
CASES = (  # (name, op, shape, dtype)
    ("all-reduce [1, 576] fp32", "all_reduce", (1, 576), "float32"),
    ("all-reduce [1, 576] fp32, no custom op", "raw_all_reduce", (1, 576), "float32"),
    ("all-reduce [64, 576] fp32", "all_reduce", (64, 576), "float32"),
    ("all-reduce [1, 24576] fp32", "all_reduce", (1, 24576), "float32"),
    ("all-gather [1, 24576] fp32 (logits)", "all_gather", (1, 24576), "float32"),
    ("broadcast [8] int64 (step header)", "broadcast", (8,), "int64"),
)


def rank_main(rank: int, store: str, calls: int, rounds: int) -> None:
    """One rank: join, time every case, print rank 0's figures as one JSON line."""
    import torch

    from pypto_serving import distributed as d

    os.sched_setaffinity(0, {rank % os.cpu_count()})  # type: ignore[operator]
    torch.set_num_threads(1)
    d.use_rendezvous(store)
    d.init_distributed(rank, 2, "gloo", 120.0)
    shm = d.shm_group()

    def raw_all_reduce(x: torch.Tensor) -> object:
        return shm.all_reduce(x) if shm is not None else torch.distributed.all_reduce(x)

    ops: dict[str, Callable[[Any], Any]] = {
        "all_reduce": d.tp_all_reduce,
        "raw_all_reduce": raw_all_reduce,
        "all_gather": d.tp_all_gather,
        "broadcast": d._broadcast,
    }
    figures = {"transport": d.collectives_transport()}
    for name, op, shape, dtype in CASES:
        x, fn = torch.ones(shape, dtype=getattr(torch, dtype)), ops[op]
        for _ in range(max(calls // 10, 10)):
            fn(x)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            times.append((time.perf_counter() - start) / calls * 1e6)
        figures[name] = statistics.median(times)
    if rank == 0:
        print(json.dumps(figures), flush=True)
    sys.stdout.flush()
    os._exit(0)


def measure(transport: str, calls: int, rounds: int) -> dict[str, Any]:
    """Both ranks with PYPTO_TP_COLLECTIVES=transport; rank 0's figures."""
    env = os.environ | {"PYPTO_TP_COLLECTIVES": transport, "GLOO_SOCKET_IFNAME": "lo"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, __file__, "--calls", str(calls), "--rounds", str(rounds)]
        argv += ["--store", str(Path(tmp) / "store")]
        procs = [
            subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
            for r in range(2)
        ]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    add_output_args(p)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.store, args.calls, args.rounds)
    results = {t: measure(t, args.calls, args.rounds) for t in ("auto", "gloo")}
    shm, gloo = results["auto"], results["gloo"]
    lines = [
        f"| µs per call (median of {args.rounds} × {args.calls}) | {shm['transport']} | gloo "
        "| gloo / shm |",
        "|---|---|---|---|",
    ]
    for name, *_ in CASES:
        lines.append(
            f"| {name} | {shm[name]:.1f} | {gloo[name]:.1f} | {gloo[name] / shm[name]:.0f}× |"
        )
    text = "\n".join(lines) + "\n"
    emit(text, report_of(results), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
