"""`pypto router`: the OpenAI API in front of prefill and decode servers (the founding notes' L3
over L2 prefill and L2 decode; XpYd).

For each completion or chat request the router asks a prefill server
(`--disaggregation-mode prefill`) to compute the prompt and its first token and hand the KV
off (`kv_transfer_params: {"do_remote_decode": true}`, `max_tokens` 1, no stream), then sends
the original request to a decode server (`--disaggregation-mode decode`) with the handoff's
`kv_transfer_params`, and passes the decode server's answer (a stream or a whole response)
through. The decode server reads the KV from the prefill server itself
(engine/kv_transfer.py); the router only carries the parameters.

    client ──▶ router ──1──▶ prefill server  (prompt, token 1, KV kept for the read)
                      ──2──▶ decode server   (reads the KV, goes on, streams) ──▶ client

Each role's server is the one with the fewest requests in flight from this router (ties in
turn). A server that cannot be reached, or answers 5xx, is taken out for `retry_s` and the
request goes to another of its role; with no prefill server left, the decode server computes
the prompt itself; with no decode server, the request is a 503 naming the servers. A
request a handoff cannot carry (n > 1, best_of, beam search, prompt logprobs, echo) goes to
a decode server alone. The router's own counters are at /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pypto_serving.errors import PyptoError

log = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "x-request-id")
"""Request headers passed on to the servers (the API key, the request id)."""


@dataclass(slots=True)
class Backend:
    """One prefill or decode server."""

    url: str
    role: str
    in_flight: int = 0
    down_until: float = 0.0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


@dataclass(slots=True)
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    retry_s: float = 10.0
    """How long a server that failed stays out of the rotation."""
    timeout_s: float = 600.0
    """The longest a server may take to answer (a whole non-streamed response)."""

    def validate(self) -> None:
        if not self.decode:
            raise PyptoError("the router needs at least one decode server (--decode URL)")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise PyptoError(f"a server is an http(s):// URL, got {url!r}")


@dataclass
class Router:
    """The servers, how busy each is, and the router's counters."""

    config: RouterConfig
    backends: dict[str, list[Backend]] = field(init=False)
    registry: CollectorRegistry = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.backends = {
            "prefill": [Backend(u.rstrip("/"), "prefill") for u in c.prefill],
            "decode": [Backend(u.rstrip("/"), "decode") for u in c.decode],
        }
        self._turn = itertools.count()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pypto_router_requests",
            "Requests sent to a server, by role, server and outcome",
            ["role", "server", "outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pypto_router_in_flight",
            "Requests in flight at a server from this router",
            ["role", "server"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "pypto_router_colocated",
            "Requests a decode server computed whole (no prefill server, or a request a "
            "handoff cannot carry)",
            registry=self.registry,
        )

    def pick(self, role: str, tried: set[str]) -> Backend | None:
        """The up server of `role` with the fewest requests in flight, not yet tried."""
        turn = next(self._turn)
        servers = self.backends[role]
        order = servers[turn % len(servers) :] + servers[: turn % len(servers)] if servers else []
        up = [b for b in order if b.up and b.url not in tried]
        return min(up, key=lambda b: b.in_flight) if up else None

    def failed(self, backend: Backend, why: str) -> None:
        backend.down_until = time.monotonic() + self.config.retry_s
        self.requests.labels(backend.role, backend.url, "failed").inc()
        log.warning(
            "%s server %s failed (%s): out for %g s",
            backend.role,
            backend.url,
            why,
            self.config.retry_s,
        )


def carries(body: dict[str, Any]) -> bool:
    """Whether a handoff can carry this request (one sample, no prompt scores)."""
    return (
        body.get("n", 1) in (1, None)
        and body.get("best_of") in (None, 1)
        and not body.get("use_beam_search")
        and body.get("prompt_logprobs") is None
        and not body.get("echo")
    )


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill server is asked: the prompt and one token, the KV handed off."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out |= {"stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def build_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(config.timeout_s, connect=5.0)
    client = httpx.AsyncClient(timeout=timeout, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pypto router", lifespan=lifespan)
    app.state.router = router

    async def prefill(
        body: dict[str, Any], path: str, headers: dict[str, str]
    ) -> dict[str, Any] | Response | None:
        """The handoff's kv_transfer_params from a prefill server; a Response to give the
        client as it is (the request is bad: a 4xx); None when no prefill server answered."""
        tried: set[str] = set()
        while (backend := router.pick("prefill", tried)) is not None:
            tried.add(backend.url)
            backend.in_flight += 1
            router.in_flight.labels("prefill", backend.url).inc()
            try:
                r = await client.post(backend.url + path, json=prefill_body(body), headers=headers)
            except httpx.HTTPError as e:
                router.failed(backend, type(e).__name__)
                continue
            finally:
                backend.in_flight -= 1
                router.in_flight.labels("prefill", backend.url).dec()
            if r.status_code >= 500:
                router.failed(backend, f"HTTP {r.status_code}")
                continue
            if r.status_code >= 400:
                router.requests.labels("prefill", backend.url, "refused").inc()
                return Response(r.content, r.status_code, media_type="application/json")
            router.requests.labels("prefill", backend.url, "ok").inc()
            params = r.json().get("kv_transfer_params")
            return params if isinstance(params, dict) else None
        return None

    async def decode(body: dict[str, Any], path: str, headers: dict[str, str]) -> Response:
        """The decode server's answer, passed through (a stream as it comes)."""
        tried: set[str] = set()
        while (backend := router.pick("decode", tried)) is not None:
            tried.add(backend.url)
            backend.in_flight += 1
            router.in_flight.labels("decode", backend.url).inc()
            request = client.build_request("POST", backend.url + path, json=body, headers=headers)
            try:
                upstream = await client.send(request, stream=True)
            except httpx.HTTPError as e:
                backend.in_flight -= 1
                router.in_flight.labels("decode", backend.url).dec()
                router.failed(backend, type(e).__name__)
                continue
            if upstream.status_code >= 500:
                await upstream.aclose()
                backend.in_flight -= 1
                router.in_flight.labels("decode", backend.url).dec()
                router.failed(backend, f"HTTP {upstream.status_code}")
                continue
            outcome = "ok" if upstream.status_code < 400 else "refused"
            router.requests.labels("decode", backend.url, outcome).inc()

            kind = upstream.headers.get("content-type", "application/json")

            async def relay(
                upstream: httpx.Response = upstream, b: Backend = backend, kind: str = kind
            ) -> Any:
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                except httpx.HTTPError as e:  # the server died mid-answer
                    router.failed(b, f"{type(e).__name__} mid-answer")
                    if kind.startswith("text/event-stream"):  # say so, as a server would
                        why = f"the decode server {b.url} stopped mid-answer"
                        event = {"error": {"message": why, "type": "service_unavailable"}}
                        yield f"\n\ndata: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                    # a whole JSON answer is cut short: its client sees the body end early
                finally:
                    await upstream.aclose()
                    b.in_flight -= 1
                    router.in_flight.labels("decode", b.url).dec()

            return StreamingResponse(relay(), upstream.status_code, media_type=kind)
        names = ", ".join(b.url for b in router.backends["decode"])
        return error(503, f"no decode server answered ({names}); retry later")

    async def generate(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body is a JSON object")
        if "kv_transfer_params" in body:
            return error(400, "kv_transfer_params is the router's to set")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        params = None
        if carries(body) and router.backends["prefill"]:
            found = await prefill(body, path, headers)
            if isinstance(found, Response):
                return found
            params = found
        if params is None:
            router.fallbacks.inc()
            return await decode(body, path, headers)
        return await decode(body | {"kv_transfer_params": params}, path, headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        for backend in router.backends["decode"]:
            try:
                r = await client.get(backend.url + "/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        return error(503, "no decode server answered")

    @app.get("/health")
    async def health() -> Response:
        async def ok(b: Backend) -> bool:
            try:
                return (await client.get(b.url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        every = [*router.backends["prefill"], *router.backends["decode"]]
        states = await asyncio.gather(*(ok(b) for b in every))
        status = {b.url: ("ok" if s else "down") for b, s in zip(every, states, strict=True)}
        decodes = any(s for b, s in zip(every, states, strict=True) if b.role == "decode")
        return JSONResponse({"servers": status}, 200 if decodes else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    return app


def run_router(config: RouterConfig) -> int:
    import uvicorn

    config.validate()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    app = build_router_app(config)
    log.info(
        "routing on http://%s:%d: prefill %s, decode %s",
        config.host,
        config.port,
        " ".join(config.prefill) or "(none)",
        " ".join(config.decode),
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
    return 0
