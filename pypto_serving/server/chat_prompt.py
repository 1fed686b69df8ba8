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

from typing import Any

from pypto_serving.errors import PyptoError


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
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template: str | None = None,
    parse_special: bool = False,
) -> list[int]:
    """Token ids of `messages` (and `tools`) in `template` (None: the tokenizer's own). Only
    the template's control tokens are control tokens, unless `parse_special`: then those
    written in the messages and tools are too. A conversation the template rejects is a 400
    naming messages."""
    try:
        out = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=not parse_special,
        )
    except Exception as e:  # the template itself may reject a conversation
        raise PyptoError(f"the chat template rejected the messages: {e}", "messages") from None
    return list(out["input_ids"] if isinstance(out, dict) else out)
