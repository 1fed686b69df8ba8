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

A prefill server is chosen by the prefix it probably caches (Mooncake's cache-aware
scheduling, `prefix_estimate.py`): the pages (of ROUTER_PAGE tokens, as hash chains) the
server's KV events say it holds (`kv_events`), or else those of every prompt it computed for
this router; the router learns a new request's tokens from a prefill server's /tokenize (a
prompt of ids needs none) and sends it to the server holding the longest run of its leading
pages; then, as for decode servers, the one with the fewest requests in flight from this
router (ties in turn).

A server that cannot be reached, or answers 5xx, is taken out for `retry_s` and the
request goes to another of its role; with no prefill server left, the decode server computes
the prompt itself; with no decode server, the request is a 503 naming the servers. A
request a handoff cannot carry (several prompts, n > 1, best_of, beam search, prompt
logprobs, echo) goes to a decode server alone. The router's own counters are at /metrics.
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

from pypto_serving.engine.kv_events import key_pair
from pypto_serving.errors import PyptoError
from pypto_serving.server.prefix_estimate import ROUTER_PAGE, PrefixEstimate, follow, page_chain

log = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "x-request-id")
"""Request headers passed on to the servers (the API key, the request id)."""
TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "chat_template",
)
"""A chat request's fields that decide its prompt's tokens (what /tokenize is given)."""


@dataclass(slots=True)
class Backend:
    """One prefill or decode server."""

    url: str
    role: str
    prefixes: PrefixEstimate
    """What its prefix cache probably holds."""
    kv_events: str | None = None
    """Where it publishes its KV events (then they, not what it was sent, say what it holds)."""
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
    prefix_pages: int = 1 << 16
    """Pages of ROUTER_PAGE tokens remembered per prefill server (its prefix estimate)."""
    kv_events: list[str] = field(default_factory=list)
    """The prefill servers' KV event endpoints, in their order (the decode servers' where
    there is no prefill server: ordinary servers, each computing whole requests); none: the
    estimate is what the router sent each."""
    kv_events_server_key: str | None = None
    """The servers' CURVE public key file (`.key`), where their events are encrypted."""
    kv_events_key: str | None = None
    """This router's CURVE key pair (a `.key_secret` file), admitted by the servers."""
    timeout_s: float = 600.0
    """The longest a server may take to answer (a whole non-streamed response)."""

    def validate(self) -> None:
        if not self.decode:
            raise PyptoError("the router needs at least one decode server (--decode URL)")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise PyptoError(f"a server is an http(s):// URL, got {url!r}")
        followed = self.prefill or self.decode
        if self.kv_events and len(self.kv_events) != len(followed):
            role = "prefill" if self.prefill else "decode"
            raise PyptoError(
                f"--kv-events names one endpoint per {role} server, in their order: "
                f"{len(followed)} servers, {len(self.kv_events)} endpoints",
                "kv_events",
            )
        for endpoint in self.kv_events:
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise PyptoError(
                    f"a KV events endpoint is tcp://HOST:PORT or ipc://PATH, got {endpoint!r}",
                    "kv_events",
                )
        if (self.kv_events_server_key is None) != (self.kv_events_key is None):
            raise PyptoError(
                "--kv-events-server-key and --kv-events-key go together (the servers' public "
                "key, this router's key pair)",
                "kv_events_key",
            )
        self.curve()

    def curve(self) -> tuple[bytes, bytes, bytes] | None:
        """(the servers' public key, this router's public and secret keys), or None."""
        if self.kv_events_server_key is None or self.kv_events_key is None:
            return None
        from zmq.auth import load_certificate

        try:
            server, _ = load_certificate(self.kv_events_server_key)
        except (OSError, ValueError) as e:
            raise PyptoError(f"KV events' CURVE keys: {e}", "kv_events_server_key") from None
        return (server, *key_pair(self.kv_events_key, "kv_events_key"))


@dataclass
class Router:
    """The servers, how busy each is, and the router's counters."""

    config: RouterConfig
    backends: dict[str, list[Backend]] = field(init=False)
    registry: CollectorRegistry = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        followed = "prefill" if c.prefill else "decode"  # whose KV events --kv-events names
        self.backends = {}
        for role, urls in (("prefill", c.prefill), ("decode", c.decode)):
            events = c.kv_events if role == followed and c.kv_events else [None] * len(urls)
            self.backends[role] = [
                Backend(u.rstrip("/"), role, PrefixEstimate(c.prefix_pages), e)
                for u, e in zip(urls, events, strict=True)
            ]
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
        self.prefix_tokens = Counter(
            "pypto_router_prefix_tokens",
            "Prompt tokens sent to a prefill server that probably cached them already",
            registry=self.registry,
        )
        self.prefix_pages = Gauge(
            "pypto_router_prefix_pages",
            f"Pages of {ROUTER_PAGE} tokens a prefill server probably caches (the router's "
            "estimate: its KV events, or what the router sent it)",
            ["server"],
            registry=self.registry,
        )
        for b in (*self.backends["prefill"], *self.backends["decode"]):
            self.prefix_pages.labels(b.url).set_function(b.prefixes.__len__)
        self.fallbacks = Counter(
            "pypto_router_colocated",
            "Requests a decode server computed whole (no prefill server, or a request a "
            "handoff cannot carry)",
            registry=self.registry,
        )

    def pick(self, role: str, tried: set[str], chain: list[bytes] | None = None) -> Backend | None:
        """The up server of `role` not yet tried that holds the longest prefix of `chain` (a
        prompt's page hashes: `page_chain`), then with the fewest requests in flight."""
        turn = next(self._turn)
        servers = self.backends[role]
        order = servers[turn % len(servers) :] + servers[: turn % len(servers)] if servers else []
        up = [b for b in order if b.up and b.url not in tried]
        if not up:
            return None
        return min(up, key=lambda b: (-b.prefixes.held(chain or []), b.in_flight))

    def sent(self, backend: Backend, chain: list[bytes]) -> None:
        """The server computed a prompt of these pages: it caches them (as far as anyone
        knows until they age out of its estimate; its KV events, where it has them, tell)."""
        if backend.kv_events is None:
            backend.prefixes.sent(chain)

    def enter(self, backend: Backend) -> None:
        """A request is in flight at the server from now."""
        backend.in_flight += 1
        self.in_flight.labels(backend.role, backend.url).inc()

    def leave(self, backend: Backend) -> None:
        """The server is done with a request (answered, or failed)."""
        backend.in_flight -= 1
        self.in_flight.labels(backend.role, backend.url).dec()

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
    """Whether a handoff can carry this request (one prompt, one sample, no prompt scores)."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt)
    return (
        not batch
        and body.get("n", 1) in (1, None)
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
        curve = config.curve()
        feeds = [
            asyncio.create_task(follow(b.kv_events, b.prefixes, curve))
            for b in (*router.backends["prefill"], *router.backends["decode"])
            if b.kv_events is not None
        ]
        yield
        for feed in feeds:
            feed.cancel()
        await asyncio.gather(*feeds, return_exceptions=True)
        await client.aclose()

    app = FastAPI(title="pypto router", lifespan=lifespan)
    app.state.router = router

    async def prompt_ids(body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        """The request's prompt tokens, as a server's /tokenize renders them (a prefill
        server's, else a decode server's; None: none answered, or the prompt is not one text
        or one list of ids)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, str):
            ask: dict[str, Any] = {"prompt": prompt}
        elif "messages" in body:
            ask = {k: body[k] for k in TEMPLATE_FIELDS if k in body}
        else:
            return None
        backend = router.pick("prefill", set()) or router.pick("decode", set())
        if backend is None:
            return None
        try:
            r = await client.post(backend.url + "/tokenize", json=ask, headers=headers)
            ids = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return ids if isinstance(ids, list) else None

    async def prompt_chain(body: dict[str, Any], headers: dict[str, str]) -> list[bytes]:
        """The request's prompt as the router's page chain (empty where its tokens are not
        known)."""
        ids = await prompt_ids(body, headers)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return page_chain(ids, salt) if ids is not None else []

    async def prefill(
        body: dict[str, Any], path: str, headers: dict[str, str], chain: list[bytes]
    ) -> dict[str, Any] | Response | None:
        """The handoff's kv_transfer_params from a prefill server (the one that probably
        caches the longest prefix of the prompt, `chain`); a Response to give the client as
        it is (the request is bad: a 4xx); None when no prefill server answered."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        tried: set[str] = set()
        while (backend := router.pick("prefill", tried, chain)) is not None:
            tried.add(backend.url)
            cached = backend.prefixes.held(chain)  # (before its KV events tell of this prompt)
            router.enter(backend)
            try:
                r = await client.post(backend.url + path, json=prefill_body(body), headers=headers)
            except httpx.HTTPError as e:
                router.failed(backend, type(e).__name__)
                continue
            finally:
                router.leave(backend)
            if r.status_code >= 500:
                router.failed(backend, f"HTTP {r.status_code}")
                continue
            if r.status_code >= 400:
                router.requests.labels("prefill", backend.url, "refused").inc()
                return Response(r.content, r.status_code, media_type="application/json")
            router.requests.labels("prefill", backend.url, "ok").inc()
            router.prefix_tokens.inc(cached * ROUTER_PAGE)
            params = r.json().get("kv_transfer_params")
            if not isinstance(params, dict):
                return None
            computed = params.get("prompt_token_ids")
            if isinstance(computed, list):  # what it now caches
                router.sent(backend, page_chain(computed, salt))
            return params
        return None

    async def decode(
        body: dict[str, Any], path: str, headers: dict[str, str], chain: list[bytes]
    ) -> Response:
        """The decode server's answer, passed through (a stream as it comes). `chain`: the
        prompt's pages where the decode server computes it whole (it then goes where they
        are probably cached), else empty."""
        tried: set[str] = set()
        while (backend := router.pick("decode", tried, chain)) is not None:
            tried.add(backend.url)
            cached = backend.prefixes.held(chain)
            router.enter(backend)
            request = client.build_request("POST", backend.url + path, json=body, headers=headers)
            try:
                upstream = await client.send(request, stream=True)
            except httpx.HTTPError as e:
                router.leave(backend)
                router.failed(backend, type(e).__name__)
                continue
            if upstream.status_code >= 500:
                await upstream.aclose()
                router.leave(backend)
                router.failed(backend, f"HTTP {upstream.status_code}")
                continue
            outcome = "ok" if upstream.status_code < 400 else "refused"
            router.requests.labels("decode", backend.url, outcome).inc()
            if chain and outcome == "ok":  # it computes the prompt: it caches it now
                router.prefix_tokens.inc(cached * ROUTER_PAGE)
                router.sent(backend, chain)

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
                    router.leave(b)

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
        chain = await prompt_chain(body, headers)
        params = None
        if carries(body) and router.backends["prefill"]:
            found = await prefill(body, path, headers, chain)
            if isinstance(found, Response):
                return found
            params = found
        if params is None:  # the decode server computes it whole
            router.fallbacks.inc()
            return await decode(body, path, headers, chain)
        return await decode(body | {"kv_transfer_params": params}, path, headers, [])

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
