#!/usr/bin/env python
"""What a native decode step costs by its number of rows, this tree's kernels against another
revision's, in one process.

A step of R rows of one sequence (speculative decoding's verify rows; `--sequences` for R
separate sequences) at a context of `--context` tokens runs through the native decode step
(native/decode.cpp) of each build in turn, so both see the same machine: the medians of
`--iters` rounds of three calls each, the builds' order alternating round by round, and
with `--against` the median of the rounds' ratios. `--against REV` builds the kernels of a git
revision (its native/ sources) beside this tree's; without it only this tree's run.

    python bench/native_rows.py --rows 1,2,4,8,32 --against HEAD~1
    python bench/native_rows.py --model ~/.cache/pypto-serving/shapes/llama-1b/model-Q4_1.gguf
    PYPTO_CPU_ISA=avx2 python bench/native_rows.py --quantization none --against HEAD~1
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
NATIVE = "pypto_serving/native"


def checkout(rev: str, into: Path) -> Path:
    """The native/ sources of git revision `rev` (its .cpp and .h files), written into `into`."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", rev, f"{NATIVE}/"],
        capture_output=True,
        text=True,
    )
    if listed.returncode:
        raise SystemExit(f"--against {rev}: {listed.stderr.strip() or 'git ls-tree failed'}")
    for path in listed.stdout.split():
        if not path.endswith((".cpp", ".h")):
            continue
        shown = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True
        )
        if shown.returncode:
            raise SystemExit(f"--against {rev}: {shown.stderr.strip() or 'git show failed'}")
        (into / Path(path).name).write_text(shown.stdout)
    return into


def library(sources: Path, tag: str, group: int, head_dim: int, out: Path) -> ctypes.CDLL:
    """The decode step's library built from `sources` (the tag names it)."""
    from pypto_serving import native

    path = native.build(group, head_dim, out / tag, source_dir=sources)
    if path is None:
        raise SystemExit(f"the {tag} kernels did not build (see the log above)")
    lib = ctypes.CDLL(str(path))
    lib.pypto_decode_step.restype = ctypes.c_int
    lib.pypto_decode_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", help="the default model, a directory or a GGUF")
    p.add_argument("--quantization", default="auto", help="none: a GGUF's weights in bf16")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--sequences", action="store_true", help="each row its own sequence")
    p.add_argument("--against", help="a git revision whose kernels run beside this tree's")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes row counts separated by commas, got {args.rows!r}")
    if not all(0 < r <= 256 for r in rows_list):
        p.error("each of --rows must be 1 to 256 (the native step's rows)")

    from pypto_serving import LLM
    from pypto_serving.executor.native_decode import NativeDecoder
    from pypto_serving.executor.paged import PagedExecutor
    from pypto_serving.kv.paged_attention import StepBatch

    llm = LLM(model=args.model, quantization=args.quantization)
    executor = llm.engine.executor
    if not isinstance(executor, PagedExecutor) or executor.native is None:
        raise SystemExit(f"{args.model}: the native decode step does not run this model")
    cfg, cache = executor.model.cfg, executor.kv.pool.cache
    (group,) = executor.kv.managers  # the native step's models have one KV group
    page, heads = executor.kv.page_size, cfg.num_heads // cfg.num_kv_heads
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": REPO / NATIVE}
        if args.against:
            trees[args.against] = checkout(args.against, Path(tmp))
        steps = {}
        for i, (name, sources) in enumerate(trees.items()):
            lib = library(sources, f"v{i}", heads, cfg.head_dim, Path(tmp) / "libs")
            steps[name] = NativeDecoder(executor.model, cache, lib)
            steps[name].team.threads = lambda: torch.get_num_threads()  # type: ignore[method-assign]

        def once(step: NativeDecoder, rows: int) -> float:
            """One step of `rows` decode rows, slots and tables mapped by the attention
            operator as the executor has it map them."""
            seqs = rows if args.sequences else 1
            per = -(-(args.context + rows) // page)  # pages a sequence spans
            pages = [list(range(s * per, (s + 1) * per)) for s in range(seqs)]
            positions = args.context + torch.arange(rows) // seqs
            batch = StepBatch(
                {group.name: [pages[r % seqs] for r in range(rows)]},
                positions,
                torch.ones(rows, dtype=torch.int64),
                positions + 1,
                rows,
                1,
                executor.attention_kernel,
            )
            attention = executor.model.attention_kind.step(executor.kv, cfg, batch)
            tokens = torch.randint(100, 1000, (rows,), dtype=torch.int64)
            start = time.perf_counter()
            step.logits(
                tokens, positions, attention.slot_mapping, attention.block_table, positions + 1
            )
            return time.perf_counter() - start

        times: dict[tuple[str, int], list[float]] = {(n, r): [] for n in steps for r in rows_list}
        ratios: dict[int, list[float]] = {r: [] for r in rows_list}
        names = list(steps)
        for round_ in range(args.iters):
            for rows in rows_list:
                # the builds' order alternates round by round: whichever runs first in a
                # round was seen up to 4 % faster or slower with the same kernels
                medians = {}
                for name in names if round_ % 2 else names[::-1]:
                    calls = [once(steps[name], rows) for _ in range(3)]
                    times[(name, rows)] += calls
                    medians[name] = statistics.median(calls)
                if len(names) == 2:
                    ratios[rows].append(medians[names[0]] / medians[names[1]])
    result = {f"{name} {rows}": 1000 * statistics.median(t) for (name, rows), t in times.items()}
    print(f"native step ms by rows ({args.model}, context {args.context}):")
    for rows in rows_list:
        cells = "  ".join(f"{n}: {result[f'{n} {rows}']:.2f}" for n in steps)
        if ratios[rows]:
            result[f"ratio {rows}"] = statistics.median(ratios[rows])
            cells += f"  (this / {names[1]}, median of the rounds: {result[f'ratio {rows}']:.3f})"
        print(f"  {rows:>3} rows  {cells}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
