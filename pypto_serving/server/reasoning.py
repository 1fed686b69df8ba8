"""A reasoning model's thinking split out of its reply, as it streams (vLLM's
--reasoning-parser): the text between `<think>` and `</think>` is the message's `reasoning`,
the rest its content (where tool calls are then read).

Both formats served here write their thinking in those tags:
- `qwen3` (Qwen3, QwQ and their kin): the reply thinks where it opens with `<think>`, or where
  the prompt left a `<think>` open (the thinking variants' templates do); otherwise it is all
  content (thinking off: `chat_template_kwargs: {"enable_thinking": false}`);
- `deepseek_r1` (DeepSeek-R1 and its distillations): the reply always starts thinking (its
  template opens the tag in the prompt; a `<think>` the model writes anyway is dropped), up
  to `</think>`; a reply that never closes it is all reasoning.

`ReasoningSplitter.feed` returns what is new of each part, holding back text that might be
the start of a tag until it is clear it is not; the newlines that follow `</think>` are not
content. A whole reply is the same pieces fed at once, so a stream reassembles to exactly the
message a non-streamed response holds.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def _partial_tag_at_end(text: str, tag: str) -> int:
    """How many characters at the end of `text` might begin `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ReasoningSplitter:
    parser: str
    """`qwen3` or `deepseek_r1` (config.REASONING_PARSERS)."""
    prompt_opens_thinking: bool = False
    """The rendered prompt ends with an open `<think>`."""
    state: str = "start"
    """start (the reply's first characters: a `<think>` may come) | thinking | after (the
    newlines after `</think>`) | content."""
    held: str = ""

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """The new (reasoning, content) text of a piece of the reply; `last`: the reply ends
        with it (nothing is held back)."""
        text, self.held = self.held + text, ""
        reasoning, content = [], []
        while text:
            if self.state == "start":
                if OPEN.startswith(text) and not last:  # still maybe the tag
                    self.held = text
                    break
                thinking = self.parser == "deepseek_r1" or self.prompt_opens_thinking
                if text.startswith(OPEN):
                    text, thinking = text[len(OPEN) :].lstrip("\n"), True
                self.state = "thinking" if thinking else "content"
            elif self.state == "thinking":
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self.state = text[end + len(CLOSE) :], "after"
                    continue
                keep = 0 if last else _partial_tag_at_end(text, CLOSE)
                reasoning.append(text[: len(text) - keep])
                self.held = text[len(text) - keep :]
                break
            elif self.state == "after":
                text = text.lstrip("\n")
                if text:
                    self.state = "content"
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)
