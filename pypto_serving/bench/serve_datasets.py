"""Workloads of `pypto bench serve`: random, shared-prefix and multi-turn sessions, and the
chat prompts of speculative decoding's `echo` and `open` workloads (`datasets.WORKLOADS`).

Every workload is a list of `Session`s: one request each for `random`, `shared-prefix`,
`echo` and `open`,
`turns` requests for `multi-turn` (whose prompts grow with the server's replies, added by the
client as it goes). Prompts are built from seeded random token ids of the model's vocabulary
(`bench/datasets.py`): sent as token ids to the completions endpoint (exact lengths), decoded
to text for the chat endpoint (re-tokenized by the server, so lengths are approximate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pypto_serving.bench.datasets import WORKLOADS, chat_prompts, random_prompts
from pypto_serving.errors import PyptoError

DATASETS = ("random", "shared-prefix", "multi-turn", *WORKLOADS)
SUFFIX_SEED_OFFSET = 1
"""The unique suffixes of shared-prefix draw from seed + 1 (the prefix from seed)."""


@dataclass(slots=True)
class Session:
    """The requests one client sends in order (one, or the user turns of a conversation)."""

    index: int
    user_turns: list[Any]
    """Completions: the prompt (token ids or text); chat: the user message text per turn."""
    prompt_lens: list[int]
    """Prompt tokens per turn as built here (the fallback when a server reports no usage)."""
    output_len: int
    prefix_messages: list[dict[str, str]] = field(default_factory=list)
    """Chat messages sent before the first user message (shared-prefix: the system prompt)."""


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


def random_sessions(
    tokenizer: Any,
    vocab: Sequence[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    chat: bool,
) -> list[Session]:
    """`num_prompts` single requests of `input_len` random tokens (text for chat)."""
    prompts = random_prompts(vocab, num_prompts, input_len, seed)
    return [
        Session(i, [decode(tokenizer, p) if chat else p], [input_len], output_len)
        for i, p in enumerate(prompts)
    ]


def shared_prefix_sessions(
    tokenizer: Any,
    vocab: Sequence[int],
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int,
    chat: bool,
) -> list[Session]:
    """One shared prefix of `prefix_len` tokens + a unique suffix of `input_len` per request.

    Completions get prefix + suffix as token ids; chat gets the prefix as a system message and
    the suffix as the user message."""
    prefix = random_prompts(vocab, 1, prefix_len, seed)[0] if prefix_len else []
    suffixes = random_prompts(vocab, num_prompts, input_len, seed + SUFFIX_SEED_OFFSET)
    total = prefix_len + input_len
    if not chat:
        return [Session(i, [prefix + s], [total], output_len) for i, s in enumerate(suffixes)]
    system = [{"role": "system", "content": decode(tokenizer, prefix)}] if prefix else []
    return [
        Session(i, [decode(tokenizer, s)], [total], output_len, list(system))
        for i, s in enumerate(suffixes)
    ]


def multi_turn_sessions(
    tokenizer: Any,
    vocab: Sequence[int],
    num_conversations: int,
    turns: int,
    input_len: int,
    output_len: int,
    seed: int,
) -> list[Session]:
    """`num_conversations` chats of `turns` user messages of ~`input_len` random tokens each.

    `prompt_lens` counts the user text and the replies expected so far (`output_len` each)."""
    texts = [
        decode(tokenizer, ids)
        for ids in random_prompts(vocab, num_conversations * turns, input_len, seed)
    ]
    lens = [t * (input_len + output_len) + input_len for t in range(turns)]
    return [
        Session(c, texts[c * turns : (c + 1) * turns], list(lens), output_len)
        for c in range(num_conversations)
    ]


def workload_sessions(
    tokenizer: Any, workload: str, num_prompts: int, output_len: int, chat: bool
) -> list[Session]:
    """`num_prompts` requests going round a workload's chat prompts (`echo`: a given text
    asked back; `open`: new text): the user message for chat, its chat-template token ids
    for completions."""
    texts, ids = WORKLOADS[workload], chat_prompts(tokenizer, workload)
    return [
        Session(
            i,
            [texts[i % len(texts)] if chat else ids[i % len(ids)]],
            [len(ids[i % len(ids)])],
            output_len,
        )
        for i in range(num_prompts)
    ]


def check_dataset(name: str, endpoint: str) -> None:
    if name not in DATASETS:
        raise PyptoError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if name == "multi-turn" and endpoint != "chat":
        raise PyptoError("--dataset multi-turn needs --endpoint chat (it sends conversations)")


def default_endpoint(dataset: str) -> str:
    return "chat" if dataset in ("multi-turn", *WORKLOADS) else "completions"
