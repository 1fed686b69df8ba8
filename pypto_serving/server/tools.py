"""Tool calling: how a model family writes its calls, the grammar that holds its output to
them, and the conversation as its chat template takes it.

Four formats (vLLM's --tool-call-parser names in brackets):
- **hermes** [hermes] (Qwen2/2.5/3, Hermes and most templates that render tools): one JSON
  object `{"name": ..., "arguments": {...}}` per `<tool_call>` ... `</tool_call>` block, a
  block per call. The model's own template renders the tools, the calls and the results.
- **smollm2** [hermes] (the default model, and any template that renders no tools): one
  `<tool_call>` block holding a JSON list of calls. The template in
  `templates/smollm2_tools.jinja` renders the tools in the system prompt SmolLM2-Instruct was
  taught them with, and the results as `<tool_response>`.
- **mistral** [mistral] (Mistral's templates, which render `[TOOL_CALLS]`): `[TOOL_CALLS]`,
  then a JSON list of `{"name": ..., "arguments": {...}}`; nothing closes it.
- **llama3_json** [llama3_json] (Llama 3.1-3.3's templates, which write calls as
  `{"name": ..., "parameters": ...}`): the reply is a call's JSON object from its first
  character, several calls separated by `; `, or it is text.

Every mode that may call a tool runs under a grammar (llguidance, as structured outputs do):
`required` and a named tool admit only calls, to the tools allowed, with arguments matching
their schemas; `auto` leaves text free until the model opens a call (a tag's lazy rule, or,
for llama3_json, a reply whose first character is `{`), then holds the call to the same rule.
So every call parses and its arguments validate; `parallel_tool_calls: false` allows one
call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_WHITESPACE = r"[ \t\n\r]{0,12}"
"""Whitespace a call's JSON may hold between two of its tokens: what models write in calls
(a space, a newline and an indent), bounded tighter than structured outputs' (a small model
must not stall a call in whitespace)."""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    list_body: bool
    """True: a block holds a JSON list of calls (smollm2, mistral); False: one call."""
    own_template: bool
    """True: the calls and tools are rendered by the template packaged here, not the model's."""
    open: str = OPEN
    """What opens calls: a tag ("": a call opens the reply, its JSON's first character)."""
    close: str = CLOSE
    """What closes a block ("": nothing)."""
    arguments: str = "arguments"
    """The call's key for its arguments (llama3_json: parameters)."""
    separator: str = ""
    """Between two calls that have no tags around them (llama3_json: ;)."""
    pythonic: bool = False
    """Calls are a Python list of calls (server/pythonic_calls.py), not JSON."""

    def template(self) -> str | None:
        """The chat template to render a conversation with tools in, None for the model's."""
        return _smollm2_template() if self.own_template else None


HERMES = ToolFormat("hermes", list_body=False, own_template=False)
SMOLLM2 = ToolFormat("smollm2", list_body=True, own_template=True)
MISTRAL = ToolFormat("mistral", list_body=True, own_template=False, open="[TOOL_CALLS]", close="")
LLAMA3_JSON = ToolFormat(
    "llama3_json",
    list_body=False,
    own_template=False,
    open="",
    close="",
    arguments="parameters",
    separator=";",
)
PYTHONIC = ToolFormat(
    "pythonic", list_body=True, own_template=False, open="", close="", pythonic=True
)
PARSERS = {"hermes": HERMES, "mistral": MISTRAL, "llama3_json": LLAMA3_JSON, "pythonic": PYTHONIC}
"""vLLM's --tool-call-parser names -> formats (hermes: SmolLM2's where the template renders
no tools, its calls being in the same tags)."""


@cache
def _smollm2_template() -> str:
    return (resources.files(__package__) / "templates" / "smollm2_tools.jinja").read_text()


def tool_format(chat_template: str | None, parser: str | None = None) -> ToolFormat | None:
    """The format of the model whose chat template this is (or the one `parser`, vLLM's
    --tool-call-parser, names): hermes where the template renders tools in `<tool_call>`
    blocks, smollm2 where it renders no tools, mistral where it writes `[TOOL_CALLS]`,
    llama3_json where it writes calls' `parameters`; None (tool calling refused) where it
    renders them in another format."""
    if not chat_template:
        return None
    if parser is not None and parser != "hermes":
        return PARSERS[parser]
    if "tools" not in chat_template:
        return SMOLLM2
    if OPEN in chat_template or parser == "hermes":
        return HERMES
    if MISTRAL.open in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or '"parameters": ' in chat_template:
        return LLAMA3_JSON
    return None


DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are data, not schemas: a `$ref` in them is not a reference."""
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
"""Keywords whose values map names (any, even a keyword's) to schemas."""


def call_schema(
    name: str, parameters: dict[str, Any], arguments: str = "arguments"
) -> dict[str, Any]:
    """The JSON schema of one call to a tool: its name, then its arguments (under the
    format's key, `arguments`) matching its schema.

    Parameters holding local references (pydantic's `#/$defs/Loc`, `#` for recursion) would
    break nested under `arguments`: they are kept whole in the call's `$defs` under the
    tool's name instead, every local reference rewritten to point below it
    (`#/$defs/<name>/$defs/Loc`), and `arguments` refers to them. Tool names are unique, so
    the `$defs` of several calls never collide when `call_grammar` hoists them to the root
    of the schema that combines them."""
    where = f"#/$defs/{name}"
    rebased = _rebased(parameters, where)
    refers = rebased != parameters  # it holds local references
    held = {"$ref": where} if refers else parameters
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments: held},
        "required": ["name", arguments],
        "additionalProperties": False,
        **({"$defs": {name: rebased}} if refers else {}),
    }


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with each local reference (`#...`) made to point below `root` instead."""
    if isinstance(schema, list):
        return [_rebased(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {n: _rebased(s, root) for n, s in value.items()}
        else:
            out[key] = _rebased(value, root)
    return out


def _json_rule(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    options = {"whitespace_flexible": True, "whitespace_pattern": CALL_WHITESPACE}
    hoisted = {"$defs": defs} if defs else {}
    return "%json " + json.dumps({**schema, **hoisted, "x-guidance": options})


def tag_tokens(
    added_vocab: dict[str, int], fmt: ToolFormat | None = None
) -> tuple[int | None, int | None]:
    """The token ids of the format's opening and closing tags where the tokenizer has them as
    tokens of their own (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`): a grammar names
    those by id (llguidance keeps added tokens apart from text)."""
    fmt = fmt or HERMES
    opening = added_vocab.get(fmt.open) if fmt.open else None
    closing = added_vocab.get(fmt.close) if fmt.close else None
    return opening, closing


def call_grammar(
    fmt: ToolFormat,
    calls: list[dict[str, Any]],
    required: bool,
    parallel: bool,
    tags: tuple[int | None, int | None] = (None, None),
) -> str:
    """A Lark grammar (llguidance's) for a reply that calls the tools of `calls` (their call
    schemas, their `$defs` hoisted to the root): only calls where `required`, else free text
    with calls where the model opens them; one call unless `parallel`. `tags`: the tags'
    token ids (tag_tokens)."""
    defs = {k: v for call in calls for k, v in call.get("$defs", {}).items()}
    bare = [{k: v for k, v in call.items() if k != "$defs"} for call in calls]
    one: dict[str, Any] = bare[0] if len(bare) == 1 else {"anyOf": bare}
    if not fmt.open:  # llama3_json: the reply is calls from its first character, or text
        more = ' (";" " "? call)*' if parallel else ""
        lines = ["%llguidance {}", f"calls: call{more}", f"call: {_json_rule(one, defs)}"]
        if required:
            return "\n".join([*lines, "start: calls"]) + "\n"
        return "\n".join([*lines, "start: calls | TEXT", "TEXT: /([^{](.|\\n)*)?/"]) + "\n"
    opening, closing = (
        (json.dumps(tag) if tag else "") if i is None else f"<[{i}]>"
        for i, tag in zip(tags, (fmt.open, fmt.close), strict=True)
    )
    if fmt.list_body:
        listed = {"type": "array", "items": one, "minItems": 0 if not required else 1}
        body = f"{_json_rule({**listed, **({} if parallel else {'maxItems': 1})}, defs)} {closing}"
    else:
        body = f'"\\n" {_json_rule(one, defs)} "\\n" {closing}'
    many = parallel and not fmt.list_body
    lines = ["%llguidance {}"]
    if required:
        rest = ' ("\\n"? block)*' if many else ""
        lines += [f"start: block{rest}", f"block: {opening} {body}"]
    elif tags[0] is not None:  # the tag is a token: text cannot hold it
        lines += [
            f"start: call{'*' if many else '?'} TEXT",
            f"call: TEXT {opening} {body}",
            "TEXT: /(.|\\n)*/",
        ]
    else:  # text up to the first tag (a lazy rule), and no tag after the calls
        lines += [
            f"start: call{'*' if many else '?'} TEXT_END",
            f"call: opening {body}",
            f"opening[lazy]: TEXT {opening}",
            "TEXT: /(.|\\n)*/",
            f"TEXT_END: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(fmt.open)}(.|\\n)*/",
        ]
    return "\n".join(lines) + "\n"


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: a call's arguments as an object (templates write
    them with `tojson`), where they are one."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = arguments
        out.append({**call, "function": {**call["function"], "arguments": parsed}})
    return {**message, "tool_calls": out}
