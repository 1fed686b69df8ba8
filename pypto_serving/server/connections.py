"""Connection limits below the ASGI app: uvicorn's h11 protocol with a deadline for each
request's headers and a cap on open connections.

h11 has no header timeout, and uvicorn's keep-alive timer stops at a request's first byte, so
a client sending a header line every few seconds (slowloris) would hold its connection
forever. Here a timer runs from the connection's start, and from each response's end, until
the next request's headers are complete; when it fires the connection is closed (after a 408
if part of a request had arrived). The body's own deadline is `RequestGuard`'s (app.py).

A request on a connection beyond `max_connections` open ones is answered 503 with
Retry-After (in OpenAI's error shape) and its connection closed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pypto_serving.server.errors import UNAVAILABLE, error_body


def _request_timeout(header_timeout_s: float) -> bytes:
    """A whole 408 response, written as is (h11 holds no request to answer)."""
    message = f"the request headers did not arrive within {header_timeout_s:g} s"
    body = json.dumps(error_body(message, "invalid_request_error", code="request_timeout"))
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return (head + body).encode()


def over_capacity(max_connections: int) -> Any:
    """The ASGI app answering every request of a connection over the cap."""
    message = f"the server is at its limit of {max_connections} open connections; retry later"
    body = error_body(message, UNAVAILABLE, code="too_many_connections")

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        headers = {"Retry-After": "1", "Connection": "close"}
        await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)

    return refuse


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline and the connection cap (set by
    `guarded_protocol`)."""

    header_timeout_s = 20.0
    max_connections = 512

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False
        """Bytes of a request whose headers are not complete have arrived."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts this one in self.connections
        if len(self.connections) > self.max_connections:
            self.app = over_capacity(self.max_connections)
        self._arm()

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

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._partial = False

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._partial:
            self.transport.write(_request_timeout(self.header_timeout_s))
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...) with these limits."""
    limits = {"header_timeout_s": header_timeout_s, "max_connections": max_connections}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)
