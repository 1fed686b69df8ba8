"""Token ids -> text, incrementally, with stop strings.

Decoding is incremental (only a short window of ids is decoded per token, so cost does not
grow with the output) and never splits a multi-byte character: text is released only once
it no longer ends in the replacement character. Text that could be the start of a stop
string is held back until it is clear it is not one.
"""

from __future__ import annotations

from typing import Any

from pypto_serving.sampling import SamplingParams


class TextAssembler:
    """The text of one output sequence, grown token by token."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop = params.stop
        self.keep_stop = params.include_stop_str_in_output
        self.skip_special = params.skip_special_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.num_tokens = 0
        """Output tokens added so far."""

    def add(self, token_id: int) -> None:
        """Append a token; sets `stopped` (and cuts the text) when a stop string appears."""
        self.ids.append(token_id)
        self.num_tokens += 1
        decode, skip = self.tokenizer.decode, self.skip_special
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(len(self.text) - self.holdback, 0)
        self.text += delta
        hits = [(at, len(s)) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if hits:
            at = min(a for a, _ in hits)  # the earliest stop string ends the text
            if self.keep_stop:  # and stays, the longest where two start together
                at += max(n for a, n in hits if a == at)
            self.text, self.stopped = self.text[:at], True

    def take(self, final: bool) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless final."""
        end = len(self.text) if final or self.stopped else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : end], end
        return out
