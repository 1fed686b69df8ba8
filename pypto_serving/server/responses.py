"""/v1/responses: OpenAI's Responses API (what the SDK's `client.responses` sends) over the
chat path: the input items become a conversation, the reply's text and tool calls become
output items, and a stream is the API's typed events (`response.created` ...
`response.output_text.delta` ... `response.function_call_arguments.delta` ...
`response.completed`).

Nothing is stored (`store: true`, `previous_response_id` and `background` are refused by name):
a client carries the conversation in `input`, as it does with chat.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictStr, ValidationError

from pypto_serving.engine.async_llm import GenerationUpdate
from pypto_serving.errors import PyptoError, RequestFailedError
from pypto_serving.server.errors import UNAVAILABLE, _validation_message
from pypto_serving.server.logprobs import TokenBytes, chat_logprobs
from pypto_serving.server.openai_serving import (
    OpenAIServing,
    _Usage,
    unless_disconnected,
)
from pypto_serving.server.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    _Body,
    _Request,
    unsupported,
)
from pypto_serving.server.pythonic_calls import call_parser
from pypto_serving.server.tool_parser import CallDelta, ToolCallParser

RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
"""Chat's names for the fields an error may name -> the Responses API's."""


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[InputText], Field(fail_fast=True)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Body):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Body):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutput, Field(union_mode="left_to_right")
]


class FunctionTool(_Body):
    """The Responses API's function tool (flat: no `function` wrapper)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ReasoningOptions(_Body):
    effort: str | None = None
    """Given to the chat template as `reasoning_effort` (as vLLM does), for the templates
    that read it."""
    summary: str | None = None
    """Accepted; no summary is written here (the reasoning item holds the thinking itself)."""


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1, fail_fast=True)]
    instructions: str | None = None
    """A system message before the input."""
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool | None = None
    """Nothing is stored here: true is refused."""
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    parse_special_tokens_in_content: bool = False
    """As chat's: control tokens written in the input and tools are text unless this is true."""
    reasoning: ReasoningOptions | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    """vLLM's sampling extras, as chat's."""
    top_logprobs: int | None = None
    """Each output token's logprob and this many most likely alternatives, on the text's
    deltas and its output_text part (as include's message.output_text.logprobs asks)."""
    enable_response_messages: bool = False
    """vLLM's: the response holds the prompt and the reply as the model saw and wrote them
    (`input_messages`, `output_messages`: raw text and token ids)."""

    def logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])

    def chat(self) -> ChatCompletionRequest:
        """The same request as chat takes it; 400 naming the field for what has no such."""
        stored = [i for i in self.include or [] if i != LOGPROBS_INCLUDE]
        for name, value in (
            ("store", self.store),
            ("previous_response_id", self.previous_response_id),
            ("background", self.background),
            ("include", stored),
        ):
            if value:
                raise unsupported(name, f"{name} is not supported: nothing is stored here")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
            "parse_special_tokens_in_content": self.parse_special_tokens_in_content,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logprobs": self.logprobs(),
            "top_logprobs": self.top_logprobs,
        }
        if self.reasoning is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_ or {}, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            message, param, _ = _validation_message(dict(e.errors()[0]))
            raise PyptoError(message, RENAMED.get(param or "", "input")) from None

    def messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages: consecutive calls in one assistant message."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        for item in items:
            if isinstance(item, InputMessage):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return out


LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one `include` value served: output text with its tokens' logprobs."""


class _Run:
    """One response as it is produced: its output items, grown from the reply's text (split
    into text and calls by the tool parser) and turned into the API's stream events. A
    non-streamed response is the same run with its events dropped."""

    def __init__(
        self,
        serving: OpenAIServing,
        body: ResponsesRequest,
        prompt: list[int],
        parser: ToolCallParser | None,
        names: TokenBytes,
    ) -> None:
        self.serving, self.body, self.parser, self.names = serving, body, parser, names
        self.prompt = prompt
        self.output: list[int] = []
        self.pending: list[dict[str, Any]] = []
        """Logprobs of tokens whose text the parser holds back (they go with the next text)."""
        self.id, self.created = f"resp_{uuid.uuid4().hex}", time.time()
        self.usage = _Usage(prompt_tokens=len(prompt))
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None
        """The message item text is going into (None: none open)."""
        self.calls: dict[int, dict[str, Any]] = {}
        """The parser's call index -> its function_call item."""
        self.open_call: dict[str, Any] | None = None
        self.finish: str | None = None
        self.sequence = 0

    # --- events -----------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        snapshot = self.response("in_progress")
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def update(self, update: GenerationUpdate) -> list[str]:
        events: list[str] = []
        for d in update.deltas:
            self.usage.completion_tokens += len(d.token_ids)
            self.output += d.token_ids
            if self.body.logprobs():
                self.pending += (chat_logprobs(self.names, d.logprobs or []) or {})["content"]
            last = d.finish_reason is not None
            if self.parser is None:
                text, calls = d.text, list[CallDelta]()
            else:
                text, calls = self.parser.feed(d.text)
                text += self.parser.flush() if last else ""
            if text:
                events += self.text(text)
            for c in calls:
                events += self.call(c)
            if last:
                self.finish = d.finish_reason
                events += self.close_message() + self.close_call()
        if update.finished:
            self.usage.add_cached(update)
        return events

    def text(self, piece: str) -> list[str]:
        events = self.close_call()
        if self.message is None:
            self.message = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.items.append(self.message)
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=len(self.items) - 1,
                    item=self.message,
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.message["content"].append(part)
            events.append(
                self.event("response.content_part.added", **self.where(self.message), part=part)
            )
        logprobs, self.pending = self.pending, []
        self.message["content"][0]["text"] += piece
        self.message["content"][0]["logprobs"] += logprobs
        events.append(
            self.event(
                "response.output_text.delta",
                **self.where(self.message),
                delta=piece,
                logprobs=logprobs,
            )
        )
        return events

    def call(self, d: CallDelta) -> list[str]:
        events = self.close_message()
        if d.index not in self.calls:
            events += self.close_call()
            item = self.open_call = self.calls[d.index] = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": d.id,
                "name": d.name,
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            events.append(
                self.event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=item
                )
            )
        item = self.calls[d.index]
        if d.arguments:
            item["arguments"] += d.arguments
            where = {"item_id": item["id"], "output_index": self.items.index(item)}
            events.append(
                self.event("response.function_call_arguments.delta", **where, delta=d.arguments)
            )
        return events

    def where(self, message: dict[str, Any]) -> dict[str, Any]:
        return {
            "item_id": message["id"],
            "output_index": self.items.index(message),
            "content_index": 0,
        }

    def close_message(self) -> list[str]:
        message, self.message = self.message, None
        if message is None:
            return []
        message["status"] = "completed"
        part = message["content"][0]
        return [
            self.event(
                "response.output_text.done",
                **self.where(message),
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self.event("response.content_part.done", **self.where(message), part=part),
            self.event(
                "response.output_item.done", output_index=self.items.index(message), item=message
            ),
        ]

    def close_call(self) -> list[str]:
        item, self.open_call = self.open_call, None
        if item is None:
            return []
        item["status"] = "completed"
        at = self.items.index(item)
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=at,
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=at, item=item),
        ]

    def end(self) -> list[str]:
        status = self.status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self.event(kind, response=self.response(status))]

    # --- the response ---------------------------------------------------------------------

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str) -> dict[str, Any]:
        body, u = self.body, self.usage.as_dict()
        done = status != "in_progress"
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.serving.check_model(self.body.model),
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "output": self.items if done else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedFunction)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": (
                body.text or TextOptions.model_validate({"format": {"type": "text"}})
            ).model_dump(by_alias=True, exclude_none=True),
            "store": False,
            "usage": {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]
                },
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            }
            if done
            else None,
            **(self.raw_messages() if done and body.enable_response_messages else {}),
        }

    def raw_messages(self) -> dict[str, Any]:
        """vLLM's enable_response_messages: the prompt and the reply, text and token ids."""
        decode = self.serving.tokenizer.decode

        def raw(ids: list[int]) -> list[dict[str, Any]]:
            return [{"type": "raw_message_tokens", "message": decode(ids), "tokens": ids}]

        return {"input_messages": raw(self.prompt), "output_messages": raw(self.output)}


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: ResponsesRequest, raw: Request) -> Any:
        chat = body.chat()
        try:
            prepared = await self.serving.prepare_chat(chat)
        except PyptoError as e:
            raise PyptoError(str(e), RENAMED.get(e.param or "", e.param)) from None
        parser = call_parser(prepared.fmt) if prepared.fmt is not None else None
        names = self.serving.names(chat)
        run = _Run(self.serving, body, prepared.prompt, parser, names)
        updates = self.serving.start_chat(prepared, run.id, None)
        if body.stream:
            return StreamingResponse(self.events(run, updates), media_type="text/event-stream")

        async def collect() -> JSONResponse:
            async for _, update in updates:
                run.update(update)
            return JSONResponse(run.response(run.status()))

        return await unless_disconnected(raw, collect())

    @staticmethod
    async def events(run: _Run, updates: AsyncIterator[Any]) -> AsyncIterator[str]:
        for event in run.start():
            yield event
        try:
            async for _, update in updates:
                for event in run.update(update):
                    yield event
        except RequestFailedError as e:
            yield run.event("error", message=str(e), code=e.code or UNAVAILABLE, param=None)
            return
        except PyptoError as e:
            yield run.event("error", message=str(e), code="invalid_value", param=e.param)
            return
        for event in run.end():
            yield event
