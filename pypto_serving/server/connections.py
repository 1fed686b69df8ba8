"""Connection limits below the ASGI app: uvicorn's h11 protocol with a deadline for each
request's headers, and caps on open connections, in all and per client.

h11 has no header timeout, and uvicorn's keep-alive timer stops at a request's first byte, so
a client sending a header line every few seconds (slowloris) would hold its connection
forever. Here a timer runs from the connection's start, and from each response's end, until
the next request's headers are complete; when it fires the connection is closed (after a 408
if part of a request had arrived). The body's own deadline is `RequestGuard`'s (app.py).

A connection that passes a cap makes room first: the connection waiting longest for a
request's headers is closed (idle sockets cost nothing to open, so they are the first to go),
taken from the client holding the most connections (past `max_connections` in all) or from
its own client (past `max_connections_per_client`; a client is an IP address). Only where
no connection waits, every one of them inside a request, is the new one refused: its request
is answered 503 with Retry-After (in OpenAI's error shape), or for /health answered as ever,
and it is closed. So idle sockets never lock anyone out, nor keep /health from answering.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pypto_serving.server.errors import UNAVAILABLE, error_body

log = logging.getLogger(__name__)
HEALTH_PATH = "/health"
"""Answered on every connection, one over a cap included (a load balancer's probe)."""


def _request_timeout(header_timeout_s: float) -> bytes:
    """A whole 408 response, written as is (h11 holds no request to answer)."""
    message = f"the request headers did not arrive within {header_timeout_s:g} s"
    body = json.dumps(error_body(message, "invalid_request_error", code="request_timeout"))
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return (head + body).encode()


def over_capacity(app: ASGIApp, message: str) -> ASGIApp:
    """The ASGI app of a connection over a cap: /health answered by `app`, every other
    request a 503 `too_many_connections` with Retry-After; the connection then closes."""
    body = error_body(message, UNAVAILABLE, code="too_many_connections")

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == HEALTH_PATH:
            await app(scope, receive, closing(send))
            return
        headers = {"Retry-After": "1", "Connection": "close"}
        await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)

    return refuse


def closing(send: Send) -> Send:
    """`send` with `Connection: close` added to the response's headers."""

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (b"connection", b"close")]
            message = {**message, "headers": headers}
        await send(message)

    return send_closing


def longest_waiting(conns: list[GuardedH11Protocol]) -> GuardedH11Protocol | None:
    """Of these connections, the one to close to make room: of those waiting for a request's
    headers, one of the client holding the most of them, the one waiting longest (None: none
    waits)."""
    held = Counter(c.host for c in conns)
    waiting = [c for c in conns if c.waiting_since is not None]
    return min(waiting, key=lambda c: (-held[c.host], c.waiting_since or 0.0), default=None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline and the connection caps (set by
    `guarded_protocol`)."""

    header_timeout_s = 20.0
    max_connections = 512
    max_connections_per_client = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False
        """Bytes of a request whose headers are not complete have arrived."""
        self.waiting_since: float | None = None
        """When the connection started waiting for a request's headers (None: it is not)."""

    @property
    def host(self) -> str:
        """The client's IP address ("" where there is none: a Unix socket)."""
        return self.client[0] if self.client else ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts this one in self.connections
        refusal = self._make_room()
        if refusal is not None:
            self.app = over_capacity(self.app, refusal)
        self._arm()

    def _make_room(self) -> str | None:
        """Where this connection passes a cap, close one waiting for its headers (this
        client's, or the busiest client's); the refusal's message where none waits."""
        if len(self.connections) <= min(self.max_connections, self.max_connections_per_client):
            return None  # no cap can be passed (the common case: no scan)
        others = [
            c
            for c in self.connections
            if isinstance(c, GuardedH11Protocol) and c is not self and not c.transport.is_closing()
        ]
        mine = [c for c in others if c.host == self.host]
        if len(mine) >= self.max_connections_per_client:
            if (victim := longest_waiting(mine)) is None:
                return (
                    f"this client is at the server's limit of {self.max_connections_per_client}"
                    " open connections per client (IP address); retry later"
                )
            victim.make_room()
            others.remove(victim)
        if len(others) >= self.max_connections:
            if (victim := longest_waiting(others)) is None:
                return (
                    f"the server is at its limit of {self.max_connections} open connections; "
                    "retry later"
                )
            victim.make_room()
        return None

    def make_room(self) -> None:
        """Close this connection, which waits for a request's headers, for a new one."""
        log.debug("closing a connection of %s idle for a new one", self.host)
        self._disarm()
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._partial = True
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request's headers (a pipelined one disarms it at once)
        super().on_response_complete()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        self.waiting_since = self.loop.time()

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._partial = False
        self.waiting_since = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self.waiting_since = None
        if self.transport.is_closing():
            return
        if self._partial:
            self.transport.write(_request_timeout(self.header_timeout_s))
        self.transport.close()


def guarded_protocol(
    header_timeout_s: float, max_connections: int, max_connections_per_client: int
) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...) with these limits."""
    limits = {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
        "max_connections_per_client": max_connections_per_client,
    }
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)
