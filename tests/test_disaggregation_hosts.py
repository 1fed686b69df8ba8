"""Prefill and decode servers on separate hosts (issue 46): Linux network namespaces on a
private network that exists only inside the test (`netns.py`), each server a `pypto serve`
process on its own host, the KV crossing the network on Mooncake's Transfer Engine (TCP), and
`pypto router`s in front as 1P1D, 1P2D and 2P1D. Concurrent requests of different lengths get
the tokens of one engine; a prefill server killed mid-run costs no request; a decode server
killed mid-run ends its streams with an error event, never a hang."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import netns
import pytest
from live_server import FAST_KNOBS, tiny_llm
from patience import patience
from test_multi_host import HTTP_PORT, listening, wait_until

from pypto_serving.sampling import SamplingParams

pytestmark = [
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
    pytest.mark.slow,
]

MODEL = "llama-gqa4-tied"
PROMPTS = [[(11 * i + 5 * j) % 290 + 7 for j in range(n)] for i, n in enumerate((3, 17, 40, 66))]
MAX_TOKENS = 10


@contextmanager
def spawn(host: netns.Host, model: Path, role: str, logs: str) -> Iterator[subprocess.Popen[str]]:
    """`pypto serve --disaggregation-mode ROLE` on a host at http://ADDRESS:8000 (its log in
    `logs`), until the block ends."""
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if v is not True]
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
    argv += ["--host", host.address, "--port", str(HTTP_PORT), "--enforce-eager", *knobs]
    argv += ["--disaggregation-mode", role, "--kv-transfer-timeout-s", "30"]
    with open(Path(logs, host.address), "w") as log:
        proc = host.run(argv, stderr=log, stdout=log)
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait()


@contextmanager
def router(
    host: netns.Host, port: int, prefill: list[netns.Host], decode: list[netns.Host]
) -> Iterator[str]:
    """`pypto router` on `host` at `port` in front of those servers; yields its URL."""
    urls = {
        role: [f"http://{h.address}:{HTTP_PORT}" for h in hs]
        for role, hs in (("p", prefill), ("d", decode))
    }
    argv = [sys.executable, "-m", "pypto_serving.cli", "router", "--host", host.address]
    argv += [
        "--port",
        str(port),
        "--retry-s",
        "60",
        "--prefill",
        *urls["p"],
        "--decode",
        *urls["d"],
    ]
    proc = host.run(argv, stderr=subprocess.PIPE)
    try:
        wait_until(
            lambda: proc.poll() is not None or listening(host, host.address, port), 60, "the router"
        )
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        yield f"http://{host.address}:{port}"
    finally:
        proc.kill()
        proc.wait()


async def ask(
    url: str, prompts: list[list[int]], stream: bool, max_tokens: int = MAX_TOKENS
) -> list[Any]:
    """Every prompt at once (greedy); each answer's token ids, or the error event that ended
    its stream."""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> Any:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        body |= {"return_token_ids": True, "stream": stream}
        if not stream:
            r = await client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        ids: list[int] = []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return event["error"]
                for c in event["choices"]:
                    ids += c.get("token_ids") or []
        return ids

    async with httpx.AsyncClient(timeout=patience(120)) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


def test_prefill_and_decode_servers_on_their_own_hosts(tiny_model: Any) -> None:
    model: Path = tiny_model(MODEL)
    with tiny_llm(model) as one:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    with netns.hosts(5) as (p1, p2, d1, d2, front), ExitStack() as stack:
        roles = ((p1, "prefill"), (p2, "prefill"), (d1, "decode"), (d2, "decode"))
        logs = stack.enter_context(tempfile.TemporaryDirectory())
        servers = {h.address: stack.enter_context(spawn(h, model, role, logs)) for h, role in roles}
        for host, _ in roles:  # started together, then each waited for
            proc = servers[host.address]

            def up(h: netns.Host = host, p: subprocess.Popen[str] = proc) -> bool:
                return p.poll() is not None or listening(h, h.address, HTTP_PORT)

            wait_until(up, 120, f"pypto serve on {host.address}")
            assert proc.poll() is None, Path(logs, host.address).read_text()[-3000:]
        layouts = {
            "1P1D": ([p1], [d1]),
            "1P2D": ([p1], [d1, d2]),
            "2P1D": ([p1, p2], [d1]),
        }
        for port, (name, (prefill, decode)) in enumerate(layouts.items(), 8100):
            with router(front, port, prefill, decode) as url:
                for stream in (False, True):
                    got = front.call(lambda url=url, s=stream: asyncio.run(ask(url, PROMPTS, s)))
                    assert got == alone, (name, stream)
                text = front.call(lambda url=url: httpx.get(url + "/metrics").text)
                assert "pypto_router_colocated_total 0.0" in text, name  # all handed off
        # the first prefill server dies, unannounced, between two runs: the next run's
        # requests sent to it go to the second; none is lost
        with router(front, 8200, [p1, p2], [d1, d2]) as url:
            run = front.call(lambda: asyncio.run(ask(url, PROMPTS * 2, False)))
            assert run == alone * 2
            servers[p1.address].send_signal(signal.SIGKILL)
            got = front.call(lambda: asyncio.run(ask(url, PROMPTS * 2, True)))
            assert got == alone * 2
        # a decode server dies mid-stream: its streams end with an error event, the rest
        # finish; then the other decode server serves every request
        with router(front, 8300, [p2], [d1, d2]) as url:
            short, many = [PROMPTS[0], PROMPTS[1]] * 2, 400

            def kill_d1_soon() -> list[Any]:
                async def go() -> list[Any]:
                    task = asyncio.create_task(ask(url, short, True, many))
                    await asyncio.sleep(0.3)
                    servers[d1.address].send_signal(signal.SIGKILL)
                    return await task

                return asyncio.run(go())

            ended = front.call(kill_d1_soon)
            errors = [e for e in ended if isinstance(e, dict)]
            assert errors, "no stream was cut: d1 finished before it was killed"
            assert all("stopped mid-answer" in e["message"] for e in errors)
            assert all(len(e) == many for e in ended if isinstance(e, list))
            got = front.call(lambda: asyncio.run(ask(url, PROMPTS, True)))
            assert got == alone
