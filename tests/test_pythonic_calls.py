"""Pythonic tool calls (vLLM's `pythonic` parser, Llama 3.2's and 4's format): a reply that is
a Python list of calls is read with Python's own parser, streamed or whole alike; the grammar
holds required and named calls to the tools' names, parameters and value types."""

from __future__ import annotations

import itertools
import json

import pytest
from checkpoints import build_tokenizer
from hypothesis import given
from hypothesis import strategies as st

from pypto_serving.server.pythonic_calls import call_parser, pythonic_grammar
from pypto_serving.server.tools import PYTHONIC

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["paris", "rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["city"],
}
OPTIONS = {"type": "object", "properties": {"fast": {"type": "boolean"}, "tags": {"type": "array"}}}
TOOLS = [("get_weather", WEATHER), ("options", OPTIONS), ("now", {})]


def whole(reply: str) -> tuple[str | None, list[tuple[str, dict]]]:
    parser = call_parser(PYTHONIC)
    parser.feed(reply)
    parser.flush()
    return parser.message_content(), [(c.name, json.loads(c.arguments)) for c in parser.calls]


@pytest.mark.parametrize(
    ("reply", "content", "calls"),
    [
        (
            "[get_weather(city='paris', days=3), now()]",
            None,
            [("get_weather", {"city": "paris", "days": 3}), ("now", {})],
        ),
        (
            '<|python_start|>[f(x=[1, {"a": None, "b": True}], y="a]b")]<|python_end|>',
            None,
            [("f", {"x": [1, {"a": None, "b": True}], "y": "a]b"})],
        ),
        ("  [now()]\n", None, [("now", {})]),
        ("[now()] and then some", "and then some", [("now", {})]),
        ("It is 4.", "It is 4.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),  # a list, but not of calls
        ("[f(1)]", "[f(1)]", []),  # positional arguments: not a call to a tool
        ("[f(x=1, x=2)]", "[f(x=1, x=2)]", []),  # not Python
        ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set: no JSON for it
        ("[f(x=1", "[f(x=1", []),  # cut off (max_tokens): text
        ("<|python_sta", "<|python_sta", []),
    ],
)
def test_replies_read_as_lists_of_calls_or_text(reply, content, calls):
    assert whole(reply) == (content, calls)


replies = st.lists(
    st.sampled_from(
        [
            "[",
            "]",
            "get_weather(",
            "now()",
            "city='paris'",
            ", ",
            ")",
            "x=[1, 2]",
            "'a]'",
            "<|python_start|>",
            "<|python_end|>",
            " ",
            "\n",
            "text",
        ]
    ),
    max_size=12,
).map("".join)


@given(reply=replies, cuts=st.lists(st.integers(0, 200), max_size=6))
def test_streamed_pieces_reassemble_to_the_whole_reply(reply, cuts):
    bounds = sorted({0, len(reply), *(c % (len(reply) + 1) for c in cuts)})
    parser = call_parser(PYTHONIC)
    said, calls = "", {}
    for a, b in itertools.pairwise(bounds):
        text, deltas = parser.feed(reply[a:b])
        said += text
        for d in deltas:
            calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    said += parser.flush()
    content, expected = whole(reply)
    assert said == (content or "") or (content is None and not said.strip())
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == expected


def test_the_grammar_admits_only_calls_to_the_tools_as_their_schemas_say(tmp_path):
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    vocab = llguidance.hf.from_tokenizer(hf)

    def admits(text: str, required: bool = True, parallel: bool = True) -> bool:
        matcher = llguidance.LLMatcher(vocab, pythonic_grammar(TOOLS, required, parallel))
        return all(matcher.consume_token(t) for t in hf.encode(text)) and matcher.is_accepting()

    good = "[get_weather(city='paris', days=3), options(tags=[1, 'a']), now()]"
    assert admits(good)
    assert whole(good)[1] == [
        ("get_weather", {"city": "paris", "days": 3}),
        ("options", {"tags": [1, "a"]}),
        ("now", {}),
    ]
    assert admits('[get_weather(city="rome", note="short")]')  # a JSON string is Python's too
    assert admits("[options()]") and admits("[options(fast=False)]")
    assert not admits("[get_weather(days=3)]")  # city is required
    assert not admits("[get_weather(city='oslo')]")  # not in the enum
    assert not admits("[get_weather(city='paris', days=9)]")  # over the maximum
    assert not admits("[get_weather(city='paris', note='far too long')]")  # maxLength
    assert not admits("[options(fast=True, fast=False)]")  # a keyword once
    assert not admits("[options(fast=true)]")  # Python's True, not JSON's
    assert not admits("[get_time()]")  # no such tool
    assert not admits("[now(), now()]", parallel=False)
    assert not admits("sure: [now()]")  # required: calls only
    assert admits("sure, no calls", required=False)
    assert admits("[now()]", required=False)
    assert not admits("[not a call]", required=False)
