"""The HTTP server: FastAPI routes over one AsyncLLM.

Routes: the web page at / (chat and dashboard, `server/web/`; --no-web-ui leaves it out),
/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models and
/v1/models/{id} (OpenAI), /score and /rerank (vLLM's, over the embeddings),
/invocations (SageMaker's, as vLLM's), /stats (the dashboard's numbers: /metrics as JSON),
/tokenize, /detokenize, /health, /metrics (Prometheus), /version, /tokenizer_info and /load
(vLLM's, each behind its flag), and FastAPI's
/openapi.json, /docs and /redoc (their assets served from the fastapi-offline package). With an
API key set, every route but /health and the page's own files (which hold no data) needs
`Authorization: Bearer KEY` (the scheme in any case; the key compared in constant time, before
the body is read).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pypto_serving.config import ServerConfig
from pypto_serving.engine.async_llm import AsyncLLM
from pypto_serving.engine.metrics import PREFIX, VLLM
from pypto_serving.errors import PyptoError
from pypto_serving.server.chat_batch import batch_chat
from pypto_serving.server.embeddings import (
    EmbeddingRequest,
    EmbeddingsServing,
    RerankRequest,
    ScoreRequest,
)
from pypto_serving.server.errors import UNAVAILABLE, error_body, install_error_handlers
from pypto_serving.server.json_body import FastJSONRoute
from pypto_serving.server.openai_serving import OpenAIServing
from pypto_serving.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)
from pypto_serving.server.responses import ResponsesRequest, ResponsesServing

INVOCATIONS: dict[
    str, type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]
] = {
    "messages": ChatCompletionRequest,
    "prompt": CompletionRequest,
    "input": EmbeddingRequest,
}
"""/invocations' bodies, told apart by the field each must have."""

OPEN_PATHS = frozenset({"/health"})
"""Routes answered without the API key (a load balancer's probe)."""
PAGE_PATHS = frozenset({"/", "/web/app.js", "/web/style.css", "/favicon.ico"})
"""The web page's files: they hold no data (every number it shows comes from routes that need
the key, which the page asks for), so they load without the key."""
WEB_DIR = Path(__file__).parent / "web"


def has_key(authorization: bytes, key: bytes) -> bool:
    """Whether an Authorization header is `Bearer KEY`: the scheme in any case (RFC 7235),
    the key compared in constant time."""
    scheme, _, credentials = authorization.partition(b" ")
    right_key = hmac.compare_digest(credentials.lstrip(b" "), key)
    return scheme.lower() == b"bearer" and right_key


class RequestGuard:
    """ASGI middleware run before any route: 431 for request headers over `max_header_bytes`,
    401 without the API key (every path but OPEN_PATHS, unknown ones and the OpenAPI pages
    included; compared in constant time), 413 for a body over `max_body_bytes`, read before
    it is parsed, and 408 (then the connection closes) for a body not received within
    `body_timeout_s` of the headers."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_header_bytes: int,
        max_body_bytes: int,
        body_timeout_s: float,
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.open_paths = open_paths
        self.key = api_key.encode() if api_key else None
        self.max_header_bytes, self.max_body_bytes = max_header_bytes, max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.max_header_bytes:
            message = (
                f"the request headers are larger than the limit of {self.max_header_bytes} bytes"
            )
            await self._refuse(scope, receive, send, 431, message, "headers_too_large")
            return
        if self.key is not None and scope["path"] not in self.open_paths:
            given = next((v for k, v in headers if k == b"authorization"), b"")
            if not has_key(given, self.key):
                await self._refuse(
                    scope, receive, send, 401, "missing or invalid API key", "invalid_api_key"
                )
                return
        declared = next((v for k, v in headers if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while (status := await self._read(receive, body)) == "more":
                    pass
        except TimeoutError:
            message = f"the request body did not arrive within {self.body_timeout_s:g} s"
            await self._refuse(scope, receive, send, 408, message, "request_timeout", close=True)
            return
        if status == "gone":  # the client went away while sending
            return
        if status == "too_large":
            await self._too_large(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, body: bytearray) -> str:
        """Add the next piece of the body: "more", "done", "gone" or "too_large"."""
        message = await receive()
        if message["type"] != "http.request":
            return "gone"
        body += message.get("body", b"")
        if len(body) > self.max_body_bytes:
            return "too_large"
        return "more" if message.get("more_body", False) else "done"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
        await self._refuse(scope, receive, send, 413, message, "request_too_large")

    @staticmethod
    async def _refuse(
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        message: str,
        code: str,
        close: bool = False,
    ) -> None:
        body = error_body(message, "invalid_request_error", code=code)
        headers = {"Connection": "close"} if close else None
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/embeddings",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
        "/v1/invocations",
    }
)
"""The routes whose requests /load counts."""


class LoadTracker:
    """The generation requests being answered now (vLLM's server load): counted from when
    their route is entered until their response (a whole stream) is sent or abandoned."""

    def __init__(self) -> None:
        self.in_flight = 0

    class Middleware:
        def __init__(self, app: ASGIApp, tracker: LoadTracker) -> None:
            self.app, self.tracker = app, tracker

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
                await self.app(scope, receive, send)
                return
            self.tracker.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.tracker.in_flight -= 1


class RootPath:
    """vLLM's --root-path: a request under the prefix a reverse proxy serves this server at
    is routed as the same request without it (requests without it keep working), and the
    prefix is the scope's root_path (the API docs' links carry it)."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if path == self.prefix or path.startswith(self.prefix + "/"):
                path = path[len(self.prefix) :] or "/"
            scope = {**scope, "path": path, "root_path": self.prefix}
        await self.app(scope, receive, send)


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: X-Request-Id on every response, the request's own
    or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        value = given or uuid.uuid4().hex.encode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, with_id)


TOKENIZER_FILES = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
"""Tokenizer settings /tokenizer_info leaves out: paths on this machine."""


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's class and its configuration (what its
    tokenizer_config.json holds: special tokens, added tokens, the chat template), paths on
    this machine left out, every value as JSON."""
    out: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in tokenizer.init_kwargs.items():
        if key in TOKENIZER_FILES or key.endswith("_file") or key == "added_tokens_decoder":
            continue
        out[key] = as_json(value)
    out["added_tokens_decoder"] = {
        str(i): {
            "content": t.content,
            "special": bool(t.special),
            "lstrip": bool(t.lstrip),
            "rstrip": bool(t.rstrip),
            "normalized": bool(t.normalized),
            "single_word": bool(t.single_word),
        }
        for i, t in tokenizer.added_tokens_decoder.items()
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        out[name] = value if isinstance(value, str) else None
    out["model_max_length"] = int(min(tokenizer.model_max_length, 2**63 - 1))
    if getattr(tokenizer, "chat_template", None):
        out["chat_template"] = tokenizer.chat_template
    return out


def as_json(value: Any) -> Any:
    """A tokenizer setting as JSON: special tokens by their text, others as they are where
    JSON holds them, else their text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    return str(getattr(value, "content", value))


def metrics_json(registry: CollectorRegistry, model_name: str) -> dict[str, Any]:
    """The registry's samples (histogram buckets and vLLM's duplicate names left out), named
    without the `pypto_` prefix:
    {"time", "model", "metrics": {name: value}, "tiers": {tier: {name: value}}}; a sample
    with another label (a finish reason) is named `name:label`."""
    out: dict[str, Any] = {"time": time.time(), "model": model_name, "metrics": {}, "tiers": {}}
    for family in registry.collect():
        if family.name.startswith(VLLM):
            continue  # vLLM's names of the same measurements
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name.endswith(("_bucket", "_created")):
                continue
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            tier = labels.pop("tier", None)
            if tier is not None:
                out["tiers"].setdefault(tier, {})[name.removeprefix("kv_tier_")] = sample.value
            else:
                out["metrics"][":".join([name, *labels.values()])] = sample.value
    return out


def build_app(engine: AsyncLLM, config: ServerConfig, model_names: list[str]) -> FastAPI:
    """The server app; its lifespan starts and stops the engine loop."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.stop()

    __version__ = package_version("pypto-serving")
    # /docs and /redoc load their scripts from this package's assets, not a CDN: they work
    # on a machine with no way out
    app = FastAPIOffline(title="PyPTO Serving", version=__version__, lifespan=lifespan)
    app.router.route_class = FastJSONRoute  # the routes below parse JSON bodies fast
    install_error_handlers(app)
    serving = OpenAIServing(
        engine,
        model_names,
        config.max_response_logprobs,
        config.return_tokens_as_token_ids,
        config.tool_call_parser,
        config.enable_force_include_usage,
        config.reasoning_parser,
        config.trust_request_chat_template,
    )
    model_name = model_names[0]
    responses = ResponsesServing(serving)
    embeddings = EmbeddingsServing(serving)
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.chat(body, raw)

    @app.post("/v1/chat/completions/batch")
    async def chat_completions_batch(body: BatchChatCompletionRequest, raw: Request) -> Any:
        return await batch_chat(serving, body, raw)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, raw: Request) -> Any:
        return await embeddings.create(body, raw)

    @app.post("/v1/score", include_in_schema=False)
    @app.post("/score")
    async def score(body: ScoreRequest, raw: Request) -> Any:
        return await embeddings.score(body, raw)

    @app.post("/v1/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    @app.post("/rerank")
    async def rerank(body: RerankRequest, raw: Request) -> Any:
        return await embeddings.rerank(body, raw)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        return await responses.create(body, raw)

    def card(name: str) -> dict[str, Any]:
        """vLLM's model card of one served name: `root` is the model as it was given
        (--model), `parent` the base model of an adapter (none here)."""
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pypto-serving",
            "root": engine.engine.config.model,
            "parent": None,
            "max_model_len": engine.engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in model_names]}

    @app.get("/v1/models/{model_id:path}")  # the SDK's models.retrieve; ids may hold slashes
    async def model(model_id: str) -> dict[str, Any]:
        return card(serving.check_model(model_id))

    @app.post("/v1/invocations", include_in_schema=False)
    @app.post("/invocations")
    async def invocations(raw: Request) -> Any:
        """SageMaker's route (vLLM's): a chat body (with `messages`) is answered as
        /v1/chat/completions answers it, a completion body (with `prompt`) as
        /v1/completions, an embeddings body (with `input`) as /v1/embeddings."""
        try:
            data = await raw.json()
        except ValueError:
            raise PyptoError("the request body is not valid JSON", None) from None
        kind = next((k for k in INVOCATIONS if isinstance(data, dict) and k in data), None)
        if kind is None:
            raise PyptoError(
                "an invocation is a chat completion (a body with messages), a completion "
                "(a body with prompt) or embeddings (a body with input)",
                "messages",
            )
        try:
            body = INVOCATIONS[kind].model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if isinstance(body, ChatCompletionRequest):
            return await serving.chat(body, raw)
        if isinstance(body, EmbeddingRequest):
            return await embeddings.create(body, raw)
        return await serving.completions(body, raw)

    @app.post("/tokenize", response_model=dict[str, Any])
    async def tokenize(body: TokenizeRequest) -> Response:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise PyptoError("give exactly one of prompt or messages", "prompt")
        if body.tools and body.messages is None:
            raise PyptoError("tools go with messages: a prompt is not rendered", "tools")
        options = body.template() if body.messages is not None else None

        def count() -> Response:  # on a worker thread: a long text takes seconds
            if body.messages is not None and options is not None:
                shown = [t.function.for_template() for t in body.tools or []] or None
                special = body.parse_special_tokens_in_content
                messages = conversation(body.messages)
                tokens = serving.render_chat(messages, options, shown, special)
            else:
                add = body.add_special_tokens is not False
                tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=add)
            strs = (
                serving.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
            )
            max_model_len = engine.engine.max_model_len
            return JSONResponse(
                {
                    "tokens": tokens,
                    "count": len(tokens),
                    "max_model_len": max_model_len,
                    "token_strs": strs,
                }
            )

        return await asyncio.to_thread(count)

    if config.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return tokenizer_config(serving.tokenizer)

    if config.enable_server_load_tracking:

        @app.get("/load")
        async def load() -> dict[str, int]:
            return {"server_load": tracker.in_flight}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise PyptoError(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    @app.head("/health", include_in_schema=False)  # probes that send HEAD: the same status
    @app.get("/health")
    async def health() -> Response:
        problem = engine.health_problem()
        if problem is None:
            return Response(status_code=200)
        code = (
            "engine_dead"
            if not engine.alive
            else "shutting_down"
            if engine.draining
            else "degraded"
        )
        return JSONResponse(error_body(problem, UNAVAILABLE, code=code), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The web page's dashboard: /metrics' samples as JSON, read from the same registry
        (so the two agree), without the model label; per-tier samples under `tiers`."""
        return metrics_json(engine.metrics.registry, model_name)

    if config.web_ui:

        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            return FileResponse(WEB_DIR / "index.html")

        @app.get("/favicon.ico", include_in_schema=False)  # where browsers ask for it
        async def favicon() -> FileResponse:
            return FileResponse(WEB_DIR / "favicon.svg", media_type="image/svg+xml")

        app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    tracker = LoadTracker()
    app.add_middleware(LoadTracker.Middleware, tracker=tracker)
    app.add_middleware(
        RequestGuard,
        api_key=config.api_key,
        max_header_bytes=config.max_header_bytes,
        max_body_bytes=config.max_request_bytes,
        body_timeout_s=config.body_timeout_s,
        open_paths=OPEN_PATHS | (PAGE_PATHS if config.web_ui else frozenset()),
    )
    # added last, so it runs first: it answers browsers' preflights (which carry no API key)
    # and labels every answer, the guard's refusals included
    if config.allowed_origins:  # pages of these origins may call the API (CORS)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[o.strip() for o in config.allowed_origins.split(",") if o.strip()],
            allow_methods=["*"],
            allow_headers=["*"],
        )
    if config.enable_request_id_headers:  # outermost: refusals carry it too
        app.add_middleware(RequestIdHeader)
    if config.root_path:  # before any path is looked at
        app.add_middleware(RootPath, prefix=config.root_path)
    return app
