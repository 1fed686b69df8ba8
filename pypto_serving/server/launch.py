"""`pypto serve`: load the engine (compile included), then serve it with uvicorn."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from pypto_serving.config import ServerConfig
from pypto_serving.engine.async_llm import AsyncLLM, QueueLimits
from pypto_serving.server.app import build_app

log = logging.getLogger(__name__)


def run_server(knobs: dict[str, Any], config: ServerConfig) -> int:
    """Serve until interrupted; returns the exit code."""
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
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
    return 0
