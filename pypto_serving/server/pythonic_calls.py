"""Tool calls written as a Python list of calls (vLLM's `pythonic` parser: Llama 3.2's and
Llama 4's format, and models trained on it): `[get_weather(city="Paris"), get_time()]`.

A reply that starts with `[` (blanks and Llama 4's `<|python_start|>` before it allowed) is
held back until its list closes, then read with Python's own parser: a list of calls of plain
names with keyword arguments whose values are literals (strings, numbers, True / False /
None, lists, dicts) is the reply's calls, each argument object as JSON; anything else was
text after all and is the content. What follows the list is held to the reply's end, where
`<|python_end|>` and blanks are dropped and anything else is content. A reply that starts
otherwise is all content.

`pythonic_grammar` holds a reply to such calls (tool_choice required or named, or auto:
calls or text that does not start a list): the tools' names, their parameters' names, and
values of the parameters' JSON types written as Python literals (an enum's values, strings,
integers, numbers, booleans; a literal of any type where the schema says nothing simpler).
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass
from typing import Any

from pypto_serving.server.tool_parser import CallDelta, ToolCall, ToolCallParser
from pypto_serving.server.tools import ToolFormat

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls a list's text holds, or None where it is not a list of calls."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    out = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            json.dumps(args)  # JSON's types only (no sets, tuples become lists)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(args) != len(node.keywords):  # a **kwargs
            return None
        out.append((node.func.id, args))
    return out


@dataclass(slots=True)
class _ListScan:
    """Where the list a reply opens with `[` closes, found piece by piece: the scan keeps its
    place, depth and string state, so each character is read once however the reply streams."""

    at: int = 0
    depth: int = 0
    quote: str = ""
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """The index after the list's closing bracket in `text` (the held list so far, which
        only grows), or None: not closed yet."""
        for i in range(self.at, len(text)):
            ch = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.at = i + 1
                    return i + 1
        self.at = len(text)
        return None


def call_parser(fmt: ToolFormat) -> ToolCallParser:
    """The parser of a reply in this format."""
    return PythonicCallParser(fmt) if fmt.pythonic else ToolCallParser(fmt)


class PythonicCallParser(ToolCallParser):
    """ToolCallParser's interface (feed, flush, message_content, calls) for pythonic calls."""

    def __init__(self, fmt: ToolFormat) -> None:
        super().__init__(fmt)
        self.state = "start"  # start | list (held until it closes) | after | text
        self.scan = _ListScan()

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.held += text
        said, deltas = self._step(last=False)
        self.content.append(said)
        return said, deltas

    def flush(self) -> str:
        said, _ = self._step(last=True)
        if self.state == "list":  # never closed (max_tokens): it was text
            said, self.held, self.state = said + self.held, "", "text"
        self.content.append(said)
        return said

    def _step(self, last: bool) -> tuple[str, list[CallDelta]]:
        said, deltas = "", []
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(PYTHON_START):
                head = head[len(PYTHON_START) :].lstrip()
            if head.startswith("["):
                self.held, self.state = head, "list"
            elif not head or (PYTHON_START.startswith(head) and not last):
                return "", []  # blanks, or maybe the tag: wait
            else:
                self.state = "text"
        if self.state == "list":
            end = self.scan.end(self.held)
            if end is None:
                return "", []
            found = _calls(self.held[:end])
            if found is None:
                self.state = "text"
            else:
                self.held, self.state = self.held[end:], "after"
                for name, args in found:
                    call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args))
                    index = len(self.calls)
                    self.calls.append(call)
                    deltas.append(CallDelta(index, call.id, call.name, call.arguments))
        if self.state == "after":  # held to the end: the end tag and blanks are not content
            if not last:
                return said, deltas
            rest = self.held.strip()
            self.held = rest.removeprefix(PYTHON_END).strip()
            self.state = "text"
        if self.state == "text":
            said, self.held = said + self.held, ""
        return said, deltas


# --- the grammar ----------------------------------------------------------------------------

VALUE_RULES = [
    "value: STRING | NUMBER | BOOL | NONE | list | dict",
    'list: "[" (value ("," " "? value)*)? "]"',
    'dict: "{" (STRING ":" " "? value ("," " "? STRING ":" " "? value)*)? "}"',
    "STRING: /\"([^\"\\\\\\n]|\\\\.)*\"/ | /'([^'\\\\\\n]|\\\\.)*'/",
    "NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/",
    'BOOL: "True" | "False"',
    'NONE: "None"',
]
"""Python literals: the values of arguments whose schema says nothing simpler."""
SCALARS = ("string", "integer", "number")
"""JSON types whose JSON text is a Python literal of the same value: held by the schema
itself (%json: lengths, patterns, bounds). A JSON string's `\\/` escape is the one a Python
literal reads otherwise (a backslash kept)."""


def _value(schema: Any) -> str:
    """A Lark expression for a value of this JSON schema written as a Python literal."""
    if not isinstance(schema, dict):
        return "value"
    enum = schema.get("enum", schema.get("const"))
    if "const" in schema:
        enum = [enum]
    if (
        isinstance(enum, list)
        and enum
        and all(isinstance(v, str | int | float | bool) or v is None for v in enum)
    ):
        spellings = {repr(v): None for v in enum}  # Python's, and a string's in "" too
        spellings |= {json.dumps(v): None for v in enum if isinstance(v, str)}
        return "(" + " | ".join(json.dumps(text) for text in spellings) + ")"
    kind = schema.get("type")
    if kind in SCALARS:
        return "%json " + json.dumps(schema)
    words = {"boolean": "BOOL", "null": "NONE", "array": "list", "object": "dict"}
    return words.get(kind, "value") if isinstance(kind, str) else "value"


def _arguments(i: int, parameters: Any) -> list[str]:
    """Rules for tool i's keyword arguments (`args_i`, None where it takes none): the
    required ones first in their order, then each optional one at most once, in order (a
    keyword given twice is not Python)."""
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict) or not props:
        return []
    required = [p for p in parameters.get("required", []) if p in props]
    optional = [p for p in props if p not in required]
    rules = []
    names = {}
    for j, (name, schema) in enumerate(props.items()):
        rules.append(f"v_{i}_{j}: {_value(schema)}")
        names[name] = f"{json.dumps(name + '=')} v_{i}_{j}"
    sep = '"," " "?'
    # rest_i_k: optional arguments k.. after another argument, each there or not (with none
    # required, one of them leads: first_i_k, so rest_i_0 is not needed)
    for k in range(0 if required else 1, len(optional)):
        name = optional[k]
        tail = f" rest_{i}_{k + 1}" if k + 1 < len(optional) else ""
        rules.append(f"rest_{i}_{k}: ({sep} {names[name]})?{tail}")
    if required:
        rest = f" rest_{i}_0" if optional else ""
        head = f" {sep} ".join(names[name] for name in required)
        rules.append(f"args_{i}: {head}{rest}")
    else:  # first_i_k: the first optional argument given is k
        for k, name in enumerate(optional):
            tail = f" rest_{i}_{k + 1}" if k + 1 < len(optional) else ""
            other = f" | first_{i}_{k + 1}" if k + 1 < len(optional) else ""
            rules.append(f"first_{i}_{k}: {names[name]}{tail}{other}")
        rules.append(f"args_{i}: first_{i}_0")
    return rules


def pythonic_grammar(
    tools: list[tuple[str, dict[str, Any]]], required: bool, parallel: bool
) -> str:
    """A Lark grammar (llguidance's) for a reply of pythonic calls to `tools` (each a name
    and its parameters' JSON schema): only calls where `required`, else text that does not
    open a list, or calls; one call unless `parallel`."""
    lines = ["%llguidance {}", *VALUE_RULES]
    calls = []
    for i, (name, parameters) in enumerate(tools):
        rules = _arguments(i, parameters)
        lines += rules
        needed = any(r.startswith(f'args_{i}: "') for r in rules)  # a required one leads
        inside = "" if not rules else f" args_{i}" if needed else f" args_{i}?"
        lines.append(f'call_{i}: {json.dumps(name + "(")}{inside} ")"')
        calls.append(f"call_{i}")
    lines.append("call: " + " | ".join(calls))
    more = ' ("," " "? call)*' if parallel else ""
    lines.append(f'calls: "[" call{more} "]"')
    if required:
        lines.append("start: calls")
    else:
        lines += ["start: calls | TEXT", "TEXT: /[ \\t\\n]*([^\\[ \\t\\n](.|\\n)*)?/"]
    return "\n".join(lines) + "\n"
