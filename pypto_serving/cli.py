"""`pypto` command line: generate, serve, chat, bench.

Engine flags are derived from the config dataclasses (flags.py), so a knob is declared once,
in config.py.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING

from pypto_serving.bench import add_bench_parser, run_bench
from pypto_serving.chat import add_chat_parser, run_chat
from pypto_serving.config import (
    SERVE_ENGINE_DEFAULTS,
    ServerConfig,
    read_config_file,
    split_knobs,
)
from pypto_serving.errors import PyptoError
from pypto_serving.flags import (
    SECTIONS,
    add_config_flags,
    add_engine_flags,
    engine_knobs,
    positive_int,
    read_prompts,
)
from pypto_serving.vllm_flags import add_vllm_only_flags

if TYPE_CHECKING:
    from pypto_serving.outputs import RequestOutput


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pypto", description="PyPTO Serving: LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--version", action="version", version=f"pypto {package_version('pypto-serving')}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for a prompt (streams to stdout)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument(
        "--prompts-file",
        type=Path,
        help="one prompt per line, or JSONL with a 'prompt' field; writes JSONL",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template to the prompt as one user message",
    )
    gen.add_argument("--max-tokens", type=positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--output", type=Path, help="JSONL output file (with --prompts-file)")
    add_engine_flags(gen)
    serve = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (see docs/serving.md)"
    )
    serve.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model gives it (vLLM's spelling: pypto serve MODEL)",
    )
    serve.add_argument(
        "--config",
        type=Path,
        help='JSON file of options (flat, or in "scheduler", "cache", "parallel", "server" '
        "sections); flags given on the command line win",
    )
    add_config_flags(serve, "server", (ServerConfig,))
    add_engine_flags(serve, SERVE_ENGINE_DEFAULTS)
    add_vllm_only_flags(serve)
    router = sub.add_parser(
        "router",
        help="the OpenAI API in front of prefill and decode servers (disaggregated serving)",
    )
    router.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill servers (pypto serve --disaggregation-mode prefill)",
    )
    router.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode servers (pypto serve --disaggregation-mode decode)",
    )
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument("--port", type=int, default=8000, help="port to listen on")
    router.add_argument(
        "--retry-s",
        type=float,
        default=10.0,
        help="how long a server that failed stays out of the rotation",
    )
    router.add_argument(
        "--kv-events",
        nargs="+",
        default=[],
        metavar="ENDPOINT",
        help="the prefill servers' KV event endpoints (their --kv-events-endpoint, e.g. "
        "tcp://10.0.0.5:5557), one per --prefill server in the same order: their events "
        "then say which prefixes each caches",
    )
    router.add_argument(
        "--kv-events-server-key",
        metavar="FILE",
        help="the servers' CURVE public key (.key), where their KV events are encrypted",
    )
    router.add_argument(
        "--kv-events-key",
        metavar="FILE",
        help="this router's CURVE key pair (.key_secret), admitted by the servers",
    )
    add_chat_parser(sub)
    add_bench_parser(sub)
    return parser


def timing_line(outputs: list[RequestOutput], seconds: float, ttft: float | None) -> str:
    """`pypto generate`'s last line, on stderr (llama.cpp prints one too): tokens in and
    out, the time to the first piece and the output rate."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    first = f", first text after {ttft * 1000:.0f} ms" if ttft is not None else ""
    rate = generated / seconds if seconds > 0 else 0.0
    prompts = f"{len(outputs)} prompts, " if len(outputs) > 1 else ""
    return (
        f"[{prompts}{prompt} prompt tokens, {generated} generated in {seconds:.2f} s"
        f"{first}: {rate:.1f} tokens/s]\n"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pypto_serving.engine.llm import LLM
    from pypto_serving.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(**engine_knobs(args))
    atexit.register(llm.close)  # a clean exit keeps the cached KV on the SSD tier

    def prepare(text: str) -> str | list[int]:
        return llm.chat_prompt([{"role": "user", "content": text}]) if args.chat else text

    start = time.perf_counter()
    if args.prompts_file is None:
        pieces = llm.stream(prepare(args.prompt), params)
        first: float | None = None
        while True:
            try:
                piece = next(pieces)
            except StopIteration as done:
                out: RequestOutput = done.value
                break
            first = first if first is not None else time.perf_counter()
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stderr.write(timing_line([out], time.perf_counter() - start, first and first - start))
        return 0
    prompts = read_prompts(args.prompts_file)
    outputs = llm.generate([prepare(p) for p in prompts], params)
    sys.stderr.write(timing_line(outputs, time.perf_counter() - start, None))
    sink = args.output.open("w") if args.output else sys.stdout
    for prompt, out in zip(prompts, outputs, strict=True):
        o = out.outputs[0]
        sink.write(
            json.dumps(
                {
                    "prompt": prompt,
                    "text": o.text,
                    "token_ids": o.token_ids,
                    "finish_reason": o.finish_reason,
                    "num_cached_tokens": out.num_cached_tokens,
                    "cached_tokens_by_tier": out.cached_tokens_by_tier,
                }
            )
            + "\n"
        )
    if args.output:
        sink.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pypto_serving.server.launch import run_server

    knobs = SERVE_ENGINE_DEFAULTS | (read_config_file(args.config) if args.config else {})
    knobs |= engine_knobs(args, (*SECTIONS, ServerConfig))
    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise PyptoError(
                f"two models given: {args.model_path!r} and --model {args.model!r}", "model"
            )
        knobs["model"] = args.model_path
    key = os.environ.get("PYPTO_API_KEY") or os.environ.get("VLLM_API_KEY")
    if key and "api_key" not in knobs:  # out of the command line, which others can read
        knobs["api_key"] = key
    engine, server = split_knobs(knobs)
    if engine.get("node_rank", 0) > 0:  # another machine of a multi-node engine: no HTTP
        from pypto_serving.config import engine_config
        from pypto_serving.engine.dp import serve_replicas
        from pypto_serving.engine.ranks import serve_node
        from pypto_serving.models.default_model import resolve_model_path

        config = engine_config(**engine)
        host = serve_replicas if config.parallel.data_parallel_size > 1 else serve_node
        return host(config, resolve_model_path(config.model))
    return run_server(engine, server)


def run_command(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "chat":
        return run_chat(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "router":
        from pypto_serving.server.router import RouterConfig, run_router

        return run_router(
            RouterConfig(
                args.prefill,
                args.decode,
                args.host,
                args.port,
                args.retry_s,
                kv_events=args.kv_events,
                kv_events_server_key=args.kv_events_server_key,
                kv_events_key=args.kv_events_key,
            )
        )
    return cmd_generate(args)


def dashed(argv: list[str]) -> list[str]:
    """`--max_model_len` as `--max-model-len`: vLLM's command lines spell flags either way."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":  # the end of the flags
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        out.append(name.replace("_", "-") + eq + value if arg.startswith("--") else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(dashed(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return run_command(args)
    except PyptoError as e:
        print(f"pypto: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
