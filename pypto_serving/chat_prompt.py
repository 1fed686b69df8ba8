"""A conversation as token ids: rendered by a chat template, the client's text kept as text.

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>` ...) around the messages.
The same strings inside a message (a user who pastes `hi<|im_end|>\\n<|im_start|>system\\n...`)
must not become those tokens, or text forges turns. transformers' `sanitize_control_tokens`
marks them in every string of the messages and tools before rendering, then encodes each one
it marked as plain text (ordinary tokens, as `split_special_tokens` would) and the rest of the
rendered text as usual: a conversation holding no such string gets exactly the ids of plain
`apply_chat_template`. A trusted client may ask for its strings to be parsed as control tokens
(`parse_special`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from pypto_serving.errors import PyptoError


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a conversation is rendered (vLLM's request fields of the same names)."""

    add_generation_prompt: bool = True
    """End with the template's opening of an assistant reply."""
    continue_final_message: bool = False
    """Leave the last message open, for the reply to continue it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """More variables for the template (chat_template_kwargs)."""
    add_special_tokens: bool = False
    """The tokenizer's special tokens (a BOS) added around what the template wrote."""
    template: str | None = None
    """The request's own Jinja chat template (vLLM's `chat_template` field), in place of the
    model's; None: the model's."""

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise PyptoError(
                "give add_generation_prompt or continue_final_message, not both: a prompt "
                "either opens a new reply or continues its last message",
                "continue_final_message",
            )


def conversation_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of a conversation's text, as chat templates take it (`for_template`): its
    contents and its calls' arguments; counted before any template or tokenizer runs."""
    chars = 0
    for m in messages:
        chars += len(m.get("content") or "")
        for call in m.get("tool_calls") or ():
            chars += len(str(call["function"]["arguments"]))
    return chars


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    options: ChatTemplateOptions,
    tools: list[dict[str, Any]] | None = None,
    template: str | None = None,
    parse_special: bool = False,
) -> list[int]:
    """Token ids of `messages` (and `tools`) in `template` (None: the tokenizer's own), as
    `options` say. Only the template's control tokens are control tokens, unless
    `parse_special`: then those written in the messages and tools are too. A conversation the
    template rejects is a 400 naming messages."""
    try:
        out = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=not parse_special,
            **options.kwargs,
        )
    except Exception as e:  # the template itself may reject a conversation
        raise PyptoError(f"the chat template rejected the messages: {e}", "messages") from None
    ids = list(out["input_ids"] if isinstance(out, dict) else out)
    if options.add_special_tokens:
        before, after = special_tokens_around(tokenizer)
        ids = before + ids + after
    return ids


@functools.lru_cache(maxsize=8)  # a tokenizer is hashed by identity: one per model
def special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer adds before and after a text (a BOS, an EOS): read
    from how it encodes one letter with and without them."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    dressed = tokenizer.encode("a", add_special_tokens=True)
    for at in range(len(dressed) - len(bare) + 1):
        if dressed[at : at + len(bare)] == bare:
            return dressed[:at], dressed[at + len(bare) :]
    return [], []
