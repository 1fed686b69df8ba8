"""The reasoning splitter (--reasoning-parser): thinking and content as vLLM's qwen3 and
deepseek_r1 parsers split them, the same however the reply is cut into streamed pieces."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pypto_serving.server.reasoning import ReasoningSplitter


def whole(parser: str, text: str, prompt_opens: bool = False) -> tuple[str, str]:
    return ReasoningSplitter(parser, prompt_opens).feed(text, last=True)


@pytest.mark.parametrize(
    ("parser", "prompt_opens", "reply", "split"),
    [
        ("qwen3", False, "<think>\nhmm, two\n</think>\n\nIt is 2.", ("hmm, two\n", "It is 2.")),
        ("qwen3", False, "It is 2.", ("", "It is 2.")),  # thinking off
        ("qwen3", False, "It is </think> 2.", ("", "It is </think> 2.")),
        ("qwen3", True, "hmm</think>\n\nIt is 2.", ("hmm", "It is 2.")),  # the prompt opened it
        ("qwen3", False, "<think>never closed", ("never closed", "")),
        ("deepseek_r1", False, "hmm</think>It is 2.", ("hmm", "It is 2.")),
        ("deepseek_r1", False, "<think>hmm</think>\nIt is 2.", ("hmm", "It is 2.")),
        ("deepseek_r1", False, "all thinking", ("all thinking", "")),
        ("qwen3", False, "<thi", ("", "<thi")),  # not the tag after all
        ("qwen3", False, "", ("", "")),
    ],
)
def test_replies_split_as_vllms_parsers_split_them(parser, prompt_opens, reply, split):
    assert whole(parser, reply, prompt_opens) == split


replies = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "\n", "a", "b c", "é"]),
    max_size=14,
).map("".join)


@given(
    parser=st.sampled_from(["qwen3", "deepseek_r1"]),
    prompt_opens=st.booleans(),
    reply=replies,
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_streamed_pieces_reassemble_to_the_whole_split(parser, prompt_opens, reply, cuts):
    bounds = sorted({0, len(reply), *(c % (len(reply) + 1) for c in cuts)})
    splitter = ReasoningSplitter(parser, prompt_opens)
    thought, said = "", ""
    pieces = [reply[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, last=i == len(pieces) - 1)
        thought, said = thought + r, said + c
    assert (thought, said) == whole(parser, reply, prompt_opens)
