"""`pypto chat`: an interactive multi-turn chat in the terminal.

The model runs in this process (`--model`, engine flags as for `pypto generate`), or a running
OpenAI-compatible server answers (`--url`). Answers stream as they are produced. Ctrl-C
stops an answer and returns to the prompt (the answer so far stays in the conversation, as
llama-cli keeps it); at the prompt it clears the line. `/reset` starts a new conversation,
`/help` lists the commands, `/exit` (or Ctrl-D) quits. A failed answer (a server error, a
conversation grown past the context) is reported and leaves the conversation as it was.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import httpx

from pypto_serving.errors import PyptoError
from pypto_serving.flags import add_engine_flags, engine_knobs, positive_int
from pypto_serving.http_client import (
    StreamError,
    chunk_text,
    describe_error,
    error_message,
    normalize_base_url,
    sse_chunk,
)

PROMPT = ">>> "
HELP = "/reset starts a new conversation, /help shows this, /exit (or Ctrl-D) quits"
HELP_LONG = (
    "commands:\n"
    "  /reset  start a new conversation (the system prompt stays)\n"
    "  /help   this list\n"
    "  /exit   quit (also /quit, or Ctrl-D)\n"
    "Ctrl-C stops an answer and returns to the prompt; the answer so far stays in the "
    "conversation"
)
Messages = list[dict[str, str]]


class ChatError(Exception):
    """An answer failed; the session goes on."""


class ChatBackend(Protocol):
    name: str

    def reply(self, messages: Messages) -> Iterator[str]:
        """The assistant's answer to `messages`, piece by piece; raises ChatError."""
        ...


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    """Register `pypto chat` on the top-level subcommands."""
    p = sub.add_parser("chat", help="chat in the terminal (in-process, or with a server via --url)")
    p.add_argument("--system", help="a system prompt opening every conversation")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=positive_int, default=512, help="longest answer")
    p.add_argument("--seed", type=int, default=None)
    remote = p.add_argument_group("server (instead of loading the model here)")
    remote.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    remote.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $OPENAI_API_KEY)",
    )
    remote.add_argument(
        "--model-name", help="the served model's name (default: the first of GET /v1/models)"
    )
    add_engine_flags(p)


class InProcessChat:
    """The model loaded in this process; the conversation rendered by its chat template."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pypto_serving.engine.llm import LLM
        from pypto_serving.sampling import SamplingParams

        self.llm = LLM(**engine_knobs(args))
        self.name = self.llm.model_dir.name
        self.params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )

    def reply(self, messages: Messages) -> Iterator[str]:
        try:
            prompt = self.llm.chat_prompt(messages)
            yield from self.llm.stream(prompt, self.params)
        except PyptoError as e:
            raise ChatError(f"{e} (/reset starts a new conversation)") from None


class ServerChat:
    """A running server's /v1/chat/completions, streamed."""

    def __init__(
        self, args: argparse.Namespace, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.base_url = normalize_base_url(args.url, "--url")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.Client(
            transport=transport, headers=headers, timeout=httpx.Timeout(600.0, connect=10.0)
        )
        self.name = args.model_name or self.first_model()
        self.fields: dict[str, Any] = {
            "model": self.name,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "stream": True,
        }
        if args.seed is not None:
            self.fields["seed"] = args.seed

    def first_model(self) -> str:
        try:
            response = self.client.get(self.base_url + "/v1/models")
        except httpx.HTTPError as e:
            raise PyptoError(f"cannot reach the server at {self.base_url}: {e}") from None
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise PyptoError(
                f"GET {self.base_url}/v1/models answered HTTP {response.status_code} with no "
                "model; pass --model-name"
            ) from None

    def reply(self, messages: Messages) -> Iterator[str]:
        url = self.base_url + "/v1/chat/completions"
        try:
            with self.client.stream("POST", url, json={**self.fields, "messages": messages}) as r:
                if not 200 <= r.status_code < 300:
                    raise ChatError(f"HTTP {r.status_code}: {error_message(r.read())}")
                done = False
                for line in r.iter_lines():
                    piece, done = self.parse(line)
                    if done:
                        break
                    if piece:
                        yield piece
        except httpx.HTTPError as e:
            raise ChatError(f"lost the server at {self.base_url}: {e}") from None
        if not done:
            raise ChatError("the answer was cut off (the stream ended before [DONE])")

    @staticmethod
    def parse(line: str) -> tuple[str, bool]:
        """(text, stream over) of one SSE line; an error event raises ChatError."""
        try:
            chunk = sse_chunk(line)
        except StreamError as e:
            raise ChatError(f"the server sent {e}") from None
        if chunk is None or chunk == "done":
            return "", chunk == "done"
        if chunk.get("error"):
            raise ChatError(describe_error(chunk["error"]))
        return chunk_text(chunk), False

    def close(self) -> None:
        self.client.close()


class CtrlC:
    """Ctrl-C while a reply streams: noted, for the reply to stop between two pieces (the
    engine is never interrupted inside a step). Outside the main thread (no signals there)
    it notes nothing."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, *_: object) -> None:
        self.pressed = True

    def __exit__(self, *_: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def answer(backend: ChatBackend, messages: Messages) -> str | None:
    """Stream the reply to stdout; the whole reply (or what came before Ctrl-C stopped it),
    or None (and a message) if it failed."""
    pieces: list[str] = []
    with CtrlC() as ctrl_c:
        replies = backend.reply(messages)
        try:
            for piece in replies:
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
                if ctrl_c.pressed:
                    break
        except ChatError as e:
            sys.stdout.write(("\n" if pieces else "") + f"[error: {e}]\n")
            return None
        finally:
            close = getattr(replies, "close", None)
            if close is not None:
                close()  # a stopped reply: the request is aborted
    sys.stdout.write("\n[stopped]\n" if ctrl_c.pressed else "\n")
    return "".join(pieces) if pieces or not ctrl_c.pressed else None


def chat_loop(backend: ChatBackend, system: str | None) -> int:
    """Read user lines until /exit or end of input; every answer sees the conversation so far."""
    opening: Messages = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    sys.stdout.write(f"chatting with {backend.name} ({HELP})\n")
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            sys.stdout.write("\n")
            return 0
        except KeyboardInterrupt:  # clears the line, as a shell's prompt does
            sys.stdout.write("\n")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/help":
            sys.stdout.write(HELP_LONG + "\n")
            continue
        if text == "/reset":
            messages = list(opening)
            sys.stdout.write("[new conversation]\n")
            continue
        if text.startswith("/"):
            sys.stdout.write(f"[unknown command {text.split()[0]}: {HELP}]\n")
            continue
        if not text:
            continue
        user = {"role": "user", "content": text}
        reply = answer(backend, [*messages, user])
        if reply is not None:
            messages += [user, {"role": "assistant", "content": reply}]


def run_chat(args: argparse.Namespace, transport: httpx.BaseTransport | None = None) -> int:
    """`pypto chat`; `transport` replaces the network in URL mode (tests pass a fake server)."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per answer

    if args.url is None:
        return chat_loop(InProcessChat(args), args.system)
    backend = ServerChat(args, transport)
    try:
        return chat_loop(backend, args.system)
    finally:
        backend.close()
