"""A real server (uvicorn on a free loopback port, in a thread) around an LLM, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from patience import patience

from pypto_serving.config import ServerConfig
from pypto_serving.engine.async_llm import AsyncLLM, QueueLimits
from pypto_serving.engine.llm import LLM
from pypto_serving.outputs import RequestOutput
from pypto_serving.sampling import SamplingParams
from pypto_serving.server.app import build_app
from pypto_serving.server.launch import uvicorn_config

# tiny models, no torch.compile, a small KV pool: the server starts in about a second
FAST_KNOBS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "num_kv_pages": 64,
    "page_size": 16,
}


@dataclass
class Live:
    url: str
    llm: LLM
    engine: AsyncLLM
    model: str
    app: Any = None


def tiny_llm(model_dir: Path, **knobs: Any) -> LLM:
    return LLM(str(model_dir), **(FAST_KNOBS | knobs))


def generate_salted(
    llm: LLM, prompt: list[int], params: SamplingParams, salt: str
) -> RequestOutput:
    """One request with a cache_salt (as the server's `cache_salt` field gives it), to the end."""
    family = llm.add(prompt, params, cache_salt=salt)
    while llm.engine.has_unfinished():
        llm.step()
    return family.output()


def free_port() -> int:
    """A port free now whose next one is free too: several nodes' engines listen on a
    master_port and on master_port + 1 (the rendezvous of DP attention + EP)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port < 65535 and _bindable(port + 1):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextmanager
def serving(
    llm: LLM, name: str | list[str] = "tiny", transfer: Any = None, **server: Any
) -> Iterator[Live]:
    """Serve `llm` until the block ends, under `name` (or several names); `transfer`: its
    end of disaggregated serving (a KVTransfer)."""
    names = [name] if isinstance(name, str) else name
    config = ServerConfig(port=free_port(), **server)
    limits = QueueLimits(config.max_queued_requests, config.max_queued_tokens)
    engine = AsyncLLM(llm, names[0], config.log_interval_s, limits=limits, transfer=transfer)
    app = build_app(engine, config, names)
    uv = uvicorn.Server(uvicorn_config(app, config))  # `pypto serve`'s settings and limits
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + patience(30)
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Live(f"http://{config.host}:{config.port}", llm, engine, name, app)
    finally:
        uv.should_exit = True
        thread.join(timeout=patience(30))


@dataclass(frozen=True)
class Served:
    url: str
    pid: int


@contextmanager
def pypto_serve(
    flags: Sequence[str], start_s: float = 600, log: Path | None = None
) -> Iterator[Served]:
    """`pypto serve *flags` as its own process on a free loopback port, until the block ends
    (then SIGTERM); yields it once /health is 200. Its log goes to `log` (a file), else
    to this process's stderr."""
    port = free_port()
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--port", str(port), *flags]
    out = open(log, "w") if log else None  # noqa: SIM115 (closed below)
    server = subprocess.Popen(argv, env=os.environ, stderr=out, stdout=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`pypto serve {' '.join(flags)}` did not start")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        yield Served(url, server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if out:
            out.close()


def assert_served_as_offline(
    llm: LLM, prompts: list[list[int]], offline: list[Any], max_tokens: int
) -> None:
    """Serve `llm` (after its offline run: once served, the server's loop steps the same
    engine) and check each prompt's greedy completion over HTTP is the offline text, to its
    length."""
    with serving(llm) as live:
        for prompt, out in zip(prompts, offline, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
            body |= {"temperature": 0, "ignore_eos": True}
            r = httpx.post(live.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (out.outputs[0].text, "length")
            assert r.json()["usage"]["completion_tokens"] == max_tokens
