"""The client side of the OpenAI-compatible HTTP API, shared by `pypto chat --url` and
`pypto bench serve`: base URLs, error bodies, and the lines of a streamed (SSE) answer.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pypto_serving.errors import PyptoError

MAX_ERROR_CHARS = 300


def normalize_base_url(url: str, flag: str = "--base-url") -> str:
    """`http://host:port` from what a user may type (a trailing / or /v1 is dropped)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise PyptoError(f"{flag} must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def error_message(body: bytes) -> str:
    """The message of an error response: OpenAI's {"error": {"message"}} or the raw text."""
    text = body.decode(errors="replace").strip()
    try:
        err = json.loads(text).get("error", text)
    except (json.JSONDecodeError, AttributeError):
        err = text
    return describe_error(err)


def describe_error(err: object) -> str:
    """One short line from an error value: OpenAI's {"message": ...} object, or anything."""
    message = str(err.get("message", err)) if isinstance(err, dict) else str(err)
    message = " ".join(message.split()) or "(empty body)"
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries (completions: choices[].text; chat: delta.content)."""
    pieces = []
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str):
            pieces.append(text)
    return "".join(pieces)


class StreamError(Exception):
    """The response stream says or shows that the request failed."""


def sse_chunk(line: str) -> dict[str, Any] | Literal["done"] | None:
    """One line of an OpenAI SSE stream: its JSON chunk, "done" for `data: [DONE]`, None for
    any other line. StreamError when the data is not a JSON object."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return "done"
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise StreamError(f"invalid JSON in the stream: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise StreamError(f"invalid chunk in the stream: {data[:80]!r}")
    return chunk
