"""`pypto serve`: load the engine (compile included), then serve it with uvicorn.

The address is taken before the model loads, so a port in use fails at once. SIGTERM drains:
new requests get 503 (`shutting_down`) and /health turns 503, the requests in flight finish
(for up to `shutdown_timeout` seconds, then they end with an error), and the process exits
with code 0. A second SIGTERM, or SIGINT (Ctrl-C), stops at once: the requests in flight end
with an error at once (a stream gets its SSE error event, then [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from pypto_serving.config import ServerConfig, engine_config
from pypto_serving.engine.async_llm import AsyncLLM, QueueLimits
from pypto_serving.engine.kv_transfer import KVTransfer
from pypto_serving.errors import PyptoError
from pypto_serving.server.app import build_app
from pypto_serving.server.connections import guarded_protocol

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 5
"""After draining, how long uvicorn waits for connections to close before cancelling them."""


def uvicorn_config(app: Any, config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings for the app: h11 with the header deadline and connection caps; its
    access log (one INFO line a request) only when asked."""
    settings = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.uvicorn_log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        http=guarded_protocol(
            config.header_timeout_s, config.max_connections, config.max_connections_per_client
        ),
        ws="none",
    )
    if config.access_log:  # after uvicorn set its loggers to log_level
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return settings


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts when uvicorn serves on it); taken before
    the model loads, so a busy or bad address is an error at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "the address is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise PyptoError(f"cannot listen on {where}: {why or e}", "port") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM draining the engine before it stops, and a second
    SIGTERM or SIGINT ending the requests in flight at once (with their error)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # already stopping: uvicorn's own handling (SIGINT forces)
            super().handle_exit(sig, frame)
            return
        self.signals += 1
        first_sigterm = sig == signal.SIGTERM and self.signals == 1
        timeout_s = self.shutdown_timeout if first_sigterm else 0.0
        loop = asyncio.get_running_loop()  # the handler runs on the loop's (main) thread
        loop.call_soon_threadsafe(self._start_draining, timeout_s)

    def _start_draining(self, timeout_s: float) -> None:
        if timeout_s > 0:
            log.info("SIGTERM: draining (up to %g s), then exiting", timeout_s)
        else:
            log.info("stopping now: the requests in flight end with an error")
        asyncio.get_running_loop().create_task(self._drain(timeout_s))

    async def _drain(self, timeout_s: float) -> None:
        await self.engine.drain(timeout_s)
        self.should_exit = True  # not a captured signal: uvicorn returns instead of re-raising


def run_server(knobs: dict[str, Any], config: ServerConfig) -> int:
    """Serve until SIGTERM (drained) or SIGINT; returns the exit code."""
    checked = engine_config(**knobs)  # bad options are reported before the address is taken
    transfer_spec = config.transfer()
    if transfer_spec is not None and checked.parallel.data_parallel_size > 1:
        raise PyptoError(
            "a disaggregated server runs one engine (its ranks may be tensor or pipeline "
            "parallel): start one server per data-parallel replica behind `pypto router`, "
            "not data_parallel_size > 1 with disaggregation_mode / kv_transfer_config",
            "disaggregation_mode",
        )
    if config.trust_remote_code:
        log.warning(
            "--trust-remote-code is accepted for vLLM's command lines: no code from the "
            "model's directory runs here (only its weights, config and tokenizer are read)"
        )
    sock = bind(config.host, config.port)
    with contextlib.closing(sock):
        limits = QueueLimits(config.max_queued_requests, config.max_queued_tokens)
        names = config.served_model_name
        first = names[0] if names else None
        transfer = None
        if transfer_spec is not None:
            host = transfer_spec.host
            if host is None and config.host not in ("0.0.0.0", "::", "127.0.0.1", "localhost"):
                host = config.host  # the address it serves on: where its peers reach it
            transfer = KVTransfer(
                transfer_spec.role,
                host,
                transfer_spec.protocol,
                config.kv_transfer_timeout_s,
                transfer_spec.store,
            )
        engine = AsyncLLM.build(knobs, first, config.log_interval_s, limits, transfer)
        names = names or [engine.metrics.model_name]
        app = build_app(engine, config, names)
        log.info(
            "serving %s on http://%s:%d (max_model_len %d)%s",
            " and ".join(map(repr, names)),
            config.host,
            sock.getsockname()[1],
            engine.engine.max_model_len,
            ", API key required" if config.api_key else "",
        )
        server = DrainingServer(uvicorn_config(app, config), engine, config.shutdown_timeout)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises a forced SIGINT
            server.run(sockets=[sock])
    return 0
