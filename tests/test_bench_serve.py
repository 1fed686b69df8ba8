"""`pypto bench serve` against fake OpenAI-compatible servers (no model runs).

Most tests inject an `httpx.MockTransport`; one runs a tiny FastAPI app under uvicorn, so the
client also meets real sockets, chunked SSE and a connection cut mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import Request
from patience import patience, wait_for

from pypto_serving.bench import serve
from pypto_serving.bench.serve_client import (
    RequestRecord,
    Target,
    arrival_times,
    make_client,
    send_request,
)
from pypto_serving.cli import main
from pypto_serving.errors import PyptoError

URL = "http://fake:8000"


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def reply_chunks(
    body: dict[str, Any], words: list[str], usage: bool, details: dict[str, Any] | None = None
) -> list[bytes]:
    """A well-formed stream: role chunk (chat), one chunk per word, usage, [DONE]."""
    chat = "messages" in body
    chunks = [sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})] if chat else []
    for w in words:
        choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
        chunks.append(sse({"choices": [choice]}))
    if usage:
        prompt = body.get("prompt") or body.get("messages")
        u = {"prompt_tokens": len(prompt), "completion_tokens": len(words)}
        if details is not None:
            u["prompt_tokens_details"] = details
        chunks.append(sse({"choices": [], "usage": u}))
    return [*chunks, sse("[DONE]")]


class FakeServer:
    """An OpenAI-compatible streaming server as an httpx transport.

    `behaviour(i, body)` picks what request i gets: "ok", "http400", "cut" (ends before
    [DONE]), "drop" (connection error mid-stream), "error-event" or "bad-json"."""

    def __init__(
        self,
        behaviour: Callable[[int, dict[str, Any]], str] = lambda i, body: "ok",
        usage: bool = True,
        delay_s: float = 0.0,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.behaviour, self.usage, self.delay_s = behaviour, usage, delay_s
        self.details = details
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.replies: list[str] = []
        self.in_flight = self.max_in_flight = 0

    def words(self, i: int, body: dict[str, Any]) -> list[str]:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        return [f"r{i}.{k} " for k in range(n)]

    async def stream(self, chunks: list[bytes], fail: str | None) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for n, chunk in enumerate(chunks):
                await asyncio.sleep(self.delay_s)
                if fail and n == 2:
                    if fail == "drop":
                        raise httpx.RemoteProtocolError("peer closed connection")
                    if fail == "error-event":
                        yield sse({"error": {"message": "engine died", "type": "x"}})
                        yield sse("[DONE]")
                    if fail == "bad-json":
                        yield b"data: {not json\n\n"
                    return
                yield chunk
        finally:
            self.in_flight -= 1

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        i = len(self.bodies)
        self.bodies.append(body)
        self.headers.append(request.headers)
        kind = self.behaviour(i, body)
        if kind == "http400":
            error = {"message": "prompt is too long", "type": "invalid_request_error"}
            return httpx.Response(400, json={"error": error})
        words = self.words(i, body)
        self.replies.append("".join(words))
        chunks = reply_chunks(body, words, self.usage, self.details)
        fail = None if kind == "ok" else kind
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self.stream(chunks, fail),
        )

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def run_info(dataset: str) -> dict[str, Any]:
    """What `serve.summarize` is told about a run besides its records."""
    return dict(
        base_url=URL,
        endpoint="completions",
        model="m",
        dataset=dataset,
        request_rate=None,
        max_concurrency=None,
    )


def ticking_clock() -> Callable[[], float]:
    """A clock that advances one second per reading."""
    ticks = iter(range(1000))
    return lambda: float(next(ticks))


def send(server: FakeServer, prompt: Any, output_len: int, endpoint: str = "completions"):
    target = Target(URL, endpoint, "fake-model", ignore_eos=True, api_key="sk-test")
    record = RequestRecord(0, 0)

    async def go() -> RequestRecord:
        async with make_client(target, server.transport) as client:
            return await send_request(
                client, target, prompt, 7, output_len, record, clock=ticking_clock()
            )

    return asyncio.run(go())


def test_sse_stream_is_timed_and_counted_from_usage():
    server = FakeServer()
    r = send(server, [5, 6, 7, 8, 9], 4)
    assert r.success and r.error == "" and r.status == 200
    assert (r.prompt_tokens, r.completion_tokens) == (5, 4)
    assert r.text == "r0.0 r0.1 r0.2 r0.3 "
    # clock reads: send=0, chunks at 1, 2, 3, 4, end=5
    assert r.ttft_s == 1 and r.itl_s == [1, 1, 1] and r.e2e_s == 5
    assert r.tpot_s == pytest.approx((5 - 1) / 3)
    body = server.bodies[0]
    assert body["prompt"] == [5, 6, 7, 8, 9] and body["max_tokens"] == 4
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["model"] == "fake-model"
    assert server.headers[0]["authorization"] == "Bearer sk-test"


def test_cached_tokens_per_tier_are_read_from_usage_and_summarized():
    tiers = {"device": 1, "cpu": 2, "ssd": 0}
    server = FakeServer(details={"cached_tokens": 3, "cached_tokens_per_tier": tiers})
    r = send(server, [5, 6, 7, 8, 9, 10], 2)
    assert r.cached_tokens == 3 and r.cached_tokens_per_tier == tiers
    plain = send(FakeServer(), [5, 6], 2)  # a server without details (e.g. no usage extension)
    assert plain.cached_tokens is None and plain.cached_tokens_per_tier == {}
    info = run_info("multi-turn")
    result = serve.summarize([r, plain], 1.0, {}, info)
    assert result.cached_prompt_fraction == pytest.approx(0.5)  # of the requests that reported
    assert result.cached_fraction_per_tier == pytest.approx(
        {"device": 1 / 6, "cpu": 2 / 6, "ssd": 0}
    )
    rows = dict(serve.table_rows(result))
    assert rows["prompt tokens cached (%)"] == "50.0"
    assert rows["  of which from cpu (%)"] == "33.3"
    assert serve.summarize([plain], 1.0, {}, info).cached_prompt_fraction is None


def test_chat_stream_without_usage_counts_text_chunks():
    server = FakeServer(usage=False)
    messages = [{"role": "user", "content": "hi"}]
    r = send(server, messages, 3, endpoint="chat")
    assert r.success and r.completion_tokens == 3 and r.prompt_tokens == 7  # 7: the fallback
    # the role-only chunk (clock not read) does not count as the first token
    assert r.ttft_s == 1 and r.itl_s == [1, 1] and r.text == "r0.0 r0.1 r0.2 "
    body = server.bodies[0]
    assert body["messages"] == messages and body["max_completion_tokens"] == 3


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("http400", "HTTP 400: prompt is too long"),
        ("cut", "the stream ended before [DONE]"),
        ("drop", "RemoteProtocolError: peer closed connection"),
        ("error-event", "error event: engine died"),
        ("bad-json", "invalid JSON in the stream"),
    ],
)
def test_failed_requests_carry_their_reason_and_no_timings(kind, reason):
    r = send(FakeServer(lambda i, body: kind), [1, 2, 3], 5)
    assert not r.success and reason in r.error
    assert r.ttft_s is None and r.e2e_s is None and r.completion_tokens == 0
    assert r.status == (400 if kind == "http400" else 200)


def record(i: int, ms: float, success: bool = True, tokens: int = 3) -> RequestRecord:
    r = RequestRecord(i, 0, success=success, error="" if success else "HTTP 500: boom")
    if success:
        r.prompt_tokens, r.completion_tokens = 10, tokens
        r.ttft_s, r.e2e_s, r.tpot_s = ms / 1000, 2 * ms / 1000, ms / 2000
        r.itl_s = [ms / 1000] * (tokens - 1)
    return r


def test_summary_statistics_and_goodput():
    records = [record(i, ms) for i, ms in enumerate(range(1, 101))]
    records += [record(100, 0, success=False), record(101, 0, success=False)]
    info = run_info("random")
    r = serve.summarize(records, 10.0, {"ttft": 50, "e2e": 90}, info)
    assert (r.num_requests, r.successful, r.failed) == (102, 100, 2)
    assert (r.prompt_tokens, r.output_tokens) == (1000, 300)  # failures excluded
    assert r.requests_per_s == 10 and r.output_tok_per_s == 30 and r.total_tok_per_s == 130
    assert r.ttft.median_ms == pytest.approx(50.5) and r.ttft.mean_ms == pytest.approx(50.5)
    assert r.ttft.p99_ms == pytest.approx(99.01)
    assert r.e2e.median_ms == pytest.approx(101) and r.tpot.p99_ms == pytest.approx(49.505)
    assert r.itl.median_ms == pytest.approx(50.5)
    # ttft <= 50 ms and e2e <= 90 ms: requests 1..45 ms
    assert r.goodput_requests_per_s == pytest.approx(4.5)
    assert r.failure_reasons == {"HTTP 500: boom": 2}
    assert serve.summarize(records, 10.0, {}, info).goodput_requests_per_s is None


def test_slo_parsing():
    assert serve.parse_slo(["ttft:200", "TPOT:12.5", "e2e:3000"]) == {
        "ttft": 200,
        "tpot": 12.5,
        "e2e": 3000,
    }
    assert serve.parse_slo(None) == {}
    for bad in (["ttft"], ["ttft:x"], ["itl:5"], ["ttft:-1"], ["e2e:inf"], ["ttft:1", "ttft:2"]):
        with pytest.raises(PyptoError, match="--slo"):
            serve.parse_slo(bad)


def test_poisson_arrivals_are_seeded():
    a = arrival_times(2000, 4.0, seed=3)
    assert a == arrival_times(2000, 4.0, seed=3) != arrival_times(2000, 4.0, seed=4)
    assert a[0] == 0 and all(x <= y for x, y in itertools.pairwise(a))
    assert np.mean(np.diff(a)) == pytest.approx(1 / 4.0, rel=0.1)
    assert arrival_times(3, math.inf, seed=3) == [0.0, 0.0, 0.0]


def bench_args(tokenizer: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers(dest="bench_command"))
    return parser.parse_args(["serve", "--base-url", URL, "--tokenizer", str(tokenizer), *flags])


@pytest.fixture
def tokenizer_dir(tiny_model) -> Path:
    return tiny_model("llama-gqa4-tied")


def test_random_run_writes_result_json_with_failures(tokenizer_dir, tmp_path, capsys):
    server = FakeServer(lambda i, body: "http400" if i % 3 == 2 else "ok")
    out = tmp_path / "r.json"
    args = bench_args(
        tokenizer_dir,
        *("--num-prompts", "6", "--input-len", "9", "--output-len", "4"),
        *("--result-json", str(out), "--slo", "e2e:60000", "--max-concurrency", "2"),
    )
    assert serve.run(args, server.transport) == 0
    r = json.loads(out.read_text())
    assert (r["benchmark"], r["model"], r["endpoint"]) == ("serve", "fake-model", "completions")
    assert (r["num_requests"], r["successful"], r["failed"]) == (6, 4, 2)
    assert (r["prompt_tokens"], r["output_tokens"]) == (4 * 9, 4 * 4)
    assert r["failure_reasons"] == {"HTTP 400: prompt is too long": 2}
    assert r["goodput_requests_per_s"] == pytest.approx(r["requests_per_s"])
    assert r["request_rate"] is None and r["max_concurrency"] == 2
    assert r["ttft"]["median_ms"] > 0 and r["itl"]["p99_ms"] > 0
    assert len(r["requests"]) == 6 and sum(q["success"] for q in r["requests"]) == 4
    assert all(len(b["prompt"]) == 9 and isinstance(b["prompt"][0], int) for b in server.bodies)
    assert server.max_in_flight <= 2
    stdout = capsys.readouterr().out
    assert "failed requests" in stdout and "2  HTTP 400: prompt is too long" in stdout


def test_vllms_spellings_run_the_same_benchmark(tokenizer_dir, tmp_path):
    """`vllm bench serve`'s flags: --backend openai-chat, --dataset-name, --random-input-len,
    --random-output-len."""
    server = FakeServer(lambda i, body: "ok")
    out = tmp_path / "r.json"
    args = bench_args(
        tokenizer_dir,
        *("--backend", "openai-chat", "--dataset-name", "random", "--num-prompts", "2"),
        *("--random-input-len", "7", "--random-output-len", "3", "--result-json", str(out)),
    )
    assert serve.run(args, server.transport) == 0
    r = json.loads(out.read_text())
    assert r["endpoint"] == "chat" and r["output_tokens"] == 2 * 3
    assert all(b.get("max_completion_tokens", b.get("max_tokens")) == 3 for b in server.bodies)
    assert all("messages" in b for b in server.bodies)


def test_every_request_failing_is_an_error(tokenizer_dir):
    server = FakeServer(lambda i, body: "cut")
    args = bench_args(tokenizer_dir, "--num-prompts", "3", "--input-len", "4")
    with pytest.raises(PyptoError, match=r"all 3 requests failed.*ended before"):
        serve.run(args, server.transport)


def test_shared_prefix_sends_one_prefix_and_unique_suffixes(tokenizer_dir):
    server = FakeServer()
    args = bench_args(
        tokenizer_dir,
        "--dataset",
        "shared-prefix",
        *("--prefix-len", "12", "--input-len", "5", "--num-prompts", "4", "--output-len", "2"),
    )
    assert serve.run(args, server.transport) == 0
    prompts = [b["prompt"] for b in server.bodies]
    assert all(len(p) == 17 and p[:12] == prompts[0][:12] for p in prompts)
    assert len({tuple(p[12:]) for p in prompts}) == 4
    server = FakeServer()
    assert serve.run(args, server.transport) == 0
    assert [b["prompt"] for b in server.bodies] == prompts  # seeded


@pytest.mark.parametrize("workload", ["echo", "open"])
def test_speculative_workloads_send_their_chat_prompts_in_turn(tokenizer_dir, workload):
    """--dataset echo|open: speculative decoding's chat prompts, round and round; chat by
    default, or their chat-template token ids to the completions endpoint."""
    from pypto_serving.bench.datasets import WORKLOADS, chat_prompts
    from pypto_serving.models.loader import load_tokenizer

    texts = WORKLOADS[workload]
    server = FakeServer()
    args = bench_args(tokenizer_dir, "--dataset", workload, "--num-prompts", "6")
    assert serve.run(args, server.transport) == 0
    sent = sorted(b["messages"][-1]["content"] for b in server.bodies)
    assert sent == sorted(texts[i % len(texts)] for i in range(6))
    server = FakeServer()
    args = bench_args(
        tokenizer_dir, "--dataset", workload, "--num-prompts", "2", "--endpoint", "completions"
    )
    assert serve.run(args, server.transport) == 0
    ids = chat_prompts(load_tokenizer(tokenizer_dir), workload)
    assert sorted(b["prompt"] for b in server.bodies) == sorted(ids[:2])


def test_multi_turn_prompt_grows_with_the_replies(tokenizer_dir, capsys):
    server = FakeServer(delay_s=0.001)
    args = bench_args(
        tokenizer_dir,
        "--dataset",
        "multi-turn",
        *("--num-conversations", "2", "--turns", "3", "--input-len", "6", "--output-len", "3"),
    )
    assert serve.run(args, server.transport) == 0
    assert all("messages" in b for b in server.bodies) and len(server.bodies) == 6
    by_conv: dict[str, list[tuple[int, list[dict[str, str]]]]] = {}
    for i, b in enumerate(server.bodies):
        by_conv.setdefault(b["messages"][0]["content"], []).append((i, b["messages"]))
    assert len(by_conv) == 2
    for turns in by_conv.values():
        assert [len(m) for _, m in turns] == [1, 3, 5]
        for (prev_i, prev), (_, now) in itertools.pairwise(turns):
            assert now[: len(prev)] == prev  # the earlier conversation is kept as is
            assert now[len(prev)] == {"role": "assistant", "content": server.replies[prev_i]}
            assert now[-1]["role"] == "user" and now[-1]["content"]
    stdout = capsys.readouterr().out
    assert "TTFT median, first turns (ms)" in stdout and "later turns" in stdout


def test_multi_turn_think_time_delays_each_later_turn(tokenizer_dir, tmp_path):
    out = tmp_path / "r.json"
    args = bench_args(
        tokenizer_dir,
        *("--dataset", "multi-turn", "--num-conversations", "2", "--turns", "2"),
        *("--think-time", "0.3", "--result-json", str(out)),
    )
    assert serve.run(args, FakeServer().transport) == 0
    records = json.loads(out.read_text())["requests"]
    for conv in (0, 1):
        first, second = (r for r in records if r["conversation"] == conv)
        assert second["start_s"] - (first["start_s"] + first["e2e_s"]) >= 0.3


def test_multi_turn_later_turns_are_skipped_after_a_failure(tokenizer_dir, tmp_path):
    server = FakeServer(lambda i, body: "http400" if len(body["messages"]) == 3 else "ok")
    out = tmp_path / "r.json"
    args = bench_args(
        tokenizer_dir,
        *("--dataset", "multi-turn", "--num-conversations", "1", "--turns", "3"),
        *("--input-len", "4", "--output-len", "2", "--json", str(out)),
    )
    assert serve.run(args, server.transport) == 0
    r = json.loads(out.read_text())
    assert len(server.bodies) == 2 and (r["successful"], r["failed"]) == (1, 2)
    assert [q["turn"] for q in r["requests"]] == [0, 1, 2]
    assert "not sent" in r["requests"][2]["error"]
    assert r["ttft_first_turn_median_ms"] > 0 and r["ttft_later_turns_median_ms"] is None


def test_request_rate_spreads_the_arrivals(tokenizer_dir, tmp_path):
    out = tmp_path / "r.json"
    args = bench_args(
        tokenizer_dir,
        *("--num-prompts", "4", "--input-len", "3", "--output-len", "2", "--seed", "5"),
        *("--request-rate", "40", "--json", str(out)),
    )
    assert serve.run(args, FakeServer().transport) == 0
    starts = [q["start_s"] for q in json.loads(out.read_text())["requests"]]
    expected = arrival_times(4, 40.0, seed=5)
    assert starts == pytest.approx(expected, abs=0.03)


def test_plot_writes_a_png(tokenizer_dir, tmp_path):
    png = tmp_path / "plots" / "serve.png"
    args = bench_args(
        tokenizer_dir,
        *("--num-prompts", "5", "--input-len", "3", "--output-len", "4", "--plot", str(png)),
    )
    assert serve.run(args, FakeServer(delay_s=0.001).transport) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tokenizer_dir, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    args = bench_args(tokenizer_dir, "--plot", str(tmp_path / "p.png"))
    with pytest.raises(PyptoError, match="pip install matplotlib"):
        serve.run(args, FakeServer().transport)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--base-url", "http://127.0.0.1:1"], "cannot reach the server at http://127.0.0.1:1"),
        (["--base-url", "127.0.0.1:8000"], "--base-url must start with http://"),
        (["--dataset", "sharegpt"], "unknown dataset 'sharegpt'"),
        (["--dataset", "multi-turn", "--endpoint", "completions"], "needs --endpoint chat"),
        (["--think-time", "-1"], "--think-time must be a number of seconds >= 0"),
        (["--slo", "ttft=5"], "bad --slo 'ttft=5'"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--backend", "openai-chat", "--endpoint", "completions"], "disagree"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, flags, message):
    code = main(["bench", "serve", "--tokenizer", "/nonexistent", *flags])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("pypto: error:") and message in err
    assert "Traceback" not in err


def test_server_without_models_list_needs_model_name(tokenizer_dir):
    transport = httpx.MockTransport(lambda request: httpx.Response(404, json={"detail": "no"}))
    with pytest.raises(PyptoError, match=r"answered HTTP 404.*--model-name"):
        serve.run(bench_args(tokenizer_dir), transport)


# --- a real HTTP server: sockets, chunked transfer, a connection cut mid-stream ----------


@pytest.fixture
def live_fake_server() -> Iterator[tuple[str, list[int]]]:
    """(base URL, the prompts whose connection it cut): cuts odd first tokens mid-stream."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    cut_prompts: list[int] = []

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "live-model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        words = [f"w{k} " for k in range(body["max_tokens"])]
        chunks = reply_chunks(body, words, usage=True)
        cut = body["prompt"][0] % 2 == 1
        if cut:
            cut_prompts.append(body["prompt"][0])

        async def stream() -> AsyncIterator[bytes]:
            for n, chunk in enumerate(chunks):
                if cut and n == 2:
                    raise RuntimeError("the server dies mid-stream")
                yield chunk
                await asyncio.sleep(0.001)

        return StreamingResponse(stream(), media_type="text/event-stream")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "the fake server started")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", cut_prompts
    server.should_exit = True
    thread.join(timeout=patience(5))
    sock.close()


def test_cli_against_a_real_http_server(live_fake_server, tokenizer_dir, tmp_path, capsys):
    url, cut_prompts = live_fake_server
    out = tmp_path / "r.json"
    code = main(
        [
            "bench",
            "serve",
            *("--base-url", url, "--tokenizer", str(tokenizer_dir)),
            *("--num-prompts", "8", "--input-len", "5", "--output-len", "3", "--json", str(out)),
        ]
    )
    assert code == 0
    r = json.loads(out.read_text())
    cut = len(cut_prompts)
    assert r["model"] == "live-model" and r["base_url"] == url.removesuffix("/v1")
    assert 0 < cut < 8 and (r["failed"], r["successful"]) == (cut, 8 - cut)
    assert r["output_tokens"] == 3 * r["successful"] and r["prompt_tokens"] == 5 * r["successful"]
    assert [*r["failure_reasons"]] == [
        "RemoteProtocolError: peer closed connection without sending complete message body "
        "(incomplete chunked read)"
    ]
    assert "output tok/s" in capsys.readouterr().out
