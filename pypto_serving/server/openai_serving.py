"""/v1/completions and /v1/chat/completions: request → prompts + SamplingParams → engine →
one JSON response, or SSE chunks in OpenAI's format ending with `data: [DONE]`.

Everything a client can get wrong is checked before the first byte is sent, so a bad request
is always a JSON 4xx, never a broken stream. Cheap checks (counts, sizes) come before
tokenizing, and tokenizing and chat templates run on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pypto_serving import grammar
from pypto_serving.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from pypto_serving.chat_prompt import (
    ChatTemplateOptions,
    chat_token_ids,
    conversation_chars,
)
from pypto_serving.engine.async_llm import (
    AsyncLLM,
    DrainingError,
    EngineDeadError,
    GenerationUpdate,
    OverloadedError,
    RequestUpdates,
)
from pypto_serving.errors import PyptoError, RequestFailedError
from pypto_serving.grammar import Grammars
from pypto_serving.kv.tier import TIER_NAMES
from pypto_serving.ops.sampler import Sampled
from pypto_serving.sampling import MAX_SPEC_CHARS, SamplingParams, StructuredOutputsParams
from pypto_serving.server.errors import UNAVAILABLE, APIError, error_body, quoted
from pypto_serving.server.logprobs import (
    TextOffsets,
    TokenBytes,
    TokenIdNames,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from pypto_serving.server.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ToolPlan,
)
from pypto_serving.server.pythonic_calls import call_parser, pythonic_grammar
from pypto_serving.server.reasoning import OPEN as REASONING_OPEN
from pypto_serving.server.reasoning import ReasoningSplitter
from pypto_serving.server.response_size import (
    ResponseShape,
    check_response_size,
    render_json,
    render_sse,
)
from pypto_serving.server.tool_parser import ToolCallParser
from pypto_serving.server.tools import (
    ToolFormat,
    call_grammar,
    call_schema,
    tag_tokens,
    template_message,
    tool_format,
)


@dataclass(slots=True)
class _Choice:
    """A choice being assembled for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[Sampled | None] | None = None


@dataclass(frozen=True, slots=True)
class _PromptScores:
    """A prompt's logprobs formatted once for all its choices: the echo's (completions'
    `logprobs`; `offsets`: where its choices' own tokens go on) and vLLM's prompt_logprobs."""

    echoed: dict[str, Any] | None
    offsets: TextOffsets
    vllm: list[dict[str, dict[str, Any]] | None] | None


@dataclass(slots=True)
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill server's handoff: where a decode server reads the prompt's KV (the
    response's `kv_transfer_params`, vLLM's field)."""

    def add_cached(self, update: GenerationUpdate) -> None:
        """Count a finished prompt's cached tokens, in all and per KV tier."""
        self.cached_tokens += update.num_cached_tokens
        for tier, n in update.cached_tokens_by_tier.items():
            self.cached_by_tier[tier] = self.cached_by_tier.get(tier, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": self.cached_tokens,
                # an extension: where the cached tokens came from (device, cpu, ssd)
                "cached_tokens_per_tier": self.cached_by_tier,
            },
        }


Update = tuple[int, GenerationUpdate]


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request checked and rendered: its prompt, its sampling and its tool format
    (None: no tools to call)."""

    prompt: list[int]
    params: SamplingParams
    fmt: ToolFormat | None
    count: str = "n"
    """The field that set params.n (n, or best_of above it): errors about it name it."""
    beams: BeamSearchParams | None = None
    """use_beam_search's search (None: sampled as params say)."""
    priority: int = 0


async def merge(gens: list[RequestUpdates]) -> AsyncIterator[Update]:
    """Updates of several requests as they come, tagged with the request's index.

    Closing this iterator closes (and so aborts) every request still running."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as only:
            async for update in only:
                yield 0, update
        return
    queue: asyncio.Queue[Update | BaseException | None] = asyncio.Queue()

    async def pump(i: int, gen: RequestUpdates) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for update in gen:
                    queue.put_nowait((i, update))
            queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather(
    updates: AsyncIterator[Update], choices: list[_Choice], n: int, usage: _Usage
) -> None:
    """Assemble whole choices (prompt p's sample i is choice p * n + i) and the usage."""
    async for p, update in updates:
        if update.prompt_logprobs is not None:
            for c in choices[p * n : (p + 1) * n]:
                c.prompt_logprobs = update.prompt_logprobs
        for d in update.deltas:
            c = choices[p * n + d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs or []
            c.finish_reason = d.finish_reason
        if update.finished:
            usage.add_cached(update)
        if update.kv_transfer_params is not None:
            usage.kv_transfer_params = update.kv_transfer_params
    usage.completion_tokens = sum(len(c.token_ids) for c in choices)


def forwarded_prompt(body: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
    """vLLM's `kv_transfer_params.prompt_token_ids`: the prompt a prefill server computed,
    taken as it is (the request's own text is not rendered into another)."""
    ids = (body.kv_transfer_params or {}).get("prompt_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise PyptoError(
            "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
            "kv_transfer_params",
        )
    return ids


def check_transfer(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A prefill server answers its handoff in the response: not in a stream."""
    params = body.kv_transfer_params
    if params and params.get("do_remote_decode") and body.stream:
        raise PyptoError(
            "kv_transfer_params with do_remote_decode takes stream false (the response "
            "carries the handoff)",
            "stream",
        )


def best(choices: list[_Choice], n: int, best_of: int) -> list[_Choice]:
    """Of each prompt's best_of candidates (in a row), the n of highest cumulative logprob."""
    if best_of == n:
        return choices
    out: list[_Choice] = []
    for p in range(0, len(choices), best_of):
        group = choices[p : p + best_of]
        out += sorted(group, key=lambda c: -sum(s.logprob for s in c.logprobs))[:n]
    return out


async def until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it (which aborts its requests) if the client goes away; the
    answer then is a 499 that nobody reads (no 500 path, no traceback)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # a cancelled task is done only once it has run its cleanup (the abort): wait
            await asyncio.wait({task})
    if task.cancelled():
        return JSONResponse(error_body("client disconnected", "client_closed"), status_code=499)
    return task.result()


Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def request_id(body: CompletionRequest | ChatCompletionRequest, raw: Request) -> str:
    """What a response's id is made of (vLLM's rule): the body's request_id, else the
    X-Request-Id header, else a new one. The engine's own ids stay unique whatever it is."""
    return body.request_id or raw.headers.get("x-request-id") or uuid.uuid4().hex


def stream_usage(body: CompletionRequest | ChatCompletionRequest, force: bool) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk, and whether every chunk carries the usage so
    far too (continuous_usage_stats, which vLLM honours with include_usage only); the
    server's --enable-force-include-usage (`force`) gives both to every stream."""
    options = body.stream_options
    include = bool(options and options.include_usage) or force
    return include, force or (include and bool(options and options.continuous_usage_stats))


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


RETRY_AFTER = {"Retry-After": "1"}
"""Seconds a client refused for overload should wait (OpenAI clients honour the header)."""
PROMPT_CHARS_MARGIN = 4
"""A text prompt longer than this many times (context x the longest token's characters) is
refused before it is tokenized: it cannot fit, unless a normalizer shrinks text that much."""


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        model_names: list[str],
        max_response_logprobs: int,
        tokens_as_ids: bool = False,
        tool_call_parser: str | None = None,
        force_usage: bool = False,
        reasoning_parser: str | None = None,
        trust_request_templates: bool = False,
    ) -> None:
        self.engine, self.model_names, self.model_name = engine, model_names, model_names[0]
        self.max_response_logprobs = max_response_logprobs
        self.force_usage = force_usage
        self.reasoning_parser = reasoning_parser
        self.trust_request_templates = trust_request_templates
        self.tokens_as_ids = tokens_as_ids
        """--return-tokens-as-token-ids: the default of requests that do not say."""
        self.tokenizer = engine.llm.tokenizer
        self.defaults = engine.llm.generation_defaults
        """The model's generation config: defaults of the sampling fields a request leaves out."""
        self.token_bytes = TokenBytes(self.tokenizer)
        self.token_id_names = TokenIdNames(self.token_bytes)
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = tool_format(template, tool_call_parser)
        self.tool_tags = tag_tokens(self.tokenizer.get_added_vocab(), self.tool_format)
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = PROMPT_CHARS_MARGIN * engine.engine.max_model_len * longest
        self.grammars = Grammars(engine.llm.model_dir, engine.engine.model_config.vocab_size)

    # --- shared -------------------------------------------------------------------------

    def names(self, body: CompletionRequest | ChatCompletionRequest) -> TokenBytes:
        """How the body's logprobs name tokens: by their text, or `token_id:<id>`."""
        as_ids = body.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.tokens_as_ids
        return self.token_id_names if as_ids else self.token_bytes

    def check_model(self, model: str | None) -> str:
        """The served name a request answers as (its `model`, else the first name); 404 for
        a name this server does not serve."""
        if not model:  # left out, null or "" (vLLM's rule): the first name
            return self.model_name
        if model not in self.model_names:
            served = " or ".join(map(repr, self.model_names))
            raise APIError(
                404,
                f"the model {quoted(model)} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return model

    def _check_count(self, num_prompts: int, params: SamplingParams, count: str = "n") -> None:
        """Raise unless the engine runs and one request may hold this many sequences (checked
        before tokenizing, and again after); `count`: the field that set params.n."""
        if not self.engine.alive:
            raise EngineDeadError("the engine is not running")
        if self.engine.draining:
            raise DrainingError("the server is shutting down and takes no new requests")
        if num_prompts * params.n > MAX_SEQUENCES_PER_REQUEST:
            raise PyptoError(
                f"{num_prompts} prompt(s) x {count}={params.n} sequences is over the limit of "
                f"{MAX_SEQUENCES_PER_REQUEST} per request",
                count,
            )

    async def admit_grammar(
        self, params: SamplingParams, body: CompletionRequest | ChatCompletionRequest | None
    ) -> None:
        """Compile the request's structured output over the model's vocabulary, its first
        tokens walked (grammar.py), on the grammar threads: neither the event loop nor the
        engine's steps wait for a grammar. One that cannot be enforced, or passes a limit, is
        a 400 naming the field that gave it (`tools` where body is None), before anything is
        tokenized or queued."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            if not self.grammars.admitted(spec, params.min_tokens):
                await asyncio.get_running_loop().run_in_executor(
                    grammar.ADMISSION, self.grammars.admit, spec, params.min_tokens
                )
        except PyptoError as e:
            if body is None:
                raise PyptoError(f"a tool's parameters: {e}", "tools") from None
            raise PyptoError(str(e), body.structured_param()) from None

    def _check(
        self, prompts: list[list[int]], params: SamplingParams, prompt_param: str = "prompt"
    ) -> None:
        """Raise unless the engine can take every prompt; `prompt_param` names them in errors."""
        self._check_count(len(prompts), params)
        for ids in prompts:
            try:
                self.engine.engine.check(ids, params)
            except PyptoError as e:
                if e.param != "prompt":
                    raise
                raise PyptoError(str(e), prompt_param) from None

    def _check_size(
        self, shape: ResponseShape, prompts: list[list[int]], params: SamplingParams
    ) -> None:
        """Raise unless the response stays within --max-response-logprobs (response_size.py)."""
        max_model_len = self.engine.engine.max_model_len
        limit = self.max_response_logprobs
        check_response_size(shape, prompts, params.max_tokens, max_model_len, limit)

    def _prompt_scores(
        self, body: CompletionRequest, ids: list[int], scored: list[Sampled | None] | None
    ) -> _PromptScores:
        """Prompt `ids`' echoed logprobs and vLLM's prompt_logprobs, as the body asks."""
        offsets = TextOffsets()
        echoed = None
        if scored is not None and body.echo and body.logprobs is not None:
            echoed = echo_logprobs(self.names(body), ids, scored, body.logprobs, offsets)
        vllm = None
        if body.prompt_logprobs is not None:
            vllm = vllm_prompt_logprobs(self.token_bytes, scored, body.prompt_logprobs)
        return _PromptScores(echoed, offsets, vllm)

    def _start(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None,
        count: str = "n",
        priority: int = 0,
        kv_transfer: dict[str, Any] | None = None,
    ) -> list[RequestUpdates]:
        """Queue the prompts, which `_check` has passed (a bad prompt must queue nothing);
        `count`: the field that set params.n; `kv_transfer`: the request's
        kv_transfer_params (one prompt only)."""
        if kv_transfer and len(prompts) != 1:
            raise PyptoError("kv_transfer_params takes one prompt", "kv_transfer_params")
        try:
            self.engine.admit(prompts, params, count)
        except OverloadedError as e:
            raise APIError(503, str(e), UNAVAILABLE, None, "overloaded", RETRY_AFTER) from None
        return [
            self.engine.generate(
                f"{request_id}-{uuid.uuid4().hex[:8]}-{i}",
                ids,
                params,
                cache_salt,
                priority,
                kv_transfer,
            )
            for i, ids in enumerate(prompts)
        ]

    # --- /v1/completions -----------------------------------------------------------------

    def logprob_counts(self, body: Body) -> Body:
        """The request with vLLM's -1 in logprobs, top_logprobs or prompt_logprobs (the whole
        vocabulary) made the vocabulary's size; a count over the engine's max_logprobs is a
        400 naming its field."""
        engine = self.engine.engine
        vocab, limit = engine.model_config.vocab_size, engine.config.max_logprobs
        limit = vocab if limit == -1 else limit
        counts = {}
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            count = getattr(body, name, None)
            if isinstance(count, bool) or not isinstance(count, int):
                continue  # chat's logprobs is a switch
            if count == -1:
                count = counts[name] = vocab
            if count > limit:
                raise PyptoError(
                    f"{name} must be in [0, {limit}] (the server's --max-logprobs; -1 asks for "
                    "the whole vocabulary where that is -1)",
                    name,
                )
        return body.model_copy(update=counts) if counts else body

    async def completions(self, body: CompletionRequest, raw: Request) -> Any:
        body = self.logprob_counts(body)
        name = self.check_model(body.model)
        params = body.sampling_params(body.max_tokens, body.logprobs, self.defaults)
        texts = body.prompts()
        self._check_count(len(texts), params, body.sequences_param())
        await self.admit_grammar(params, body)
        max_model_len = self.engine.engine.max_model_len
        prompts = [body.truncated(p, max_model_len) for p in await self.encode(texts)]
        if (forwarded := forwarded_prompt(body)) is not None:
            if len(prompts) != 1:
                raise PyptoError("kv_transfer_params takes one prompt", "kv_transfer_params")
            prompts = [forwarded]
        self._check(prompts, params)
        self._check_size(ResponseShape.of_completion(body, params), prompts, params)
        echoes = [
            (
                p
                if isinstance(p, str) and body.truncate_prompt_tokens is None
                else self.tokenizer.decode(ids)
            )
            if body.echo
            else ""
            for p, ids in zip(texts, prompts, strict=True)
        ]
        rid, created = f"cmpl-{request_id(body, raw)}", int(time.time())
        room = self.engine.engine.max_model_len - max(map(len, prompts))
        beams = body.beam_params(body.max_tokens if body.max_tokens is not None else room)
        if beams is not None:
            work = self._beam_completions(body, prompts, echoes, beams, rid, created, name)
            return await unless_disconnected(raw, work)
        check_transfer(body)
        updates = merge(
            self._start(
                prompts,
                params,
                rid,
                body.cache_salt,
                body.sequences_param(),
                body.priority,
                body.kv_transfer_params,
            )
        )
        usage = _Usage(prompt_tokens=sum(map(len, prompts)))
        n = params.n
        names = self.names(body)

        def choice(
            index: int,
            text: str,
            logprobs: list[Sampled] | None,
            reason: str | None,
            offsets: TextOffsets,
            scores: _PromptScores | None = None,
            ids: tuple[list[int] | None, list[int]] = (None, []),
        ) -> dict[str, Any]:
            """A choice; with `scores` (its prompt's), the echoed prompt's logprobs lead its
            own and vLLM's prompt_logprobs come with it; `ids`: its prompt's token ids (where
            they go: the first chunk of a stream's choice) and the generated ones it holds."""
            echoed = scores.echoed if scores is not None else None
            if echoed is not None:
                logprobs = logprobs or []
            lp = completion_logprobs(names, logprobs, offsets)
            if echoed is not None and lp is not None:
                lp = {key: echoed[key] + lp[key] for key in echoed}
            out = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
            if body.prompt_logprobs is not None or not body.stream:  # null when not asked for
                out["prompt_logprobs"] = scores.vllm if scores is not None else None
            if body.return_token_ids or not body.stream:  # null when not asked for
                out["prompt_token_ids"] = ids[0] if body.return_token_ids else None
                out["token_ids"] = ids[1] if body.return_token_ids else None
            return out

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage,
            }

        if body.stream:
            include_usage, continuous = stream_usage(body, self.force_usage)

            def echo_events(
                p: int, scored: list[Sampled | None], offsets: list[TextOffsets]
            ) -> str:
                """Prompt p's echo in each of its choices, formatted once (a worker thread's)."""
                scores = self._prompt_scores(body, prompts[p], scored)
                events = []
                for i in range(p * n, (p + 1) * n):
                    offsets[i] = scores.offsets.copy()
                    c = choice(i, echoes[p], None, None, offsets[i], scores, (prompts[p], []))
                    events.append(render_sse(chunk([c], usage.as_dict() if continuous else None)))
                return "".join(events)

            async def stream() -> AsyncIterator[str]:
                offsets = [TextOffsets() for _ in range(len(prompts) * n)]
                scoring = params.prompt_logprobs is not None
                unseen = set() if body.echo else set(range(len(offsets)))  # no chunk yet
                if body.echo and not scoring:
                    for i in range(len(offsets)):
                        c = choice(
                            i, echoes[i // n], None, None, offsets[i], None, (prompts[i // n], [])
                        )
                        yield sse(chunk([c], usage.as_dict() if continuous else None))
                async for p, update in updates:
                    if update.prompt_logprobs is not None:  # the echo, once the prompt is scored
                        scored = update.prompt_logprobs
                        yield await asyncio.to_thread(echo_events, p, scored, offsets)
                        unseen.difference_update(range(p * n, (p + 1) * n))  # their first
                    for d in update.deltas:
                        i = p * n + d.index
                        usage.completion_tokens += len(d.token_ids)
                        ids: tuple[list[int] | None, list[int]] = (
                            prompts[p] if i in unseen else None,
                            list(d.token_ids),
                        )
                        unseen.discard(i)
                        c = choice(i, d.text, d.logprobs, d.finish_reason, offsets[i], None, ids)
                        yield sse(chunk([c], usage.as_dict() if continuous else None))
                    if update.finished:
                        usage.add_cached(update)
                if include_usage:
                    yield sse(chunk([], usage.as_dict()))

            return self._streaming(stream())

        def response(choices: list[_Choice]) -> Response:
            """The whole response (each prompt's scores formatted once), built and encoded on
            a worker thread: it may be large."""
            scores = [
                self._prompt_scores(body, ids, choices[p * body.n].prompt_logprobs)
                for p, ids in enumerate(prompts)
            ]
            want = body.logprobs is not None
            out = []
            for i, c in enumerate(choices):
                s = scores[i // body.n]
                lp = c.logprobs if want else None
                ids = (prompts[i // body.n], c.token_ids)
                out.append(choice(i, c.text, lp, c.finish_reason, s.offsets.copy(), s, ids))
            whole = chunk(out, usage.as_dict())
            if usage.kv_transfer_params is not None:
                whole["kv_transfer_params"] = usage.kv_transfer_params
            return Response(render_json(whole), media_type="application/json")

        async def collect() -> Response:
            choices = [_Choice(echoes[i // n]) for i in range(len(prompts) * n)]
            await gather(updates, choices, n, usage)
            return await asyncio.to_thread(response, best(choices, body.n, n))

        return await unless_disconnected(raw, collect())

    # --- /v1/chat/completions -------------------------------------------------------------

    async def prepare_chat(self, body: ChatCompletionRequest) -> PreparedChat:
        """A chat request checked and rendered, ready to start (the chat and Responses
        endpoints share this)."""
        self.check_model(body.model)
        plan = body.tool_plan()
        if body.use_beam_search and plan is not None:
            raise PyptoError("beam search takes no tools", "tools")
        params = body.sampling_params(body.max_new_tokens(), body.num_logprobs(), self.defaults)
        fmt = None
        if plan is not None:
            fmt = self._tool_format()
            params = replace(params, structured_outputs=self.tool_grammar(fmt, plan))
        self._check_count(1, params, body.sequences_param())
        await self.admit_grammar(params, body if plan is None else None)
        shown = [t.for_template() for t in plan.tools] if plan is not None else None
        special = body.parse_special_tokens_in_content
        prompt = await asyncio.to_thread(
            self.render_chat, body.conversation(), body.template(), shown, special
        )
        prompt = body.truncated(prompt, self.engine.engine.max_model_len)
        self._check([prompt], params, "messages")
        self._check_size(ResponseShape.of_chat(body, params), [prompt], params)
        max_tokens = body.max_new_tokens()
        beams = body.beam_params(
            max_tokens if max_tokens is not None else self.engine.engine.max_model_len - len(prompt)
        )
        return PreparedChat(prompt, params, fmt, body.sequences_param(), beams, body.priority)

    def start_chat(
        self,
        chat: PreparedChat,
        request_id: str,
        cache_salt: str | None,
        kv_transfer: dict[str, Any] | None = None,
    ) -> AsyncIterator[Update]:
        """The prepared request queued: its updates (closing them aborts it)."""
        return merge(
            self._start(
                [chat.prompt],
                chat.params,
                request_id,
                cache_salt,
                chat.count,
                chat.priority,
                kv_transfer,
            )
        )

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Any:
        body = self.logprob_counts(body)
        prepared = await self.prepare_chat(body)
        if (forwarded := forwarded_prompt(body)) is not None:
            self._check([forwarded], prepared.params, "kv_transfer_params")
            prepared = replace(prepared, prompt=forwarded)
        prompt, params, fmt = prepared.prompt, prepared.params, prepared.fmt
        rid, created = f"chatcmpl-{request_id(body, raw)}", int(time.time())
        name = self.check_model(body.model)  # checked by prepare_chat: the name it answers as
        if prepared.beams is not None:
            work = self._beam_chat(body, prompt, prepared.beams, rid, created, name)
            return await unless_disconnected(raw, work)
        check_transfer(body)
        updates = self.start_chat(prepared, rid, body.cache_salt, body.kv_transfer_params)
        usage = _Usage(prompt_tokens=len(prompt))
        parsers = [call_parser(fmt) if fmt is not None else None for _ in range(params.n)]
        thinking = [self._reasoning(prompt) for _ in range(params.n)]

        def split(i: int, text: str, last: bool) -> tuple[dict[str, Any], str]:
            """Choice i's reasoning (a message's or delta's field) and content in `text`."""
            splitter = thinking[i]
            if splitter is None:
                return {}, text
            reasoning, content = splitter.feed(text, last)
            if not body.include_reasoning:
                return {}, content
            return ({"reasoning": reasoning} if reasoning else {}), content

        named = isinstance(body.tool_choice, NamedToolChoice)

        def reason(i: int, finish_reason: str | None) -> str | None:
            """A reply that called tools and stopped by itself finished by tool_calls; one
            made to call a named tool, by stop (OpenAI's rule, as vLLM keeps it)."""
            parser = parsers[i]
            called = parser is not None and parser.calls and not named
            return "tool_calls" if called and finish_reason == "stop" else finish_reason

        def chunk(choices: list[dict[str, Any]], obj: str, **extra: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": name,
                "choices": choices,
                **extra,
            }

        names = self.names(body)
        role, echoed = body.reply_role(), body.echoed()
        if body.stream:
            include_usage, continuous = stream_usage(body, self.force_usage)

            def tail() -> dict[str, Any]:
                """A chunk's usage: the usage so far (continuous_usage_stats), or null."""
                if not include_usage:
                    return {}
                return {"usage": usage.as_dict() if continuous else None}

            def first_event(
                first: list[dict[str, Any]], prompt_logprobs: list[Sampled | None] | None
            ) -> str:
                scored = self._prompt_logprobs(body, prompt_logprobs)
                if body.return_token_ids:
                    scored["prompt_token_ids"] = prompt
                return render_sse(chunk(first, "chat.completion.chunk", **tail(), **scored))

            async def stream() -> AsyncIterator[str]:
                # the role comes with the first tokens, not before the prompt is processed:
                # a client timing the first chunk times the first token (vLLM's benchmark)
                first = [
                    {
                        "index": i,
                        "delta": {"role": role, "content": echoed},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(params.n)
                ]
                async for _, update in updates:
                    if first:  # with prompt_logprobs it may be large: a worker thread's
                        yield await asyncio.to_thread(first_event, first, update.prompt_logprobs)
                        first = []
                    for d in update.deltas:
                        usage.completion_tokens += len(d.token_ids)
                        last = d.finish_reason is not None
                        reasoning, text = split(d.index, d.text, last)
                        delta = reasoning | self._delta(parsers[d.index], text, last)
                        one = {
                            "index": d.index,
                            "delta": delta if delta or d.finish_reason is None else {},
                            "logprobs": chat_logprobs(names, d.logprobs),
                            "finish_reason": reason(d.index, d.finish_reason),
                        }
                        if body.return_token_ids:
                            one["token_ids"] = list(d.token_ids)
                        yield sse(chunk([one], "chat.completion.chunk", **tail()))
                    if update.finished:
                        usage.add_cached(update)
                if include_usage:
                    yield sse(chunk([], "chat.completion.chunk", usage=usage.as_dict()))

            return self._streaming(stream())

        def message(i: int, text: str) -> dict[str, Any]:
            reasoning, content = split(i, text, True)
            if self.reasoning_parser is not None:
                reasoning = {"reasoning": None} | reasoning
            out = self._message(parsers[i], echoed + content, role) | reasoning
            if named and out["content"] is None:  # vLLM's: a named call's content is ""
                out["content"] = ""
            return out

        def response(choices: list[_Choice]) -> Response:
            """The whole response, built and encoded on a worker thread: it may be large."""
            out = [
                {
                    "index": i,
                    "message": message(i, c.text),
                    "logprobs": chat_logprobs(names, c.logprobs if body.logprobs else None),
                    "finish_reason": reason(i, c.finish_reason),
                    "token_ids": c.token_ids if body.return_token_ids else None,
                }
                for i, c in enumerate(choices)
            ]
            scored = self._prompt_logprobs(body, choices[0].prompt_logprobs)
            scored["prompt_token_ids"] = prompt if body.return_token_ids else None
            whole = chunk(out, "chat.completion", usage=usage.as_dict(), **scored)
            if usage.kv_transfer_params is not None:
                whole["kv_transfer_params"] = usage.kv_transfer_params
            return Response(render_json(whole), media_type="application/json")

        async def collect() -> Response:
            choices = [_Choice() for _ in range(params.n)]
            await gather(updates, choices, params.n, usage)
            return await asyncio.to_thread(response, best(choices, body.n, params.n))

        return await unless_disconnected(raw, collect())

    def _prompt_logprobs(
        self, body: ChatCompletionRequest, scored: list[Sampled | None] | None
    ) -> dict[str, Any]:
        """vLLM's chat `prompt_logprobs` (a field of the response; of a stream's first chunk
        only where asked for), null where not asked for."""
        if body.prompt_logprobs is None:
            return {} if body.stream else {"prompt_logprobs": None}
        k = body.prompt_logprobs
        return {"prompt_logprobs": vllm_prompt_logprobs(self.token_bytes, scored, k)}

    # --- beam search --------------------------------------------------------------------

    async def beam_search(
        self, prompt: list[int], params: BeamSearchParams, request_id: str, cache_salt: str | None
    ) -> list[BeamSearchSequence]:
        """A prompt's best beams, best first (beam_search.py); each step's beams are queued
        as requests of their own, sharing the prompt's cached pages."""
        eos = frozenset(self.engine.engine.model_config.eos_token_ids)
        search = BeamSearch(prompt, params, eos)
        step = 0
        while not search.done:
            queries = search.queries()
            scored: list[Sampled | None] = [None] * len(queries)
            gens = self._start(queries, search.step_params(), f"{request_id}-{step}", cache_salt)
            async for i, update in merge(gens):
                for d in update.deltas:
                    if d.logprobs:
                        scored[i] = d.logprobs[0]
            search.advance([s for s in scored if s is not None])
            step += 1
        return search.best(self.tokenizer)

    async def _beam_completions(
        self,
        body: CompletionRequest,
        prompts: list[list[int]],
        echoes: list[str],
        params: BeamSearchParams,
        rid: str,
        created: int,
        name: str,
    ) -> Response:
        async with asyncio.TaskGroup() as group:  # one failing stops the others
            searches = [
                group.create_task(self.beam_search(p, params, f"{rid}-{i}", body.cache_salt))
                for i, p in enumerate(prompts)
            ]
        found = [s.result() for s in searches]
        beams = [(p, beam) for p, best in enumerate(found) for beam in best]
        choices = [
            {
                "index": i,
                "text": echoes[p] + beam.text,
                "logprobs": None,
                "finish_reason": beam.finish_reason,
                "prompt_logprobs": None,
            }
            for i, (p, beam) in enumerate(beams)
        ]
        usage = _Usage(
            sum(map(len, prompts)), sum(len(b.output_token_ids) for bs in found for b in bs)
        )
        whole = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage.as_dict(),
        }
        return Response(render_json(whole), media_type="application/json")

    async def _beam_chat(
        self,
        body: ChatCompletionRequest,
        prompt: list[int],
        params: BeamSearchParams,
        rid: str,
        created: int,
        name: str,
    ) -> Response:
        beams = await self.beam_search(prompt, params, rid, body.cache_salt)
        role, echoed = body.reply_role(), body.echoed()
        choices = [
            {
                "index": i,
                "message": {"role": role, "content": echoed + beam.text},
                "logprobs": None,
                "finish_reason": beam.finish_reason,
            }
            for i, beam in enumerate(beams)
        ]
        usage = _Usage(len(prompt), sum(len(b.output_token_ids) for b in beams))
        whole = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage.as_dict(),
            "prompt_logprobs": None,
        }
        return Response(render_json(whole), media_type="application/json")

    # --- tools --------------------------------------------------------------------------

    def _tool_format(self) -> ToolFormat:
        if self.tool_format is None:
            raise APIError(
                400,
                "this model's chat template renders tools in a format this server does not "
                "read (it reads Hermes-style <tool_call> blocks, Mistral's [TOOL_CALLS], "
                "Llama 3's JSON calls, and SmolLM2's for templates without tools; "
                "--tool-call-parser names one)",
                param="tools",
                code="unsupported_parameter",
            )
        return self.tool_format

    def tool_grammar(self, fmt: ToolFormat, plan: ToolPlan) -> StructuredOutputsParams:
        """The grammar holding the reply to calls of the allowed tools (see tools.py); a tool
        whose parameters cannot be enforced is a 400 naming tools."""
        if fmt.pythonic:
            tools = [(t.name, t.arguments_schema()) for t in plan.allowed]
            text = pythonic_grammar(tools, plan.required, plan.parallel)
        else:
            calls = [call_schema(t.name, t.arguments_schema(), fmt.arguments) for t in plan.allowed]
            text = call_grammar(fmt, calls, plan.required, plan.parallel, self.tool_tags)
        if len(text) > MAX_SPEC_CHARS:
            raise PyptoError(
                f"the tools' parameters are too large: the grammar of their calls is {len(text)} "
                f"characters, over the limit of {MAX_SPEC_CHARS}",
                "tools",
            )
        spec = StructuredOutputsParams(grammar=text)
        try:
            grammar.check(spec)
        except PyptoError as e:
            raise PyptoError(f"a tool's parameters: {e}", "tools") from None
        return spec

    def _reasoning(self, prompt: list[int]) -> ReasoningSplitter | None:
        """A reply's thinking splitter (--reasoning-parser), or None: no parser."""
        if self.reasoning_parser is None:
            return None
        tail = self.tokenizer.decode(prompt[-8:]).rstrip()
        return ReasoningSplitter(self.reasoning_parser, tail.endswith(REASONING_OPEN))

    @staticmethod
    def _delta(parser: ToolCallParser | None, text: str, last: bool) -> dict[str, Any]:
        """A streamed piece of the reply: its content, and its tool calls where it has any."""
        if parser is None:
            return {"content": text} if text else {}
        content, calls = parser.feed(text)
        if last:
            content += parser.flush()
        out: dict[str, Any] = {"content": content} if content else {}
        if calls:
            out["tool_calls"] = [c.as_dict() for c in calls]
        return out

    @staticmethod
    def _message(parser: ToolCallParser | None, text: str, role: str) -> dict[str, Any]:
        """A whole reply: its content, and its tool calls where it made any."""
        if parser is None:
            return {"role": role, "content": text}
        parser.feed(text)
        parser.flush()
        out: dict[str, Any] = {"role": role, "content": parser.message_content()}
        if parser.calls:
            out["tool_calls"] = [c.as_dict() for c in parser.calls]
        return out

    async def encode(
        self, texts: list[str | list[int]], special: bool = True, param: str = "prompt"
    ) -> list[list[int]]:
        """Token ids of the prompts (`special`: with the tokenizer's special tokens); texts are
        tokenized on a worker thread, and refused first when longer than `max_prompt_chars`
        (an error naming `param`)."""
        for t in texts:
            self._check_chars(len(t) if isinstance(t, str) else 0, "the prompt", param)
        if not any(isinstance(t, str) for t in texts):
            return [list(t) for t in texts if not isinstance(t, str)]
        encode = self.tokenizer.encode
        return await asyncio.to_thread(
            lambda: [
                encode(t, add_special_tokens=special) if isinstance(t, str) else list(t)
                for t in texts
            ]
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatTemplateOptions,
        tools: list[dict[str, Any]] | None = None,
        parse_special: bool = False,
    ) -> list[int]:
        """Token ids of a conversation in the tokenizer's own chat template; with tools, or
        with calls and their results in it, in the template of the model's tool format.
        Refused first when its text is longer than `max_prompt_chars`; control tokens written
        in its strings are text unless `parse_special` (chat_prompt.py)."""
        own = getattr(self.tokenizer, "chat_template", None)
        if not own and options.template is None:
            raise PyptoError("this model has no chat template; use /v1/completions", "messages")
        self._check_chars(conversation_chars(messages), "the conversation", "messages")
        if options.template is not None and not self.trust_request_templates:
            raise PyptoError(
                "a request's own chat_template is refused: the server must be started with "
                "--trust-request-chat-template (vLLM's flag) to render clients' templates",
                "chat_template",
            )
        template = options.template
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = [template_message(m) for m in messages]
            if template is None and self.tool_format is not None:
                template = self.tool_format.template()
        return chat_token_ids(self.tokenizer, messages, options, tools, template, parse_special)

    def _check_chars(self, chars: int, what: str, param: str) -> None:
        """Raise unless a text of `chars` characters may fit the context (checked before it
        is tokenized: a longer one cannot, unless a normalizer shrinks text a lot)."""
        if chars > self.max_prompt_chars:
            raise PyptoError(
                f"{what} is over {self.max_prompt_chars} characters, more than this "
                f"model's context of {self.engine.engine.max_model_len} tokens can hold",
                param,
            )

    # --- SSE ----------------------------------------------------------------------------

    @staticmethod
    def _streaming(chunks: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for c in chunks:
                    yield c
            except RequestFailedError as e:  # the worker died or hung, or shutdown timed out
                yield sse(error_body(str(e), UNAVAILABLE, code=e.code))
            except PyptoError as e:
                yield sse(error_body(str(e), "invalid_request_error", code="invalid_value"))
            yield sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream")
