"""The model's reply split into content and tool calls, as it streams.

`ToolCallParser.feed` takes the reply's text piece by piece and returns what is new: content
text, and call deltas in OpenAI's streaming shape (a call's first delta carries its id and
name, the next ones pieces of its arguments as the model writes them). A whole reply is the
same pieces fed at once, so a streamed call reassembles to exactly the call a non-streamed
response holds. Arguments are the model's own JSON text for them (held to the tool's schema
by the grammar, see tools.py).

Text that might be the start of the format's opening tag (`<tool_call>`, `[TOOL_CALLS]`) is
held back until it is clear it is not; whitespace between and after calls is not content. A
format without tags (llama3_json) calls where the reply's first character is `{` (and after
each `;` that follows a call); otherwise the whole reply is content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pypto_serving.server.tools import ToolFormat


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: its id and name (first piece), or more of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_dict(self) -> dict[str, object]:
        function: dict[str, object] = {"arguments": self.arguments}
        if self.name is None:
            return {"index": self.index, "function": function}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, **function},
        }


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class _Call:
    """The call object being read: its keys, name and arguments as they come."""

    index: int
    key: str | None = None
    after_colon: bool = False
    reading_key: bool = False
    id: str = ""
    name: str | None = None
    args: str = ""
    args_state: str = "none"  # none | open (being read) | done
    args_bare: bool = False
    """The arguments are a bare value (a number, true, null): they end at the next , or }."""
    sent: int = 0
    """Characters of `args` already returned (they wait for the name)."""


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.call_depth = 2 if fmt.list_body else 1
        """How deep a call object sits in its block: in a list (smollm2), or the block itself."""
        self._fresh = True
        """Nothing has been said yet: a format without tags may still open a call."""
        self.mode = "text"  # text | body (a block's JSON) | close (its closing tag)
        self.held = ""
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self._call: _Call | None = None
        self._count = 0
        self._depth = 0
        self._in_string = self._escape = False
        self._string: list[str] = []
        self._out: list[CallDelta] = []

    # --- public -------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and call deltas that `text`, the reply's next piece, completes."""
        content: list[str] = []
        self.held += text
        while self.held:
            if self.mode == "text":
                waiting = self._text(content)
            elif self.mode == "body":
                waiting = self._body()
            else:
                waiting = self._close()
            if waiting:
                break
        out, self._out = self._out, []
        said = "".join(content)
        self.content.append(said)
        return said, _merged(out)

    def flush(self) -> str:
        """Content held back at the end of the reply (the start of a tag that never came). A
        call cut off (max_tokens) stands as far as it was streamed."""
        text = self.mode == "text" and (self.held.strip() or not self.calls)
        said = self.held if text else ""
        self.held = ""
        call = self._call
        if call is not None and call.name is not None:  # cut off (max_tokens): as streamed
            self.calls.append(ToolCall(call.id, call.name, call.args[: call.sent]))
            self._call = None
        self.content.append(said)
        return said

    def message_content(self) -> str | None:
        """The reply's content for a whole message: None where it only called tools."""
        text = "".join(self.content)
        return None if self.calls and not text.strip() else text

    # --- modes (each returns True where it waits for more text) ------------------------------

    def _text(self, content: list[str]) -> bool:
        tag = self.fmt.open
        if tag:
            at, hold = self.held.find(tag), _held_prefix(self.held, tag)
        else:  # a call opens the reply, at its first character (or follows a separator)
            if self._fresh and self.calls:  # after `;`: the whitespace before the next call
                self.held = self.held.lstrip()
                if not self.held:
                    return True
            at, hold = (0 if self._fresh and self.held.startswith("{") else -1), 0
        if at < 0:
            keep = len(self.held) - hold
            said = self.held[:keep]
            if said.strip() or not self.calls:  # after a call, whitespace alone waits
                content.append(said)
                self.held = self.held[keep:]
                self._fresh = self._fresh and not said
            return True
        before = self.held[:at]
        if before.strip() or not self.calls:
            content.append(before)
        self.held = self.held[at + len(tag) :]
        self.mode, self._depth = "body", 0
        return False

    def _close(self) -> bool:
        text = self.held.lstrip()
        end, separator = self.fmt.close, self.fmt.separator
        if end and text.startswith(end):
            self.held, self.mode = text[len(end) :], "text"
            return False
        if separator and text.startswith(separator):  # another call follows
            self.held, self.mode, self._fresh = text[len(separator) :].lstrip(), "text", True
            return False
        expected = end or separator
        if expected and expected.startswith(text):  # (the start of) what comes next: wait
            return True
        self.mode, self._fresh = "text", False  # no closing tag: what follows is text
        return False

    def _body(self) -> bool:
        text, self.held = self.held, ""
        for i, ch in enumerate(text):
            if self._char(ch):
                self.held, self.mode = text[i + 1 :], "close"
                return False
        return True

    # --- a block's JSON, one character at a time ---------------------------------------------

    def _char(self, ch: str) -> bool:
        """Read one character of the block's JSON; True where it ends the block's value."""
        call = self._call
        level = call is not None and self._depth == self.call_depth
        if self._in_string:
            if call is not None and call.args_state == "open":
                call.args += ch
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if call is not None and level:
                    self._string_done(call, "".join(self._string))
            if self._in_string and level:
                self._string.append(ch)
            self._send(call)
            return False
        if call is not None and call.args_state == "open":
            if call.args_bare and level and ch in ",}":
                call.args_state = "done"
            else:
                call.args += ch
        if ch == '"':
            self._in_string, self._string = True, []
            if call is not None and level:
                self._value_starts(call, ch, bare=False)
        elif ch in "{[":
            if ch == "{" and self._depth == self.call_depth - 1:
                self._call = _Call(self._count)
                self._count += 1
            elif call is not None and level:
                self._value_starts(call, ch, bare=False)
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if call is not None:
                if call.args_state == "open" and self._depth == self.call_depth:
                    call.args_state = "done"
                elif self._depth == self.call_depth - 1:
                    self._call_done(call)
            self._send(call)
            return self._depth == 0
        elif call is not None and level:
            if ch == ":":
                call.after_colon = True
            elif ch == ",":
                call.key, call.after_colon = None, False
            elif not ch.isspace():
                self._value_starts(call, ch, bare=True)
        self._send(call)
        return False

    def _value_starts(self, call: _Call, ch: str, bare: bool) -> None:
        """A character at the call's own level: a key's opening quote, or a value's start."""
        if not call.after_colon:
            call.reading_key = ch == '"'
            return
        call.after_colon, call.reading_key = False, False
        if call.key == self.fmt.arguments and call.args_state == "none":
            call.args_state, call.args, call.args_bare = "open", ch, bare

    def _string_done(self, call: _Call, text: str) -> None:
        if call.reading_key:
            call.key, call.reading_key = text, False
        elif call.args_state == "open" and not call.args_bare and call.args.startswith('"'):
            call.args_state = "done"
        elif call.key == "name" and call.name is None:
            call.id, call.name = f"call_{uuid.uuid4().hex[:24]}", text
            self._out.append(CallDelta(call.index, call.id, text))

    def _send(self, call: _Call | None) -> None:
        """Return the arguments read so far, once the call's name is out (whitespace that may
        end a bare value waits)."""
        if call is None or call.name is None:
            return
        shown = call.args if call.args_state == "done" else call.args.rstrip()
        if len(shown) > call.sent:
            self._out.append(CallDelta(call.index, arguments=shown[call.sent :]))
            call.sent = len(shown)

    def _call_done(self, call: _Call) -> None:
        if call.args_state == "open":  # a bare value ended by the call's }
            call.args_state = "done"
        call.args = call.args.strip()
        self._send(call)
        if call.name is not None:
            self.calls.append(ToolCall(call.id, call.name, call.args or "{}"))
        self._call = None


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive argument pieces of one call as one delta."""
    out: list[CallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and d.name is None:
            last.arguments += d.arguments
        else:
            out.append(CallDelta(d.index, d.id, d.name, d.arguments))
    return out
