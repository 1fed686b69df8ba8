"""`pypto` command line: generate, serve, chat, bench.

Engine flags are derived from the config dataclasses (name, type, default and the field's
docstring as help), so a knob is declared once, in config.py.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import inspect
import itertools
import json
import logging
import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from pypto_serving.config import (
    SECTION_NAMES,
    SERVE_ENGINE_DEFAULTS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    parse_bytes,
    read_config_file,
    split_knobs,
)
from pypto_serving.errors import PyptoError

SECTIONS = (EngineConfig, SchedulerConfig, CacheConfig, ParallelConfig)
ALIASES = {
    "data_parallel_size": ("--dp",),
    "tensor_parallel_size": ("--tp",),
    "pipeline_parallel_size": ("--pp",),
}
"""Short flags beside the long ones derived from field names (vLLM's spellings)."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under dataclass fields (they are not kept at run time)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        ):
            docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


def _flag_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if isinstance(annotation, types.UnionType) and args else annotation


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
) -> None:
    add_config_flags(parser, "engine", SECTIONS, defaults)


def add_config_flags(
    parser: argparse.ArgumentParser,
    title: str,
    sections: tuple[type, ...],
    defaults: dict[str, Any] | None = None,
) -> None:
    """One flag per field of the config dataclasses (default None: 'not given'); `defaults`
    names the fields whose default differs for this command."""
    group = parser.add_argument_group(title)
    for section in sections:
        docs = field_docs(section)
        hints = typing.get_type_hints(section)
        for f in fields(section):
            if f.name in SECTION_NAMES:
                continue
            flags = [
                "--" + f.name.replace("_", "-"),
                *ALIASES.get(f.name, ()),
            ]
            kind = byte_count if f.name.endswith("_bytes") else _flag_type(hints[f.name])
            default = f.default if f.default is not MISSING else None
            default = (defaults or {}).get(f.name, default)
            help_text = f"{docs.get(f.name, '')} (default: {default})"
            if kind is bool:
                group.add_argument(
                    *flags, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            else:
                group.add_argument(*flags, type=kind, default=None, help=help_text)


def engine_knobs(args: argparse.Namespace, sections: tuple[type, ...] = SECTIONS) -> dict[str, Any]:
    """The config fields given on the command line (flags left out are not in the dict)."""
    names = {f.name for s in sections for f in fields(s)} - set(SECTION_NAMES)
    return {n: v for n, v in vars(args).items() if n in names and v is not None}


def byte_count(text: str) -> int:
    try:
        return parse_bytes(text)
    except PyptoError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pypto", description="PyPTO Serving: LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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
        "--config",
        type=Path,
        help='JSON file of options (flat, or in "scheduler", "cache", "parallel", "server" '
        "sections); flags given on the command line win",
    )
    add_config_flags(serve, "server", (ServerConfig,))
    add_engine_flags(serve, SERVE_ENGINE_DEFAULTS)
    from pypto_serving.bench import add_bench_parser
    from pypto_serving.chat import add_chat_parser

    add_chat_parser(sub)

    add_bench_parser(sub)
    return parser


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

    if args.prompts_file is None:
        for piece in llm.stream(prepare(args.prompt), params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    prompts = read_prompts(args.prompts_file)
    outputs = llm.generate([prepare(p) for p in prompts], params)
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


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: JSONL objects with a 'prompt' field, or one prompt per line."""
    if not path.is_file():
        raise PyptoError(f"prompts file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise PyptoError(f"{path}:{n}: expected a JSON object with a 'prompt'") from None
        else:
            prompts.append(line)
    if not prompts:
        raise PyptoError(f"no prompts in {path}")
    return prompts


def cmd_serve(args: argparse.Namespace) -> int:
    from pypto_serving.server.launch import run_server

    knobs = SERVE_ENGINE_DEFAULTS | (read_config_file(args.config) if args.config else {})
    knobs |= engine_knobs(args, (*SECTIONS, ServerConfig))
    engine, server = split_knobs(knobs)
    if engine.get("node_rank", 0) > 0:  # another machine of a multi-node group: ranks only
        from pypto_serving.config import engine_config
        from pypto_serving.engine.ranks import serve_node
        from pypto_serving.models.default_model import resolve_model_path

        config = engine_config(**engine)
        return serve_node(config, resolve_model_path(config.model))
    return run_server(engine, server)


def run_command(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "chat":
        from pypto_serving.chat import run_chat

        return run_chat(args)
    if args.command == "bench":
        from pypto_serving.bench import run_bench

        return run_bench(args)
    return cmd_generate(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
