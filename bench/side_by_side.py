#!/usr/bin/env python
"""Side by side: our engine, HF transformers, vLLM-CPU and llama.cpp on the same workloads.

W1: the prompts of ../shared/bench/w1_prompts.jsonl, 128 output tokens each, greedy, EOS
ignored, timed as one offline run. Single stream: one request of 256 greedy tokens (EOS
ignored) on random token ids, reporting decode tok/s and time to first token.

Every engine runs in its own subprocess, one after another (never two at once), and reports
JSON. Peers run with their own interpreters (~/.cache/peers/<name>/bin/python) and are skipped
with a note when not installed. This file is also the worker those subprocesses run
(`--worker NAME`), so at module level it imports the standard library only.

    python bench/side_by_side.py --json side.json --markdown side.md
    python bench/side_by_side.py --engines ours,hf --num-prompts 2 --output-len 4 --single-len 8
    python bench/side_by_side.py --shape llama-1b --gguf-type Q4_1 --engines ours,vllm,llamacpp
    python bench/side_by_side.py --model /path/to/model.gguf --engines ours,llamacpp

`--shape` takes a random-weight checkpoint at a published shape (bench/real_shapes.py: written
once, cached): its Hugging Face directory for vLLM and HF transformers, its GGUF file of
`--gguf-type` for llama.cpp and for us (the very same file; llama shapes). `--model` takes a
model directory or a GGUF file instead of the default model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_W1 = REPO.parent / "shared" / "bench" / "w1_prompts.jsonl"
PEERS = Path.home() / ".cache" / "peers"
PEER_MODULES = {"vllm": "vllm", "llamacpp": "llama_cpp"}
HF_DTYPES = {"hf": "float32", "hf-bf16": "bfloat16"}
ENGINES = ("ours", *HF_DTYPES, *PEER_MODULES)
PROBE = "import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
WORKLOAD = ("num_prompts", "output_len", "batch_size", "single_len", "single_input_len")
WORKLOAD += ("single_iters", "seed", "ttft_lens")
METRICS = (  # (key, column title, format)
    ("w1_output_tok_per_s", "W1 output tok/s", "{:.1f}"),
    ("w1_total_tok_per_s", "W1 total tok/s", "{:.1f}"),
    ("single_decode_tok_per_s", "single-stream decode tok/s", "{:.1f}"),
    ("single_ttft_ms", "single-stream TTFT ms", "{:.0f}"),
    ("startup_s", "start-up s", "{:.1f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
)


# ---- measurements shared by every worker (standard library only) ----


def tree_peak_rss_mib() -> float:
    """Peak RSS of this process plus its live descendants (vLLM's engine core is a child)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        todo += parents.get(pid, [])
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        total += next((int(s.split()[1]) for s in status if s.startswith("VmHWM:")), 0)
    return total / 1024


def w1_figures(prompt_tokens: int, output_tokens: int, elapsed: float, n: int) -> dict[str, Any]:
    return {
        "num_prompts": n,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def single_figures(runs: list[tuple[float, float, int]], method: str) -> dict[str, Any]:
    """Medians over (ttft_s, decode_s, output_tokens) runs."""
    import statistics

    return {
        "ttft_ms": statistics.median(t * 1000 for t, _, _ in runs),
        "decode_tok_per_s": statistics.median((n - 1) / d for _, d, n in runs),
        "output_tokens": runs[0][2],
        "method": method,
    }


def engine_result(
    version: str,
    dtype: str,
    threads: int | None,
    startup: float,
    w1: dict[str, Any],
    single: dict[str, Any],
) -> dict[str, Any]:
    return {
        "version": version,
        "dtype": dtype,
        "threads": threads,
        "startup_s": startup,
        "w1": w1,
        "single": single,
    }


# ---- workers: each runs in its own process ----


class _Clock:
    """A transformers streamer that only notes when each put() happens (first: the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_worker(spec: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).eval()
    startup = time.perf_counter() - start
    tok.pad_token = tok.pad_token or tok.eos_token

    def generate(batch: dict[str, Any], n: int, streamer: Any = None) -> Any:
        kw = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "streamer": streamer}
        return model.generate(**batch, **kw, pad_token_id=tok.pad_token_id)

    def ids_batch(ids: list[int]) -> dict[str, Any]:
        t = torch.tensor([ids])
        return {"input_ids": t, "attention_mask": torch.ones_like(t)}

    generate(ids_batch(spec["warmup_ids"]), 4)
    prompts, size, n = spec["w1"], spec["batch_size"], spec["output_len"]
    prompt_tokens = output_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        batch = tok(prompts[i : i + size], return_tensors="pt", padding=True)
        out = generate(batch, n)
        prompt_tokens += int(batch["attention_mask"].sum())
        output_tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    w1 = w1_figures(prompt_tokens, output_tokens, time.perf_counter() - start, len(prompts))
    runs = []
    for ids in spec["single_prompts"]:
        clock, start = _Clock(), time.perf_counter()
        out = generate(ids_batch(ids), spec["single_len"], clock)
        ttft, end = clock.times[1] - start, time.perf_counter()
        runs.append((ttft, end - clock.times[1], out.shape[1] - len(ids)))
    single = single_figures(runs, "streamer: time of the first new token")
    version = f"transformers {transformers.__version__}"
    return engine_result(version, dtype_name, torch.get_num_threads(), startup, w1, single)


def vllm_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams

    def params(n: int) -> Any:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def timed(prompts: list[Any], n: int) -> tuple[float, list[Any]]:
        start = time.perf_counter()
        outs = llm.generate(prompts, params(n), use_tqdm=False)
        return time.perf_counter() - start, outs

    start = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["vllm_dtype"])
    startup = time.perf_counter() - start
    timed([{"prompt_token_ids": spec["warmup_ids"]}], 4)
    elapsed, outs = timed(spec["w1"], spec["output_len"])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    w1 = w1_figures(prompt_tokens, output_tokens, elapsed, len(outs))
    runs = []
    for ids, alt in zip(spec["single_prompts"], spec["alt_prompts"], strict=True):
        ttft, _ = timed([{"prompt_token_ids": alt}], 1)  # another prompt: no prefix-cache hit
        total, outs = timed([{"prompt_token_ids": ids}], spec["single_len"])
        runs.append((ttft, total - ttft, len(outs[0].outputs[0].token_ids)))
    single = single_figures(runs, "TTFT = a max_tokens=1 run; decode = (N-1)/(t_N - TTFT)")
    ttft_at = {
        n: 1000 * timed([{"prompt_token_ids": ids}], 1)[0]
        for n, ids in spec["ttft_prompts"].items()
    }
    threads = int(os.environ.get("VLLM_CPU_OMP_THREADS", 0)) or None  # bound by vLLM itself
    version = f"vllm {vllm.__version__}"
    result = engine_result(version, spec["vllm_dtype"], threads, startup, w1, single)
    return result | {"ttft_at_ms": ttft_at}


def llamacpp_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    threads = len(os.sched_getaffinity(0))
    start = time.perf_counter()
    longest = max((len(ids) for ids in spec["ttft_prompts"].values()), default=0)
    context = max(2048, longest + 64)
    llm = llama_cpp.Llama(spec["gguf"], n_ctx=context, n_threads=threads, verbose=False)
    startup = time.perf_counter() - start

    def stream(ids: list[int], n: int) -> tuple[float, float, int]:
        """Greedy tokens until n: generate() never stops at EOS itself (EOS is ignored)."""
        start, first, count = time.perf_counter(), 0.0, 0
        for _ in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            count += 1
            first = first or time.perf_counter()
            if count == n:
                break
        return first - start, time.perf_counter() - first, count

    stream(spec["warmup_ids"], 4)
    n, prompt_tokens, output_tokens = spec["output_len"], 0, 0
    start = time.perf_counter()
    for text in spec["w1"]:
        ids = llm.tokenize(text.encode("utf-8"))
        prompt_tokens += len(ids)
        output_tokens += stream(ids, n)[2]
    w1 = w1_figures(prompt_tokens, output_tokens, time.perf_counter() - start, len(spec["w1"]))
    runs = [stream(ids, spec["single_len"]) for ids in spec["single_prompts"]]
    single = single_figures(runs, "generate() stream: time of the first token")
    ttft_at = {n: 1000 * stream(ids, 1)[0] for n, ids in spec["ttft_prompts"].items()}
    version = f"llama-cpp-python {llama_cpp.__version__}"
    result = engine_result(version, "GGUF", threads, startup, w1, single)
    return result | {"ttft_at_ms": ttft_at}


def run_worker(name: str, spec_path: Path, out_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    if name in HF_DTYPES:
        result = hf_worker(spec, HF_DTYPES[name])
    else:
        result = {"vllm": vllm_worker, "llamacpp": llamacpp_worker}[name](spec)
    result["peak_rss_mib"] = tree_peak_rss_mib()
    out_path.write_text(json.dumps(result, indent=2))


# ---- the parent: one engine after another ----


def model_label(args: argparse.Namespace) -> str | None:
    """What the tables say the model is (None: the default model)."""
    if args.shape:
        return f"random weights at the {args.shape} shape (bench/real_shapes.py), {args.gguf_type}"
    return None if args.model is None else str(args.model)


def model_files(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """The model's HF directory and GGUF file (None: none) as --shape, --model or the default
    say; the HF directory of a GGUF-only --model is its conversion (what we serve). A GGUF
    file is converted here, once, so that no measured run of ours includes the conversion
    (its time and its memory: 4.5 GiB at the 1B shape)."""
    from pypto_serving.models.default_model import find_default_gguf, resolve_model_path

    if args.shape:
        sys.path.insert(0, str(Path(__file__).parent))
        from real_shapes import checkpoint

        model_dir, gguf_file = checkpoint(args.shape, args.gguf_type)
        if gguf_file is not None:
            resolve_model_path(str(gguf_file))  # ours serves the GGUF: its conversion, kept
        return model_dir, gguf_file
    if args.model is not None:
        if args.model.suffix == ".gguf":
            return resolve_model_path(str(args.model)), args.model
        return args.model, None
    return resolve_model_path("default"), find_default_gguf()


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the workers need: model paths, W1 prompts, the single-stream token ids."""
    from transformers import AutoTokenizer

    from pypto_serving.bench.datasets import file_prompts, random_prompts, sampling_vocab

    model_dir, gguf_file = args.files
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    vocab = sampling_vocab(tokenizer, vocab_size)
    n, seed = args.single_input_len, args.seed

    def prompts(offset: int) -> list[list[int]]:
        # iteration i of `pypto bench latency --seed S` uses seed S + i: the same ids
        return [random_prompts(vocab, 1, n, seed + offset + i)[0] for i in range(args.single_iters)]

    return {
        "model_dir": str(model_dir),
        "gguf": None if gguf_file is None else str(gguf_file),
        "w1": file_prompts(args.w1, args.num_prompts),
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "single_len": args.single_len,
        "single_prompts": prompts(0),
        "alt_prompts": prompts(7919),
        "warmup_ids": random_prompts(vocab, 1, n, seed + 1_000_003)[0],
        "ttft_prompts": {  # one fresh prompt per length (no prefix-cache hit)
            str(k): random_prompts(vocab, 1, k, seed + 2_000_003 + k)[0] for k in args.ttft_lens
        },
        "vllm_dtype": args.vllm_dtype,
    }


def run_command(cmd: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run one engine; its output goes to stderr. Returns an error note, or None."""
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, stdout=sys.stderr, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    return f"exit code {proc.returncode}" if proc.returncode else None


def ours_commands(args: argparse.Namespace, tmp: Path) -> list[list[str]]:
    cli = [sys.executable, "-m", "pypto_serving.cli", "bench"]
    extra = shlex.split(args.ours_args)
    if args.shape or args.model is not None:  # the GGUF where there is one: llama.cpp's file
        model_dir, gguf_file = args.files
        extra = ["--model", str(gguf_file or model_dir), *extra]
    offline = ["offline", "--prompts-file", str(args.w1), "--num-prompts", str(args.num_prompts)]
    offline += ["--output-len", str(args.output_len), "--json", str(tmp / "ours_offline.json")]
    latency = ["latency", "--input-len", str(args.single_input_len), "--seed", str(args.seed)]
    latency += ["--output-len", str(args.single_len), "--iters", str(args.single_iters)]
    latency += ["--json", str(tmp / "ours_latency.json")]
    ttfts = []
    for n in args.ttft_lens:  # one prompt of each length alone: its TTFT
        ttft = ["latency", "--input-len", str(n), "--seed", str(args.seed + 2_000_003 + n)]
        ttft += ["--output-len", "2", "--iters", "1", "--json", str(tmp / f"ours_ttft_{n}.json")]
        ttfts.append(ttft)
    return [cli + offline + extra, cli + latency + extra, *(cli + t + extra for t in ttfts)]


def run_ours(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cmds = ours_commands(args, tmp)
    result: dict[str, Any] = {"commands": [shlex.join(c) for c in cmds]}
    for cmd in cmds:
        if error := run_command(cmd, {}, args.timeout):
            return {**result, "error": error}
    off = json.loads((tmp / "ours_offline.json").read_text())
    lat = json.loads((tmp / "ours_latency.json").read_text())
    w1 = w1_figures(
        off["prompt_tokens"], off["output_tokens"], off["elapsed_s"], off["num_prompts"]
    )
    single = {key: lat[key] for key in ("ttft_ms", "decode_tok_per_s")}
    single |= {"output_tokens": lat["output_len"], "method": "engine step loop"}
    engine = off["engine"]
    kind = engine["dtype"] + (f", {q}" if (q := engine.get("quantization")) else "")
    kind += f", KV {kv}" if (kv := engine.get("kv_cache_dtype", "auto")) != "auto" else ""
    figures = engine_result("pypto-serving", kind, engine["threads"], off["startup_s"], w1, single)
    ttfts = {str(n): json.loads((tmp / f"ours_ttft_{n}.json").read_text()) for n in args.ttft_lens}
    rss = max(
        off["peak_rss_mib"], lat["peak_rss_mib"], *(t["peak_rss_mib"] for t in ttfts.values())
    )
    ttft_at = {n: t["ttft_ms"] for n, t in ttfts.items()}
    return {**result, **figures, "peak_rss_mib": rss, "ttft_at_ms": ttft_at}


def peer_python(name: str) -> tuple[Path | None, str]:
    """The peer's interpreter, or None and why it is skipped."""
    if name in HF_DTYPES:
        return Path(sys.executable), ""
    python = PEERS / name / "bin" / "python"
    if not python.exists():
        return None, f"{python} not found (install: ../shared/peers/install_{name}*.sh)"
    probe = PROBE.format(module=PEER_MODULES[name])
    if subprocess.run([str(python), "-c", probe], check=False).returncode:
        return None, f"{python} has no {PEER_MODULES[name]} module"
    return python, ""


def run_peer(name: str, args: argparse.Namespace, spec_path: Path, tmp: Path) -> dict[str, Any]:
    if name == "llamacpp" and json.loads(spec_path.read_text())["gguf"] is None:
        why = "no GGUF file of this model"
        print(f"note: skipping {name}: {why}", file=sys.stderr)
        return {"skipped": why}
    python, why = peer_python(name)
    if python is None:
        print(f"note: skipping {name}: {why}", file=sys.stderr)
        return {"skipped": why}
    out = tmp / f"{name}.json"
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", name]
    cmd += ["--spec", str(spec_path), "--out", str(out)]
    env = VLLM_ENV if name == "vllm" else {}
    shown = shlex.join([*(f"{k}={v}" for k, v in env.items()), *cmd])
    if error := run_command(cmd, env, args.timeout):
        return {"commands": [shown], "error": error}
    return {"commands": [shown], **json.loads(out.read_text())}


def flatten(result: dict[str, Any]) -> dict[str, float]:
    w1, single = result.get("w1", {}), result.get("single", {})
    return {
        "w1_output_tok_per_s": w1.get("output_tok_per_s"),
        "w1_total_tok_per_s": w1.get("total_tok_per_s"),
        "single_decode_tok_per_s": single.get("decode_tok_per_s"),
        "single_ttft_ms": single.get("ttft_ms"),
        "startup_s": result.get("startup_s"),
        "peak_rss_mib": result.get("peak_rss_mib"),
    } | {f"ttft_{n}_ms": ms for n, ms in result.get("ttft_at_ms", {}).items()}


def cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def tables(results: dict[str, dict[str, Any]], ttft_lens: tuple[int, ...] = ()) -> list[str]:
    """Markdown: absolute figures, then ours / peer ratios (with a column per TTFT length)."""
    metrics = [*METRICS, *((f"ttft_{n}_ms", f"TTFT of {n} tokens ms", "{:.0f}") for n in ttft_lens)]
    ran = {
        k: {m: None for m, _, _ in metrics} | flatten(v) for k, v in results.items() if "w1" in v
    }
    head = "| engine | " + " | ".join(t for _, t, _ in metrics) + " |"
    rule = "|---" * (len(metrics) + 1) + "|"
    lines = [head, rule]
    for name, m in ran.items():
        label = f"{name} ({results[name].get('version', '')}, {results[name].get('dtype', '')})"
        lines.append(f"| {label} | " + " | ".join(cell(m[k], f) for k, _, f in metrics) + " |")
    ours = ran.get("ours")
    peers = [p for p in ran if p != "ours"]
    if ours and peers:
        lines += [
            "",
            "ours / peer (> 1: ours is higher; for TTFT, start-up and RSS lower is better)",
        ]
        lines += ["", head.replace("| engine |", "| peer |"), rule]
        for p in peers:
            ratios = [cell(ratio(ours[k], ran[p][k]), "{:.2f}×") for k, _, _ in metrics]
            lines.append(f"| {p} | " + " | ".join(ratios) + " |")
    return lines


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def roofline_lines(report: dict[str, Any], files: tuple[Path, Path | None]) -> list[str]:
    """Markdown: each engine's figures as fractions of this machine's limits (bench/roofline.py):
    the single stream's weight and KV reads against the read bandwidth, W1's and each TTFT's
    FLOPs against the GEMM limit of what the engine computes in (bf16; float32 for HF's
    float32; int8 for llama.cpp's quantized dot products where torch measures an int8 GEMM)."""
    import roofline

    machine = roofline.Limits(**report["machine"]["limits"])
    w = report["workload"]
    hf_dir, gguf_file = files
    context = w["single_input_len"] + w["single_len"] // 2
    lens = tuple(w.get("ttft_lens") or ())
    head = "| engine | weights a token | single stream, of bandwidth | W1, of GEMM |"
    head += "".join(f" TTFT {n}, of GEMM |" for n in lens)
    lines = [head, "|---" * (4 + len(lens)) + "|"]
    for name, result in report["results"].items():
        if "w1" not in result:
            continue
        model = gguf_file if name in ("ours", "llamacpp") and gguf_file else hf_dir
        kind = str(result.get("dtype")).split(", ")  # e.g. bfloat16, int4-w8a8, KV int8
        ours = kind if name == "ours" else []
        # our quantized forms' bytes; else the weights as stored (or a GGUF file's records)
        quantized = next((q for q in ours if q in roofline.QUANTIZED_BYTES), None)
        need = roofline.demand(model, quantized)
        peak = machine.bf16_gflop_s
        if "float32" in kind:
            peak = machine.fp32_gflop_s
        elif name == "llamacpp" or any(q.endswith("w8a8") for q in ours):
            peak = machine.int8_gop_s or peak  # the int8 GEMM computes these
        elif "gguf" in ours and need.expert_flops and machine.int8_gop_s:
            peak = roofline.mixed_peak(need, peak, machine.int8_gop_s)  # experts' int8 products
        single = result["single"]["decode_tok_per_s"]
        w1 = result["w1"]
        tokens = w1["prompt_tokens"] + w1["output_tokens"]
        cells = [
            f"{need.weight_bytes / 1e6:,.0f} MB",
            f"{roofline.decode_fraction(single, need, machine, context):.0%}",
            f"{tokens * need.flops / w1['elapsed_s'] / 1e9 / peak:.0%}",
        ]
        for n in lens:
            ms = result.get("ttft_at_ms", {}).get(str(n))
            share = None if ms is None else roofline.prefill_fraction(n, ms / 1000, need, peak)
            cells.append("—" if share is None else f"{share:.0%}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [
        f"Of this machine's limits ({machine.isa}; {machine.threads} threads): read bandwidth "
        f"{machine.read_gb_s:.1f} GB/s, GEMM bf16 {machine.bf16_gflop_s:.0f} GFLOP/s, float32 "
        f"{machine.fp32_gflop_s:.0f}"
        + (f", int8 {machine.int8_gop_s:.0f} GOP/s" if machine.int8_gop_s else "")
        + " (bench/roofline.py):",
        "",
        *lines,
    ]


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name:")),
        "unknown",
    )
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "os_cpu_count": os.cpu_count()}


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    about = (
        f"Model: {w.get('model') or 'SmolLM2-135M-Instruct'}. W1: {w['num_prompts']} prompts "
        f"× {w['output_len']} "
        "output tokens, greedy, EOS ignored. Single stream: "
        f"{w['single_input_len']} random prompt tokens → {w['single_len']} tokens."
    )
    commands = [c for r in report["results"].values() for c in r.get("commands", [])]
    missing = {k: v for k, v in report["results"].items() if "w1" not in v}
    lens = tuple(w.get("ttft_lens") or ())
    table_lines = tables(report["results"], lens)
    if report["machine"].get("limits") and report.get("files"):
        files = report["files"]
        hf_dir, gguf_file = Path(files[0]), files[1] and Path(files[1])
        table_lines += ["", *roofline_lines(report, (hf_dir, gguf_file))]
    return markdown_report("Side by side", report, about, table_lines, commands, missing)


def markdown_report(
    title: str,
    report: dict[str, Any],
    about: str,
    table_lines: list[str],
    commands: list[str],
    missing: dict[str, dict[str, Any]],
) -> str:
    """Heading with date, machine and workload, the tables, the commands, what was skipped."""
    m = report["machine"]
    lines = [
        f"### {title} ({report['date']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores. {about}",
        "",
        *table_lines,
        "",
        "Commands:",
        "",
        "```",
        report["command"],
        *commands,
        "```",
    ]
    notes = [f"- {k}: {v.get('skipped') or v.get('error')}" for k, v in missing.items()]
    return "\n".join(lines + (["", "Not measured:", *notes] if notes else [])) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", default="ours,hf,vllm,llamacpp", help=f"of {', '.join(ENGINES)}")
    p.add_argument("--w1", type=Path, default=DEFAULT_W1, help="W1 prompts (JSONL)")
    p.add_argument("--num-prompts", type=int, default=64, help="W1 prompts to use")
    p.add_argument("--output-len", type=int, default=128, help="W1 output tokens per prompt")
    p.add_argument("--batch-size", type=int, default=32, help="HF transformers W1 batch size")
    p.add_argument("--single-len", type=int, default=256, help="single-stream output tokens")
    p.add_argument("--single-input-len", type=int, default=32, help="single-stream prompt tokens")
    p.add_argument("--single-iters", type=int, default=1, help="single-stream runs (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--ttft-lens",
        type=lambda text: [int(n) for n in text.split(",") if n.strip()],
        default=[512, 2048],
        help="prompt lengths whose TTFT is measured alone (comma-separated; '' for none)",
    )
    p.add_argument(
        "--ours-args", default="", help="extra flags for pypto bench, e.g. '--dtype float32'"
    )
    p.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="vLLM-CPU's dtype (its AVX2 build is faster in float32)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per engine run")
    p.add_argument(
        "--shape",
        help="a random-weight checkpoint at a published shape (bench/real_shapes.py: "
        "llama-1b, llama-8b, qwen3-4b, qwen3-moe-small)",
    )
    p.add_argument("--gguf-type", default="Q4_1", help="the --shape's GGUF file type")
    p.add_argument("--model", type=Path, help="a model directory or GGUF file to measure")
    p.add_argument("--json", type=Path, help="write every figure as JSON")
    p.add_argument("--markdown", type=Path, help="write the tables (for docs/performance.md)")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if bad := [e for e in args.engines if e not in ENGINES]:
        p.error(f"unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINES)}")
    for name in ("num_prompts", "output_len", "batch_size", "single_input_len", "single_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.single_len < 2:
        p.error("--single-len must be >= 2")
    if args.shape and args.model is not None:
        p.error("give --shape or --model, not both")
    if args.model is not None and not args.model.exists():
        p.error(f"--model {args.model} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.spec, args.out)
        return 0
    from pypto_serving.errors import PyptoError

    sys.path.insert(0, str(Path(__file__).parent))
    import roofline

    before = roofline.limits(fresh=True)  # measured before the engines run, and after
    with tempfile.TemporaryDirectory(prefix="side_by_side_") as tmp_name:
        tmp = Path(tmp_name)
        spec_path = tmp / "spec.json"
        try:
            args.files = model_files(args)  # (written or converted once, here)
            spec_path.write_text(json.dumps(build_spec(args)))
        except PyptoError as e:
            print(f"side_by_side: error: {e}", file=sys.stderr)
            return 1
        results = {
            name: run_ours(args, tmp) if name == "ours" else run_peer(name, args, spec_path, tmp)
            for name in args.engines
        }
    limits = roofline.best(before, roofline.limits(fresh=True))
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine() | {"limits": dataclasses.asdict(limits)},
        "files": [str(f) if f is not None else None for f in args.files],
        "command": shlex.join(["python", *sys.argv]),
        "workload": {k: getattr(args, k) for k in WORKLOAD} | {"model": model_label(args)},
        "results": results,
    }
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
