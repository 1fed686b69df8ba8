"""Command-line flags derived from the config dataclasses, and the argument types they share.

Each config field becomes a flag (name, type, default and the field's docstring as help), so
a knob is declared once, in config.py. `pypto generate`, `serve`, `chat` and the benches all
build their engine flags here.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import json
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from pypto_serving.config import (
    SECTION_NAMES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_bytes,
)
from pypto_serving.errors import PyptoError

SECTIONS = (EngineConfig, SchedulerConfig, CacheConfig, ParallelConfig)
ALIASES = {
    "data_parallel_size": ("--dp", "-dp"),
    "tensor_parallel_size": ("--tp", "-tp"),
    "pipeline_parallel_size": ("--pp", "-pp"),
    "structured_outputs_backend": ("--structured-outputs-config.backend",),
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


def byte_count(text: str) -> int:
    try:
        return parse_bytes(text)
    except PyptoError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    names the fields whose default differs for this command. A command's own flag of the
    same name stays its own, and that field is not set by it (`pypto generate --seed` seeds
    its requests, `pypto bench --seed` its random prompts; the engine's seed is serve's)."""
    group = parser.add_argument_group(title)
    own = set(parser.get_default("own_flags") or ())
    for section in sections:
        docs = field_docs(section)
        hints = typing.get_type_hints(section)
        for f in fields(section):
            if "--" + f.name.replace("_", "-") in parser._option_string_actions:
                own.add(f.name)
                continue
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
            elif typing.get_origin(kind) is list:  # one or more values after the flag
                (item,) = typing.get_args(kind)
                group.add_argument(*flags, type=item, nargs="+", default=None, help=help_text)
            else:
                group.add_argument(*flags, type=kind, default=None, help=help_text)
    parser.set_defaults(own_flags=frozenset(own))


def engine_knobs(args: argparse.Namespace, sections: tuple[type, ...] = SECTIONS) -> dict[str, Any]:
    """The config fields given on the command line (flags left out are not in the dict)."""
    names = {f.name for s in sections for f in fields(s)} - set(SECTION_NAMES)
    names -= getattr(args, "own_flags", frozenset())  # the command's own, not a config field
    return {n: v for n, v in vars(args).items() if n in names and v is not None}


def read_prompts(path: Path) -> list[str]:
    """Prompts from a `--prompts-file`: JSONL objects with a 'prompt' field, or one per line."""
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
