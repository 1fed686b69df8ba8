"""The HTTP server: FastAPI routes over one AsyncLLM.

Routes: /v1/completions, /v1/chat/completions, /v1/models (OpenAI), /tokenize, /detokenize,
/health, /metrics (Prometheus), /version. With an API key set, /v1/* and the tokenizer routes
need `Authorization: Bearer KEY` (compared in constant time).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pypto_serving.config import ServerConfig
from pypto_serving.engine.async_llm import AsyncLLM
from pypto_serving.errors import PyptoError
from pypto_serving.server.errors import APIError, error_body, install_error_handlers
from pypto_serving.server.openai_serving import OpenAIServing
from pypto_serving.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)


class BodyLimit:
    """ASGI middleware: answer 413 for a request body over `limit` bytes, before parsing it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
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

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than the limit of {self.limit} bytes"
        body = error_body(message, "invalid_request_error", code="request_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def build_app(engine: AsyncLLM, config: ServerConfig, model_name: str) -> FastAPI:
    """The server app; its lifespan starts and stops the engine loop."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.stop()

    __version__ = package_version("pypto-serving")
    app = FastAPI(title="PyPTO Serving", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    serving = OpenAIServing(engine, model_name)
    created = int(time.time())
    expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")

    auth = [Depends(authorize)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.chat(body, raw)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "pypto-serving",
            "max_model_len": engine.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise PyptoError("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = serving.render_chat(conversation(body.messages), body.add_generation_prompt)
        else:
            tokens = serving.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": engine.engine.max_model_len,
        }

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise PyptoError(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        if engine.alive:
            return Response(status_code=200)
        return JSONResponse(
            error_body("the engine is not running", "service_unavailable", code="engine_dead"),
            status_code=503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.add_middleware(BodyLimit, limit=config.max_request_bytes)
    return app
