"""Prefill and decode servers on separate hosts (issue 46): Linux network namespaces on a
private network that exists only inside the test (`netns.py`), each server a `pypto serve`
process on its own host, the KV crossing the network on Mooncake's Transfer Engine (TCP), and
`pypto router`s in front as 1P1D, 1P2D and 2P1D. Concurrent requests of different lengths get
the tokens of one engine (GQA; MLA and DeepSeek-V4 as 1P1D); the openai SDK gets a colocated
server's text through the router, streamed or not, and the decode servers compute no prompt
token (their own counters); a prefill server killed mid-run costs no request; a decode server
killed mid-run ends its streams with an error event, never a hang."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import netns
import openai
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
def spawn(
    host: netns.Host, model: Path, role: str | None, logs: str, extra: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen[str]]:
    """`pypto serve --disaggregation-mode ROLE` (None: colocated) on a host at
    http://ADDRESS:8000 (its log in `logs`; `extra`: more options), until the block ends."""
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if v is not True]
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
    argv += ["--host", host.address, "--port", str(HTTP_PORT), "--enforce-eager", *knobs]
    argv += ["--served-model-name", "tiny", *extra]
    if role is not None:
        argv += ["--disaggregation-mode", role, "--kv-transfer-timeout-s", "30"]
    with open(Path(logs, host.address), "w") as log:
        proc = host.run(argv, stderr=log, stdout=log)
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait()


def started(
    stack: ExitStack,
    model: Path,
    roles: list[tuple[netns.Host, str | None]],
    extra: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, subprocess.Popen[str]]:
    """Those servers started together (`extra`: more options, by address), then each waited
    for; by address."""
    logs = stack.enter_context(tempfile.TemporaryDirectory())
    more = extra or {}
    servers = {
        h.address: stack.enter_context(spawn(h, model, role, logs, more.get(h.address, ())))
        for h, role in roles
    }
    for host, _ in roles:
        proc = servers[host.address]

        def up(h: netns.Host = host, p: subprocess.Popen[str] = proc) -> bool:
            return p.poll() is not None or listening(h, h.address, HTTP_PORT)

        wait_until(up, 120, f"pypto serve on {host.address}")
        assert proc.poll() is None, Path(logs, host.address).read_text()[-3000:]
    return servers


def prompt_tokens_computed(front: netns.Host, host: netns.Host) -> float:
    """The server's own count of prompt tokens it computed (cache hits excluded)."""
    text = front.call(lambda: httpx.get(f"http://{host.address}:{HTTP_PORT}/metrics").text)
    (line,) = [x for x in text.splitlines() if x.startswith("pypto_prompt_tokens_total{")]
    return float(line.split()[-1])


async def sdk_texts(url: str) -> list[str]:
    """Through the openai SDK: a chat and a completion, each streamed and not, at once;
    their texts (greedy)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    greedy: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0}
    greedy["extra_body"] = {"ignore_eos": True}
    messages: Any = [{"role": "user", "content": "say something about t5 t9 t11"}]

    async def chat(stream: bool) -> str:
        if not stream:
            r = await client.chat.completions.create(messages=messages, **greedy)
            return r.choices[0].message.content or ""
        chunks = await client.chat.completions.create(messages=messages, stream=True, **greedy)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def complete(stream: bool) -> str:
        if not stream:
            r = await client.completions.create(prompt=PROMPTS[3], **greedy)
            return r.choices[0].text
        chunks = await client.completions.create(prompt=PROMPTS[3], stream=True, **greedy)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    try:
        return list(await asyncio.gather(chat(False), chat(True), complete(False), complete(True)))
    finally:
        await client.close()


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
    with netns.hosts(6) as (p1, p2, d1, d2, colocated, front), ExitStack() as stack:
        roles: list[tuple[netns.Host, str | None]] = [
            (p1, "prefill"),
            (p2, "prefill"),
            (d1, "decode"),
            (d2, "decode"),
            (colocated, None),
        ]
        servers = started(stack, model, roles)
        # the openai SDK through 1P1D gets the colocated server's text; the decode server
        # computed no prompt token of it
        with router(front, 8000, [p1], [d1]) as url:
            want = front.call(lambda: asyncio.run(sdk_texts(f"http://{colocated.address}:8000")))
            got = front.call(lambda url=url: asyncio.run(sdk_texts(url)))
            assert got == want and all(want), (got, want)
            assert prompt_tokens_computed(front, d1) == 0
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
        assert prompt_tokens_computed(front, d1) == prompt_tokens_computed(front, d2) == 0
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
                    d1_metrics = f"http://{d1.address}:{HTTP_PORT}/metrics"
                    deadline = time.monotonic() + patience(60)
                    async with httpx.AsyncClient() as client:
                        while time.monotonic() < deadline:  # once d1 streams some of them
                            text = (await client.get(d1_metrics)).text
                            running = [
                                float(x.split()[-1])
                                for x in text.splitlines()
                                if x.startswith("pypto_num_requests_running{")
                            ]
                            if running and running[0] > 0:
                                break
                            await asyncio.sleep(0.02)
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


@pytest.mark.parametrize("name", ["deepseekv3-qlora-yarn", "deepseekv4-swa-csa-hca-hash"])
def test_mla_and_v4_pages_cross_to_a_decode_host(tiny_model: Any, name: str) -> None:
    """MLA's latent and DeepSeek-V4's entries, rows and CSA inputs over the network: 1P1D
    gives one engine's tokens, streamed or not, the decode server computing no prompt."""
    model: Path = tiny_model(name)
    with tiny_llm(model) as one:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    with netns.hosts(3) as (p, d, front), ExitStack() as stack:
        started(stack, model, [(p, "prefill"), (d, "decode")])
        with router(front, 8000, [p], [d]) as url:
            for stream in (False, True):
                got = front.call(lambda url=url, s=stream: asyncio.run(ask(url, PROMPTS, s)))
                assert got == alone, stream
        assert prompt_tokens_computed(front, d) == 0


def test_tensor_parallel_prefill_and_decode_hosts(tiny_model: Any) -> None:
    """A prefill and a decode server of two TP ranks each: every rank's share of the pages
    crosses (rank 0's Transfer Engine carries them all), one engine's tokens come back and
    the decode server computes no prompt token. A decode server of one rank cannot take
    those pages (its layout differs): it computes the prompts itself, with the same tokens."""
    model: Path = tiny_model(MODEL)
    with tiny_llm(model) as one:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    tp2 = ("--tensor-parallel-size", "2")
    with netns.hosts(4) as (p, d, single, front), ExitStack() as stack:
        roles: list[tuple[netns.Host, str | None]] = [
            (p, "prefill"),
            (d, "decode"),
            (single, "decode"),
        ]
        started(stack, model, roles, {p.address: tp2, d.address: tp2})
        with router(front, 8000, [p], [d]) as url:
            for stream in (False, True):
                got = front.call(lambda url=url, s=stream: asyncio.run(ask(url, PROMPTS, s)))
                assert got == alone, stream
        assert prompt_tokens_computed(front, d) == 0
        with router(front, 8100, [p], [single]) as url:
            got = front.call(lambda url=url: asyncio.run(ask(url, PROMPTS, False)))
            assert got == alone
        assert prompt_tokens_computed(front, single) == sum(len(x) for x in PROMPTS)
