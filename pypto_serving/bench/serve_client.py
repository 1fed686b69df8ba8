"""The HTTP side of `pypto bench serve`: streamed requests to an OpenAI-compatible server.

`send_request` sends one streamed request and times it into a `RequestRecord`; `run_load`
plays a whole workload (sessions arriving as a seeded Poisson process, at most
`max_concurrency` in flight; the turns of a multi-turn session one after another, each turn
carrying the server's previous replies). Any `httpx` transport can be injected, so tests run
the client against an in-process fake server.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pypto_serving.bench.serve_datasets import Session
from pypto_serving.errors import PyptoError
from pypto_serving.http_client import (
    StreamError,
    chunk_text,
    describe_error,
    error_message,
    sse_chunk,
)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CONNECT_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Target:
    """Where and how to send: the server, its endpoint and the fixed request fields."""

    base_url: str
    endpoint: str
    """completions or chat"""
    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    """Longest wait for the next bytes of a response."""

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome and timings (seconds; `start_s` is relative to the run's start)."""

    conversation: int
    turn: int
    start_s: float = 0.0
    success: bool = False
    error: str = ""
    status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    """Send → first chunk carrying text (the whole latency when the answer is empty)."""
    tpot_s: float | None = None
    """(e2e - ttft) / (completion_tokens - 1), for answers of two tokens or more."""
    e2e_s: float | None = None
    cached_tokens: int | None = None
    """Prompt tokens the server found cached (usage.prompt_tokens_details), if it said."""
    cached_tokens_per_tier: dict[str, int] = field(default_factory=dict)
    """pypto's extension: of those, per KV tier (device, cpu, ssd)."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between successive text-carrying chunks."""
    text: str = ""


def make_client(
    target: Target, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """An AsyncClient for the run: no pool cap (concurrency is the load's business)."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    return httpx.AsyncClient(
        transport=transport,
        headers=headers,
        timeout=httpx.Timeout(target.timeout_s, connect=CONNECT_TIMEOUT_S, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def get_models(client: httpx.AsyncClient, base_url: str) -> httpx.Response:
    """GET /v1/models; a clear error naming the URL when nothing answers there."""
    try:
        return await client.get(base_url + "/v1/models")
    except httpx.HTTPError as e:
        reason = str(e) or type(e).__name__
        raise PyptoError(f"cannot reach the server at {base_url}: {reason}") from None


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET /v1/models; a clear error when the server cannot be used."""
    response = await get_models(client, base_url)
    if response.status_code != 200:
        raise PyptoError(
            f"GET {base_url}/v1/models answered HTTP {response.status_code}: "
            f"{error_message(response.content)} (pass --model-name to skip this query)"
        )
    try:
        models = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        models = []
    if not models:
        raise PyptoError(f"GET {base_url}/v1/models lists no model; pass --model-name")
    return str(models[0])


def request_body(target: Target, prompt: Any, output_len: int) -> dict[str, Any]:
    """The JSON body: `prompt` is a message list for chat, text or token ids for completions."""
    body: dict[str, Any] = {"model": target.model}
    if target.endpoint == "chat":
        body["messages"] = prompt
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt
        body["max_tokens"] = output_len
    body |= {
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


class StreamTimer:
    """Consumes SSE lines of one response, timing the chunks that carry text."""

    def __init__(self, start: float, clock: Callable[[], float]) -> None:
        self.start, self.clock = start, clock
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.text: list[str] = []
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.done = False

    def feed(self, line: str) -> None:
        """One line of the stream: `data: {...}`, `data: [DONE]`; others are ignored."""
        if self.done:
            return
        chunk = sse_chunk(line)
        if chunk is None:
            return
        if chunk == "done":
            self.done = True
            return
        if chunk.get("error"):
            raise StreamError(f"error event: {describe_error(chunk['error'])}")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if text := chunk_text(chunk):
            now = self.clock()
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - self.last)  # type: ignore[operator]
            self.last = now
            self.chunks += 1
            self.text.append(text)

    def finish(self, record: RequestRecord, prompt_len: int) -> None:
        """Fill `record` with the timings of a stream that ended with [DONE]."""
        end = self.clock()
        usage = self.usage or {}
        record.prompt_tokens = int(usage.get("prompt_tokens") or prompt_len)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]
            tiers = details.get("cached_tokens_per_tier")
            if isinstance(tiers, dict):
                record.cached_tokens_per_tier = {
                    str(k): v for k, v in tiers.items() if isinstance(v, int)
                }
        completion = usage.get("completion_tokens")
        record.completion_tokens = int(completion if completion is not None else self.chunks)
        record.e2e_s = end - self.start
        record.ttft_s = (self.first if self.first is not None else end) - self.start
        if record.completion_tokens > 1:
            record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
        record.itl_s = self.itl
        record.text = "".join(self.text)
        record.success = True


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    prompt: Any,
    prompt_len: int,
    output_len: int,
    record: RequestRecord,
    run_start: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send one streamed request; `record` gets its outcome (failures never get timings)."""
    start = clock()
    record.start_s = start - run_start
    timer = StreamTimer(start, clock)
    body = request_body(target, prompt, output_len)
    try:
        async with client.stream("POST", target.url, json=body) as response:
            record.status = response.status_code
            if not 200 <= response.status_code < 300:
                message = error_message(await response.aread())
                record.error = f"HTTP {response.status_code}: {message}"
                return record
            async for line in response.aiter_lines():
                timer.feed(line)
    except StreamError as e:
        record.error = str(e)
        return record
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return record
    if not timer.done:
        record.error = "the stream ended before [DONE]"
        return record
    timer.finish(record, prompt_len)
    return record


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets (s) of `num` arrivals: a Poisson process of `request_rate`/s, first at 0.

    An infinite rate sends everything at once. Seeded, so a run's arrivals are reproducible."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(request_rate)
        times.append(now)
    return times


async def run_session(
    client: httpx.AsyncClient,
    target: Target,
    session: Session,
    run_start: float,
    on_request_done: Callable[[], None] | None = None,
    think_time_s: float = 0.0,
) -> list[RequestRecord]:
    """The turns of one session in order; each chat turn carries the replies so far and is
    sent `think_time_s` after the previous reply ended (the user reading and typing).

    Once a turn fails, its later turns (which would need its reply) are recorded as failed
    without being sent."""
    messages = list(session.prefix_messages)
    records: list[RequestRecord] = []
    failed = False
    for turn, (user, prompt_len) in enumerate(
        zip(session.user_turns, session.prompt_lens, strict=True)
    ):
        record = RequestRecord(session.index, turn)
        records.append(record)
        if failed:
            record.error = "not sent: an earlier turn of its conversation failed"
        else:
            if turn and think_time_s:
                await asyncio.sleep(think_time_s)
            if target.endpoint == "chat":
                messages.append({"role": "user", "content": user})
                prompt: Any = list(messages)
            else:
                prompt = user
            await send_request(
                client, target, prompt, prompt_len, session.output_len, record, run_start
            )
            messages.append({"role": "assistant", "content": record.text})
            failed = not record.success
        if on_request_done is not None:
            on_request_done()
    return records


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    sessions: list[Session],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    on_request_done: Callable[[], None] | None = None,
    think_time_s: float = 0.0,
) -> tuple[list[RequestRecord], float]:
    """Play every session; the records in (session, turn) order and the run's duration (s).

    Sessions arrive at seeded Poisson times; at most `max_concurrency` sessions run at once
    (each has one request in flight at a time, so this caps requests in flight too)."""
    offsets = arrival_times(len(sessions), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_start = time.perf_counter()

    async def play(session: Session, offset: float) -> list[RequestRecord]:
        await asyncio.sleep(max(0.0, run_start + offset - time.perf_counter()))
        async with limit if limit is not None else contextlib.nullcontext():
            return await run_session(
                client, target, session, run_start, on_request_done, think_time_s
            )

    results = await asyncio.gather(*(play(s, o) for s, o in zip(sessions, offsets, strict=True)))
    duration = time.perf_counter() - run_start
    return [r for records in results for r in records], duration
