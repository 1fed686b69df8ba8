#!/usr/bin/env python
"""Speculative decoding's single stream: plain decoding against drafts (n-gram by default, or
a draft model: `--speculative-config '{"model": ...}'`), in one run.

Each workload's chat prompts (`pypto_serving.bench.datasets.WORKLOADS`: `echo` asks for a
given text back, repeated or lightly edited; `open` for new text) run greedy, to EOS or
`--output-len`, one request at a time, on two engines of the same model held side by side in
one process: plain, then with `--speculative-config`, prompt by prompt, for `--rounds`
rounds. Output tok/s is a request's tokens over its whole time (prefill included), decode
tok/s those after the first over the time after it; each ratio is the median of the prompts'
back-to-back pairs. The two engines' tokens are checked equal.

llama.cpp (llama-cpp-python, ~/.cache/peers/llamacpp) runs the same token ids on the same
GGUF file the same way, plain and with its prompt lookup decoding (`LlamaPromptLookupDecoding`,
the same k and longest n-gram), in its own interpreter (`--worker llamacpp`; this file then
imports the standard library only).

    python bench/speculative.py --json spec.json --markdown spec.md
    python bench/speculative.py --model /path/model.gguf --rounds 2 --engines ours
    python bench/speculative.py --quantization none --engines ours \
        --speculative-config '{"model": "default", "num_speculative_tokens": 7}'
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
from pathlib import Path
from typing import Any

PEER_PYTHON = Path.home() / ".cache" / "peers" / "llamacpp" / "bin" / "python"
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 9,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def summary(pairs: list[tuple[float, float]], key: str = "") -> dict[str, float]:
    """Medians of (plain, speculative) tok/s pairs, and the median of their ratios."""
    return {
        f"plain{key}_tok_per_s": statistics.median(p for p, _ in pairs),
        f"speculative{key}_tok_per_s": statistics.median(s for _, s in pairs),
        f"ratio{key}": statistics.median(s / p for p, s in pairs),
    }


def llamacpp_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = len(os.sched_getaffinity(0))
    lookup = LlamaPromptLookupDecoding(max_ngram_size=spec["lookup_max"], num_pred_tokens=spec["k"])
    engines = {
        name: llama_cpp.Llama(
            spec["gguf"], n_ctx=2048, n_threads=threads, verbose=False, draft_model=draft
        )
        for name, draft in (("plain", None), ("speculative", lookup))
    }

    def run(llm: Any, ids: list[int]) -> tuple[float, float, list[int]]:
        """Output tok/s over the whole request, decode tok/s after the first token."""
        start, first, out = time.perf_counter(), 0.0, []
        for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter()
            if token == llm.token_eos():
                break
            out.append(token)
            if len(out) == spec["output_len"]:
                break
        end = time.perf_counter()
        return len(out) / (end - start), (len(out) - 1) / max(end - first, 1e-9), out

    for llm in engines.values():
        run(llm, spec["prompts"][next(iter(spec["prompts"]))][0][:16])  # warm up
    result: dict[str, Any] = {"version": f"llama-cpp-python {llama_cpp.__version__}"}
    for workload, prompts in spec["prompts"].items():
        pairs, decode_pairs, same = [], [], True
        for _ in range(spec["rounds"]):
            for ids in prompts:
                plain, plain_decode, a = run(engines["plain"], ids)
                fast, fast_decode, b = run(engines["speculative"], ids)
                pairs.append((plain, fast))
                decode_pairs.append((plain_decode, fast_decode))
                same = same and a == b
        result[workload] = summary(pairs) | summary(decode_pairs, "_decode") | {"same_tokens": same}
    return result


def run_ours(args: argparse.Namespace, spec: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    from pypto_serving import LLM
    from pypto_serving.bench.datasets import WORKLOADS, chat_prompts
    from pypto_serving.bench.latency import time_request

    plain = LLM(model=args.model, quantization=args.quantization)
    fast = LLM(model=args.model, quantization=args.quantization, speculative_config=spec)
    prompts = {w: chat_prompts(plain.tokenizer, w) for w in WORKLOADS if w in args.workloads}
    for llm in (plain, fast):  # warm up: compiled shapes, caches
        time_request(llm, prompts[args.workloads[0]][0], 8)
    result: dict[str, Any] = {}
    for workload, ids_list in prompts.items():
        before = fast.engine.stats().spec_decode
        pairs, decode_pairs, same, lengths = [], [], True, []
        for _ in range(args.rounds):
            for ids in ids_list:
                p = time_request(plain, ids, args.output_len, ignore_eos=False)
                s = time_request(fast, ids, args.output_len, ignore_eos=False)
                pairs.append((p.output_tok_per_s, s.output_tok_per_s))
                decode_pairs.append((p.decode_tok_per_s, s.decode_tok_per_s))
                lengths.append(p.output_tokens)
                same = same and p.token_ids == s.token_ids
        after = fast.engine.stats().spec_decode
        assert before is not None and after is not None
        drafts = after.num_draft_tokens - before.num_draft_tokens
        kept = after.num_accepted_tokens - before.num_accepted_tokens
        steps = after.num_drafts - before.num_drafts
        result[workload] = (
            summary(pairs)
            | summary(decode_pairs, "_decode")
            | {
                "same_tokens": same,
                "output_tokens_median": statistics.median(lengths),
                "draft_acceptance": kept / drafts if drafts else 0.0,
                "tokens_per_step_with_drafts": 1 + kept / steps if steps else 1.0,
            }
        )
    return result, prompts


def run_llamacpp(args: argparse.Namespace, prompts: dict, spec: dict[str, Any]) -> dict:
    from pypto_serving.models.default_model import find_default_gguf

    gguf = args.model if args.model.endswith(".gguf") else None
    if args.model == "default":
        gguf = str(find_default_gguf())
    if gguf is None:
        return {"note": "llama.cpp needs a GGUF file (--model FILE.gguf or the default)"}
    if not PEER_PYTHON.exists():
        return {"note": f"llama.cpp not installed ({PEER_PYTHON} missing)"}
    job = {
        "gguf": gguf,
        "prompts": prompts,
        "k": spec["num_speculative_tokens"],
        "lookup_max": spec.get("prompt_lookup_max", 5),
        "output_len": args.output_len,
        "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(job))
        cmd = [str(PEER_PYTHON), __file__, "--worker", "llamacpp", str(spec_path), str(out_path)]
        proc = subprocess.run(cmd, stdout=sys.stderr, timeout=3600)
        if proc.returncode:
            return {"note": f"the llama.cpp worker failed (exit {proc.returncode})"}
        return json.loads(out_path.read_text())


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Machine: {report['cpu']}; model {report['model']} (quantization "
        f"{report['quantization']}); drafts {json.dumps(report['spec'])}; "
        f"{report['rounds']} rounds, output <= {report['output_len']} tokens, greedy.",
        "",
        "| engine | workload | output tok/s plain / speculative | ratio | decode tok/s plain / "
        "speculative | ratio | drafts kept | tokens per step | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for engine, result in report["engines"].items():
        if "note" in result:
            lines.append(f"| {engine} | {result['note']} | | | | | | | |")
            continue
        for workload in report["workloads"]:
            r = result.get(workload)
            if r is None:
                continue
            kept = r.get("draft_acceptance")
            per_step = r.get("tokens_per_step_with_drafts")
            lines.append(
                f"| {engine} | {workload} | {r['plain_tok_per_s']:.1f} / "
                f"{r['speculative_tok_per_s']:.1f} | {r['ratio']:.2f}x | "
                f"{r['plain_decode_tok_per_s']:.1f} / {r['speculative_decode_tok_per_s']:.1f} | "
                f"{r['ratio_decode']:.2f}x | "
                f"{'' if kept is None else f'{100 * kept:.0f} %'} | "
                f"{'' if per_step is None else f'{per_step:.2f}'} | {r['same_tokens']} |"
            )
    return "\n".join(lines)


def cpu_line() -> str:
    flags = set()
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{model}, {os.cpu_count()} cores, {isa}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", help="the default model, a directory or a GGUF")
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    p.add_argument("--quantization", default="auto", help="the target model's (both engines)")
    p.add_argument("--workloads", default="echo,open")
    p.add_argument("--engines", default="ours,llamacpp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--worker", nargs=3, metavar=("NAME", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _, spec_path, out_path = args.worker
        result = llamacpp_worker(json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result, indent=2))
        return 0
    args.workloads = args.workloads.split(",")
    spec = json.loads(args.speculative_config)
    engines: dict[str, Any] = {}
    ours, prompts = run_ours(args, spec)
    if "ours" in args.engines.split(","):
        engines["ours"] = ours
    if "llamacpp" in args.engines.split(","):
        engines["llama.cpp"] = (
            run_llamacpp(args, prompts, spec)
            if spec.get("method") == "ngram"
            else {"note": "llama-cpp-python's own speculation is prompt lookup only"}
        )
    report = {
        "cpu": cpu_line(),
        "model": args.model,
        "quantization": args.quantization,
        "spec": spec,
        "rounds": args.rounds,
        "output_len": args.output_len,
        "workloads": args.workloads,
        "engines": engines,
    }
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
