"""`pypto serve`: load the engine (compile included), then serve it with uvicorn.

SIGTERM drains: new requests get 503 (`shutting_down`) and /health turns 503, the requests in
flight finish (for up to `shutdown_timeout` seconds, then they end with an error), and the
process exits with code 0. A second SIGTERM, or SIGINT (Ctrl-C), stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

from pypto_serving.config import ServerConfig
from pypto_serving.engine.async_llm import AsyncLLM, QueueLimits
from pypto_serving.server.app import build_app

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 5.0
"""After draining, how long uvicorn waits for connections to close before cancelling them."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM draining the engine before it stops."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.draining is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_running_loop()  # the handler runs on the loop's (main) thread
        loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        if self.draining is None:
            log.info("SIGTERM: draining (up to %g s), then exiting", self.shutdown_timeout)
            self.draining = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await self.engine.drain(self.shutdown_timeout)
        self.should_exit = True  # not a captured signal: uvicorn returns instead of re-raising


def run_server(knobs: dict[str, Any], config: ServerConfig) -> int:
    """Serve until SIGTERM (drained) or SIGINT; returns the exit code."""
    limits = QueueLimits(config.max_queued_requests, config.max_queued_tokens)
    engine = AsyncLLM.build(knobs, config.served_model_name, config.log_interval_s, limits)
    name = engine.metrics.model_name
    app = build_app(engine, config, name)
    log.info(
        "serving %r on http://%s:%d (max_model_len %d)%s",
        name,
        config.host,
        config.port,
        engine.engine.max_model_len,
        ", API key required" if config.api_key else "",
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=CLOSE_GRACE_S,
        ),
        engine,
        config.shutdown_timeout,
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        server.run()
    return 0
