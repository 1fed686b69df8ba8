"""Connection caps: idle sockets never lock anyone out, one client cannot hold every
connection, and /health always answers (issue 42, item 7: 512 idle sockets, unauthenticated
under --api-key, once locked out every client and /health).

Every 127.x.y.z address is this machine's loopback on Linux: a socket bound to 127.0.0.2 is
another client (IP address) of a server on 127.0.0.1.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
from live_server import Live, serving, tiny_llm
from patience import patience, wait_for

MODEL = "llama-gqa4-tied"
KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEADLINE_S = 60.0
"""What "eventually" means here: far beyond every timeout set in these tests."""


@contextmanager
def caps(tiny_model: Callable[[str], Any], **limits: int) -> Iterator[Live]:
    """A server with an API key, long header and body deadlines and these connection caps."""
    llm = tiny_llm(tiny_model(MODEL))
    timeouts = {"header_timeout_s": 600.0, "body_timeout_s": 600.0}
    with serving(llm, api_key=KEY, **timeouts, **limits) as live:
        yield live


def connect(live: Live, client: str, stack: ExitStack) -> socket.socket:
    """A connection to the server from the address `client`, closed with `stack`."""
    port = int(live.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), source_address=(client, 0))
    return stack.enter_context(sock)


def busy(live: Live, client: str, stack: ExitStack) -> socket.socket:
    """A connection inside a request: its headers sent (with the key), its body not yet; it
    returns once the server reads the body (its `100 Continue`): the headers are counted."""
    sock = connect(live, client, stack)
    head = f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    rest = "Content-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n"
    sock.sendall(f"{head}{rest}\r\n".encode())
    sock.settimeout(patience(DEADLINE_S))
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(1024) or b"closed"
    assert got.startswith(b"HTTP/1.1 100 "), got
    return sock


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (nothing is ever sent on it)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def get(live: Live, client: str, path: str) -> httpx.Response:
    """GET `path` with the key, on a new connection from the address `client`."""
    transport = httpx.HTTPTransport(local_address=client)
    with httpx.Client(transport=transport, timeout=patience(30)) as http:
        return http.get(live.url + path, headers=AUTH)


def test_idle_connections_are_closed_first_at_the_cap(tiny_model: Callable[[str], Any]) -> None:
    with caps(tiny_model, max_connections=4) as live, ExitStack() as stack:
        idle = [connect(live, "127.0.0.1", stack) for _ in range(4)]  # unauthenticated
        idle[0].sendall(b"GET /v1/models HTTP/1.1\r\n")  # a slowloris start
        assert get(live, "127.0.0.2", "/health").status_code == 200
        assert get(live, "127.0.0.1", "/v1/models").status_code == 200  # the same client too
        wait_for(lambda: closed(idle[0]), DEADLINE_S, "the oldest idle connection closed")
        assert not closed(idle[3])  # the newest stays: at most two made room


def test_one_client_holds_at_most_its_share(tiny_model: Callable[[str], Any]) -> None:
    with caps(tiny_model, max_connections=8, max_connections_per_client=2) as live:
        with ExitStack() as stack:
            idle = [connect(live, "127.0.0.1", stack) for _ in range(4)]
            wait_for(lambda: closed(idle[0]) and closed(idle[1]), DEADLINE_S, "2 closed")
            assert not closed(idle[2]) and not closed(idle[3])
            assert get(live, "127.0.0.1", "/v1/models").status_code == 200  # room made
        with ExitStack() as stack:  # two inside requests: the client's third is refused
            busy(live, "127.0.0.1", stack)
            busy(live, "127.0.0.1", stack)
            r = get(live, "127.0.0.1", "/v1/models")
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "too_many_connections" and "per client" in error["message"]
            assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
            assert get(live, "127.0.0.1", "/health").status_code == 200  # always answered
            assert get(live, "127.0.0.2", "/v1/models").status_code == 200  # others served


def test_over_the_cap_requests_get_503_and_health_answers(
    tiny_model: Callable[[str], Any],
) -> None:
    with caps(tiny_model, max_connections=3) as live:
        with ExitStack() as stack:  # every connection inside a request: none can make room
            for client in ("127.0.0.1", "127.0.0.3", "127.0.0.4"):
                busy(live, client, stack)
            r = get(live, "127.0.0.2", "/v1/models")
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "too_many_connections" and "limit of 3 open" in error["message"]
            assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
            health = get(live, "127.0.0.2", "/health")
            assert health.status_code == 200 and health.headers["connection"] == "close"
        wait_for(lambda: get(live, "127.0.0.2", "/v1/models").status_code == 200, 30, "200")
