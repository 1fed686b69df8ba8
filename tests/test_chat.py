"""`pypto chat`: in-process with a tiny model, and against a fake server (httpx.MockTransport)."""

from __future__ import annotations

import argparse
import io
import json
from typing import Any

import httpx
import pytest

from pypto_serving.chat import PROMPT, add_chat_parser, run_chat
from pypto_serving.engine.llm import LLM
from pypto_serving.errors import PyptoError

FAST = ["--enforce-eager", "--dtype", "float32", "--num-kv-pages", "16", "--page-size", "16"]


def chat_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pypto")
    add_chat_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["chat", *flags])


def feed(monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))


def test_in_process_chat_keeps_the_conversation(tiny_model, monkeypatch, capsys):
    seen: list[list[dict[str, str]]] = []
    rendered: list[list[int]] = []
    chat_prompt = LLM.chat_prompt

    def spy(self: LLM, messages: list[dict[str, str]]) -> list[int]:
        seen.append([dict(m) for m in messages])
        rendered.append(chat_prompt(self, messages))
        return rendered[-1]

    monkeypatch.setattr(LLM, "chat_prompt", spy)
    feed(monkeypatch, "hello there", "and then?", "/reset", "again", "/exit", "never read")
    args = chat_args(
        *("--model", str(tiny_model("llama-gqa4-tied")), *FAST),
        *("--temperature", "0", "--max-tokens", "5", "--system", "be brief"),
    )
    assert run_chat(args) == 0
    out = capsys.readouterr().out
    system = {"role": "system", "content": "be brief"}
    assert len(seen) == 3
    assert seen[0] == [system, {"role": "user", "content": "hello there"}]
    first_reply = seen[1][2]
    assert first_reply["role"] == "assistant" and first_reply["content"] in out
    assert seen[1] == [*seen[0], first_reply, {"role": "user", "content": "and then?"}]
    assert rendered[1][: len(rendered[0])] == rendered[0]  # the second prompt extends the first
    assert seen[2] == [system, {"role": "user", "content": "again"}]  # /reset forgot it all
    assert "[new conversation]" in out and out.count(PROMPT) == 5


def test_in_process_chat_ends_at_end_of_input(tiny_model, monkeypatch, capsys):
    feed(monkeypatch, "hi")
    args = chat_args("--model", str(tiny_model("llama-gqa4-tied")), *FAST, "--max-tokens", "3")
    assert run_chat(args) == 0
    assert capsys.readouterr().out.count(PROMPT) == 2


class FakeChatServer:
    """/v1/models and a streamed /v1/chat/completions; request i gets `behaviour(i)`."""

    def __init__(self, behaviour: Any = lambda i: "ok") -> None:
        self.behaviour = behaviour
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        body = json.loads(request.content)
        i = len(self.bodies)
        self.bodies.append(body)
        self.headers.append(request.headers)
        kind = self.behaviour(i)
        if kind == "http400":
            error = {"message": "the prompt is too long", "type": "invalid_request_error"}
            return httpx.Response(400, json={"error": error})
        words = [f"answer{i} ", "in ", "parts"]
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
        if kind == "error-event":
            events = [*events[:2], {"error": {"message": "engine died", "type": "x"}}]
        lines = [f"data: {json.dumps(e)}\n\n" for e in events]
        if kind != "cut":
            lines.append("data: [DONE]\n\n")
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content="".join(lines).encode()
        )


def test_server_chat_streams_and_sends_the_history(monkeypatch, capsys):
    server = FakeChatServer()
    feed(monkeypatch, "first question", "second question")
    args = chat_args(
        *("--url", "http://fake:8000/v1/", "--api-key", "sk-1", "--temperature", "0"),
        *("--max-tokens", "7", "--seed", "3"),
    )
    assert run_chat(args, httpx.MockTransport(server.handle)) == 0
    out = capsys.readouterr().out
    assert "chatting with served" in out and "answer0 in parts\n" in out
    first, second = server.bodies
    assert first["messages"] == [{"role": "user", "content": "first question"}]
    assert second["messages"] == [
        *first["messages"],
        {"role": "assistant", "content": "answer0 in parts"},
        {"role": "user", "content": "second question"},
    ]
    assert (first["model"], first["stream"], first["max_tokens"]) == ("served", True, 7)
    assert (first["temperature"], first["seed"]) == (0, 3)
    assert server.headers[0]["authorization"] == "Bearer sk-1"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("http400", "[error: HTTP 400: the prompt is too long]"),
        ("error-event", "[error: engine died]"),
        ("cut", "[error: the answer was cut off"),
    ],
)
def test_server_error_is_reported_and_the_session_goes_on(monkeypatch, capsys, kind, message):
    server = FakeChatServer(lambda i: kind if i == 0 else "ok")
    feed(monkeypatch, "doomed question", "next question", "/exit")
    args = chat_args("--url", "http://fake:8000", "--model-name", "mine")
    assert run_chat(args, httpx.MockTransport(server.handle)) == 0
    out = capsys.readouterr().out
    assert message in out and "answer1 in parts" in out
    # the failed exchange is not part of the conversation
    assert server.bodies[1]["messages"] == [{"role": "user", "content": "next question"}]
    assert server.bodies[1]["model"] == "mine"


def test_unreachable_server_is_a_clear_error(monkeypatch):
    feed(monkeypatch, "hi")
    with pytest.raises(PyptoError, match=r"cannot reach the server at http://127\.0\.0\.1:1"):
        run_chat(chat_args("--url", "http://127.0.0.1:1"))


def test_unknown_command_is_not_sent(monkeypatch, capsys):
    server = FakeChatServer()
    feed(monkeypatch, "/hepl", "/exit")
    assert run_chat(chat_args("--url", "http://fake"), httpx.MockTransport(server.handle)) == 0
    assert not server.bodies and "unknown command /hepl" in capsys.readouterr().out


def test_ctrl_c_stops_a_reply_and_returns_to_the_prompt(tiny_model, monkeypatch, capsys):
    """A real SIGINT while an in-process answer streams: the answer stops after the piece it
    was pressed during, its request is aborted (the engine holds nothing), the answer so far
    stays in the conversation, and the next question is answered."""
    import os
    import signal

    from pypto_serving import chat

    seen: list[list[dict[str, str]]] = []
    llms: list[LLM] = []
    stream = LLM.stream

    def pressed_after_first_piece(self: LLM, prompt: Any, params: Any) -> Any:
        llms.append(self)
        pieces = stream(self, prompt, params)
        yield next(pieces)
        if len(llms) == 1:  # the first answer only
            os.kill(os.getpid(), signal.SIGINT)
        yield from pieces

    chat_prompt = LLM.chat_prompt

    def spy(self: LLM, messages: list[dict[str, str]]) -> list[int]:
        seen.append([dict(m) for m in messages])
        return chat_prompt(self, messages)

    before = signal.getsignal(signal.SIGINT)  # default, or ignored in a background job
    monkeypatch.setattr(LLM, "stream", pressed_after_first_piece)
    monkeypatch.setattr(LLM, "chat_prompt", spy)
    feed(monkeypatch, "tell me a long story", "and then?", "/exit")
    args = chat_args(
        *("--model", str(tiny_model("llama-gqa4-tied")), *FAST),
        *("--temperature", "0", "--max-tokens", "40"),
    )
    assert run_chat(args) == 0
    out = capsys.readouterr().out
    assert "[stopped]" in out and out.count(PROMPT) == 3
    assert not llms[0].engine.has_unfinished()  # the stopped request was aborted
    stopped = seen[1][1]
    assert stopped["role"] == "assistant" and stopped["content"]  # the answer so far is kept
    assert signal.getsignal(signal.SIGINT) is before  # restored
    assert chat.HELP in out


def test_ctrl_c_at_the_prompt_clears_the_line_and_help_lists_the_commands(monkeypatch, capsys):
    from pypto_serving import chat

    answers = iter(["/help", KeyboardInterrupt(), "/exit"])

    def typed(prompt: str) -> str:
        item = next(answers)
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr("builtins.input", typed)
    server = FakeChatServer()
    args = chat_args("--url", "http://fake")
    assert run_chat(args, httpx.MockTransport(server.handle)) == 0
    out = capsys.readouterr().out
    assert chat.HELP_LONG in out and server.bodies == []
