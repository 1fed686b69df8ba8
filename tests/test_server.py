"""The OpenAI-compatible server, driven live with the official `openai` client and raw httpx.

Ground truth is the offline `LLM` API on the same engine: greedy tokens through HTTP must
equal it, one client or 32 at once, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import openai
import pytest
from live_server import serving, tiny_llm
from patience import patience, wait_for
from test_logprobs import expected_name, name_of

from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"


@pytest.fixture(scope="module")
def live(tiny_model):
    llm = tiny_llm(tiny_model(MODEL))
    with serving(llm) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def offline(live, prompts, **params):
    """What the offline API produces for these prompts (token ids and text)."""
    outs = live.llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def tokens_of(live, ids):
    """Logprobs' names of these tokens: text, or `bytes:\\xNN` for part of a character."""
    return [expected_name(live.llm.tokenizer, t) for t in ids]


def prompt_ids(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 10 for j in range(5 + (i * 7) % 40)]


def test_completion_greedy_equals_offline(live, client):
    [(ids, text)] = offline(live, ["hello world"], temperature=0, max_tokens=12)
    r = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=12, temperature=0, logprobs=0
    )
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length"
    assert c.logprobs.tokens == tokens_of(live, ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.object == "text_completion" and r.model == "tiny"


def test_completion_stream_equals_offline(live, client):
    [(ids, text)] = offline(live, [prompt_ids(3)], temperature=0, max_tokens=10)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt_ids(3),
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids) == 10
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids(3))
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_multi_turn_uses_the_chat_template(live, client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and now?"},
    ]
    ids = live.llm.chat_prompt(messages)
    [(out, text)] = offline(live, [ids], temperature=0, max_tokens=8)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=8, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_clients_get_the_offline_answers(live):
    prompts = [prompt_ids(i) for i in range(32)]
    expected = offline(live, prompts, temperature=0, max_tokens=16, ignore_eos=True)
    aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[list[str], str]:
        kw = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
        if i % 2:  # half stream, half not
            text, tokens = "", []
            stream = await aclient.completions.create(
                model="tiny", prompt=prompts[i], stream=True, logprobs=0, **kw
            )
            async for c in stream:
                text += c.choices[0].text
                tokens += c.choices[0].logprobs.tokens if c.choices[0].logprobs else []
            return tokens, text
        r = await aclient.completions.create(model="tiny", prompt=prompts[i], logprobs=0, **kw)
        return r.choices[0].logprobs.tokens, r.choices[0].text

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(32)))

    got = asyncio.run(all_of_them())
    for (ids, text), (tokens, got_text) in zip(expected, got, strict=True):
        assert tokens == tokens_of(live, ids) and got_text == text


def test_sampling_parameters_are_honoured(live, client):
    seeded = dict(
        model="tiny", prompt="abc", max_tokens=8, temperature=1.0, seed=5, extra_body={"top_k": 20}
    )
    a, b = (client.completions.create(**seeded).choices[0].text for _ in range(2))
    assert a == b  # same seed, same tokens
    r = client.completions.create(
        model="tiny", prompt=["abc", "abd"], n=2, max_tokens=4, temperature=0.8, seed=1
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == 3 + 3
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=6, echo=True)
    assert r.choices[0].text.startswith("abc")
    # a stop string cuts the text; the remaining text never contains it
    [(_, text)] = offline(live, ["hello world"], temperature=0, max_tokens=12)
    stop = text[3:5]
    r = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=12, temperature=0, stop=stop
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.01, "top_k": 5},
        user="someone",
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and name_of(bytes(t.bytes)) == t.token for t in content)


def idle(core) -> bool:
    """The engine runs nothing and holds no page."""
    return not core.stats().num_running and core.stats().kv_usage == 0


def test_streaming_client_that_disconnects_is_aborted_and_its_pages_freed(live, monkeypatch):
    core = live.llm.engine
    slow_step = core.step

    def step():  # slow enough that 400 tokens cannot finish while the test watches
        time.sleep(0.01)
        return slow_step()

    monkeypatch.setattr(core, "step", step)
    body = {"model": "tiny", "prompt": "x y z", "max_tokens": 400, "stream": True}
    with (
        httpx.Client(timeout=patience(10)) as http,
        http.stream("POST", live.url + "/v1/completions", json=body | {"ignore_eos": True}) as r,
    ):
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(g.startswith("data: ") or g == "" for g in got)
        assert core.stats().num_running == 1 and core.stats().kv_usage > 0
    wait_for(lambda: idle(core), 1.0, "the request aborted and its pages freed")
    assert 'finished_reason="abort"' in httpx.get(live.url + "/metrics").text  # not "length"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_non_streaming_client_that_disconnects_is_aborted(live, monkeypatch, caplog, route):
    """The abort is quiet: no 500 path, no traceback (it raised InvalidStateError from the
    cancelled task's result(), 114 lines of log per disconnect)."""
    core = live.llm.engine
    slow_step = core.step
    monkeypatch.setattr(core, "step", lambda: (time.sleep(0.01), slow_step())[1])
    body = {"model": "tiny", "max_tokens": 400, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in route else {"prompt": "x"}
    host, port = live.url.removeprefix("http://").split(":")
    content = json.dumps(body).encode()
    head = f"POST /v1/{route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as conn:  # closed once it runs
        conn.sendall(f"{head}Content-Length: {len(content)}\r\n\r\n".encode() + content)
        wait_for(lambda: core.stats().num_running == 1, 30, "the request started")
    wait_for(lambda: idle(core), 5.0, "the request aborted and its pages freed")
    time.sleep(patience(0.2))  # the handler ends after the abort: let it log whatever it would
    assert 'finished_reason="abort"' in httpx.get(live.url + "/metrics").text
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]


BAD = [
    (b"{", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_type"),
    (b"null", 400, None, None),
    (b'{"prompt": "x", "tools": []}', 400, "tools", "unsupported_parameter"),
    (b'{"prompt": "x", "logit_bias": {"1": 200}}', 400, "logit_bias", "invalid_value"),
    (b'{"prompt": "x", "logit_bias": {"one": 2}}', 400, "logit_bias", "invalid_value"),
    (b'{"prompt": "x", "logit_bias": {"99999": 2}}', 400, "logit_bias", "invalid_value"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens", "invalid_value"),
    (b'{"prompt": "x", "n": 0}', 400, "n", "invalid_value"),
    (b'{"prompt": "x", "n": 129}', 400, "n", "invalid_value"),
    (b'{"prompt": ["a", "b", "c"], "n": 50}', 400, "n", "invalid_value"),
    (b'{"prompt": "x", "stop": [""]}', 400, "stop", "invalid_value"),
    (b'{"prompt": [1, 99999]}', 400, "prompt", "invalid_value"),
    (b'{"prompt": []}', 400, "prompt", "invalid_value"),
    (b'{"prompt": ""}', 400, "prompt", "invalid_value"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "model_not_found"),
    (b'{"prompt": "x", "logprobs": 50}', 400, "logprobs", "invalid_value"),
    (b'{"prompt": "x", "prompt_logprobs": 21}', 400, "prompt_logprobs", "invalid_value"),
    (b'{"max_tokens": 3}', 400, "prompt", "missing_required_parameter"),
]


def check_error(r: httpx.Response, status: int, param, code) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code) or code is None
    assert len(r.content) < 2048


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "status", "param", "code"), BAD)
def test_completion_errors(live, body, status, param, code, stream):
    if stream and body.startswith(b"{") and body.endswith(b"}") and body != b"{}":
        body = body[:-1] + b', "stream": true}'
    r = httpx.post(
        live.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    check_error(r, status, param, code)


CHAT_BAD = [
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, "tools", None),
    ({"messages": [{"role": "user", "content": "x"}], "echo": 3}, "echo", None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", None),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "max_completion_tokens": 2,
        },
        "max_tokens",
        None,
    ),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens", None),
    (
        {"messages": [{"role": "user", "content": "x"}], "stream_options": {}},
        "stream_options",
        None,
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), CHAT_BAD)
def test_chat_errors(live, body, param, code):
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", **body})
    check_error(r, 400, param, code)


def test_unknown_model_and_route(live):
    r = httpx.post(
        live.url + "/v1/chat/completions",
        json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
    )
    check_error(r, 404, "model", "model_not_found")
    check_error(httpx.get(live.url + "/v1/nothing"), 404, None, None)


def test_oversized_body_is_413(live):
    big = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    r = httpx.post(live.url + "/v1/completions", content=big)
    check_error(r, 413, None, "request_too_large")


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_several_served_names_answer_as_vllm_does(tiny_model):
    """`--served-model-name a b`: a card for each name; a request answers as the name it
    asked for (the first when it names none); another name is a 404 naming them."""
    with serving(tiny_llm(tiny_model("llama-gqa4-tied")), name=["a", "b"]) as live:
        cards = httpx.get(live.url + "/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["a", "b"]
        assert httpx.get(live.url + "/v1/models/b").json()["id"] == "b"
        for model, answered in (("b", "b"), ("a", "a"), (None, "a")):
            body = {"prompt": "hi", "max_tokens": 2} | ({"model": model} if model else {})
            r = httpx.post(live.url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == answered, r.text
        chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat).json()["model"] == "b"
        r = httpx.post(live.url + "/v1/completions", json={"model": "c", "prompt": "hi"})
        assert r.status_code == 404 and "serves 'a' or 'b'" in r.json()["error"]["message"]


def test_info_routes(live):
    models = httpx.get(live.url + "/v1/models").json()
    card = models["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] > 0
    assert card["root"] == str(live.llm.model_dir) and card["parent"] is None  # vLLM's fields
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/version").json()["version"]
    tok = httpx.post(live.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"] == live.llm.tokenizer.encode("hello world")
    assert tok["count"] == len(tok["tokens"])
    chat = httpx.post(
        live.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["tokens"] == live.llm.chat_prompt([{"role": "user", "content": "hi"}])
    text = httpx.post(live.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == live.llm.tokenizer.decode(tok["tokens"])
    check_error(httpx.post(live.url + "/detokenize", json={"tokens": [-1]}), 400, "tokens", None)
    check_error(httpx.post(live.url + "/tokenize", json={}), 400, "prompt", None)


def test_metrics(live, client):
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=5)
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "pypto_time_to_first_token_seconds_count",
        "pypto_inter_token_latency_seconds_count",
        "pypto_e2e_request_latency_seconds_count",
        "pypto_request_queue_time_seconds_count",
        "pypto_num_requests_running",
        "pypto_num_requests_waiting",
        "pypto_kv_cache_usage_perc",
        "pypto_prefix_cache_queries_total",
        "pypto_prefix_cache_hits_total",
        "pypto_prompt_tokens_total",
        "pypto_generation_tokens_total",
        "pypto_num_preemptions_total",
        "pypto_recompilations_total",
    ):
        assert f'{name}{{model_name="tiny"}}' in text, name
    assert 'pypto_compiling{model_name="tiny"} 0.0' in text  # eager: nothing compiles
    value = next(ln for ln in text.splitlines() if ln.startswith("pypto_generation_tokens_total"))
    assert float(value.split()[-1]) == live.llm.engine.stats().generation_tokens > 0


def test_api_key(tiny_model):
    llm = tiny_llm(tiny_model(MODEL))
    with serving(llm, api_key="sekret") as live:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(live.url + "/v1/completions", json=body, headers=headers)
            check_error(r, 401, None, "invalid_api_key")
        check_error(httpx.get(live.url + "/v1/models"), 401, None, "invalid_api_key")
        ok = openai.OpenAI(base_url=live.url + "/v1", api_key="sekret", max_retries=0)
        # ignore_eos: a sampled EOS (about 1 in the tiny vocabulary's size) must not end it
        r = ok.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 2
        assert httpx.get(live.url + "/health").status_code == 200


def test_engine_failure_turns_health_503(tiny_model):
    llm = tiny_llm(tiny_model(MODEL))

    def broken(*_):
        raise RuntimeError("injected")

    with serving(llm) as live:
        llm.engine.executor.execute = broken
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 200 and '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        assert httpx.get(live.url + "/health").status_code == 503
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"})
        check_error(r, 503, None, "engine_dead")


def test_bench_serve_against_our_server(tiny_model, tmp_path, capsys):
    """`pypto bench serve` end to end: exact token counts; failures counted, never timed."""
    from pypto_serving.cli import main

    model = tiny_model(MODEL)
    with serving(tiny_llm(model, max_model_len=128)) as live:
        flags = ["bench", "serve", "--base-url", live.url, "--tokenizer", str(model)]
        out = tmp_path / "random.json"
        args = ["--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--ignore-eos"]
        assert main([*flags, *args, "--max-concurrency", "3", "--result-json", str(out)]) == 0
        r = json.loads(out.read_text())
        assert (r["successful"], r["failed"], r["model"]) == (6, 0, "tiny")
        assert (r["prompt_tokens"], r["output_tokens"]) == (48, 24)
        assert r["ttft"]["median_ms"] > 0 and r["tpot"]["median_ms"] > 0
        # conversations outgrow the 128-token context on their second turn: a 400 each
        out = tmp_path / "turns.json"
        args = ["--dataset", "multi-turn", "--num-conversations", "2", "--turns", "3"]
        args += ["--input-len", "30", "--output-len", "40", "--ignore-eos"]
        assert main([*flags, *args, "--result-json", str(out)]) == 0
        r = json.loads(out.read_text())
        assert (r["successful"], r["failed"]) == (2, 4)
        reasons = " ".join(r["failure_reasons"])
        assert "HTTP 400" in reasons and "context is 128" in reasons
        assert r["output_tokens"] == 2 * 40
        assert all(q["ttft_s"] is None for q in r["requests"] if not q["success"])
    assert "failed requests" in capsys.readouterr().out


def test_busy_server_logs_throughput(tiny_model, caplog):
    llm = tiny_llm(tiny_model(MODEL))
    with (
        caplog.at_level("INFO", logger="pypto_serving.engine.async_llm"),
        serving(llm, log_interval_s=0.2) as live,
    ):
        body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True}
        httpx.post(live.url + "/v1/completions", json=body, timeout=patience(30))
        wait_for(lambda: "generation" in caplog.text, 5, "a throughput line logged")
    line = next(r.getMessage() for r in caplog.records if "generation" in r.getMessage())
    for part in ("prompt", "tok/s", "running", "waiting", "KV usage", "prefix cache hit rate"):
        assert part in line
