"""What OpenAI and vLLM clients send by default (issue 27's compatibility sweep, first part).

The neutral values clients put in every request (`tools: []`, `logit_bias: {}`, `best_of: 1`,
`response_format: {"type": "text"}`, `store: false`, `metadata`, `parallel_tool_calls`) give
the plain request's answer; a value that would need what is not implemented yet is a 400
`unsupported_parameter` naming it. Also: `logit_bias` (as the offline API applies it),
`GET /v1/models/{id}`, a message's `name` reaching the chat template, the chat stream's role
chunk sent with the first token, /docs without a CDN, CORS, the access log, `pypto --version`
and vLLM's spellings of the command line.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import httpx
import openai
import pytest
from live_server import serving, tiny_llm
from patience import patience

from pypto_serving.cli import build_parser
from pypto_serving.flags import engine_knobs
from pypto_serving.sampling import SamplingParams
from pypto_serving.server.protocol import ChatMessage, conversation

MODEL = "llama-gqa4-tied"
USER = [{"role": "user", "content": "say something"}]


@pytest.fixture(scope="module")
def live(tiny_model):
    with serving(tiny_llm(tiny_model(MODEL))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_neutral_values_give_the_plain_answer(client):
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    neutral = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=8,
        temperature=0,
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        logit_bias={},
        response_format={"type": "text"},
        store=False,
        metadata={"team": "tests"},
        extra_body={"best_of": 1},
    )
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    nulls = httpx.post(
        client.base_url.join("chat/completions").__str__(),
        json={
            "model": "tiny",
            "messages": USER,
            "max_tokens": 8,
            "temperature": 0,
            "tools": None,
            "tool_choice": None,
            "logit_bias": None,
            "best_of": None,
        },
    ).json()
    assert nulls["choices"][0]["message"]["content"] == plain.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="a b c", max_tokens=6, temperature=0)
    same = client.completions.create(
        model="tiny",
        prompt="a b c",
        max_tokens=6,
        temperature=0,
        best_of=1,
        logit_bias={},
        extra_body={"response_format": {"type": "text"}, "store": False},
    )
    assert same.choices[0].text == text.choices[0].text


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(live, client):
    """best_of=4, n=2 samples the same 4 candidates as n=4 with the same seed (child i takes
    seed + i) and returns the 2 whose token logprobs sum highest, best first."""
    kw = dict(model="tiny", prompt="a b c", max_tokens=8, temperature=1.0, seed=7)
    four = client.completions.create(**kw, n=4, logprobs=0)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    two = client.completions.create(**kw, n=2, best_of=4)
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].logprobs is None
    assert two.usage.completion_tokens == four.usage.completion_tokens  # every candidate's
    chat = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=1,
        extra_body={"best_of": 3},
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    for extra, said in (
        ({"best_of": 1, "n": 2}, "at least n"),
        ({"best_of": 3, "stream": True}, "cannot be streamed"),
    ):
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2} | extra
        r = httpx.post(live.url + "/v1/completions", json=body)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "best_of"


@pytest.mark.parametrize(("extra", "param"), [({"store": True}, "store")])
def test_what_is_not_implemented_is_refused_by_name(live, extra, param):
    body = {"model": "tiny", "messages": USER, "max_tokens": 2} | extra
    r = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    assert param in error["message"]


def test_logit_bias_bans_and_forces_tokens_as_offline(live, client):
    plain, _ = offline(live, "a b c", {})
    banned = client.completions.create(
        model="tiny", prompt="a b c", max_tokens=6, temperature=0, logit_bias={str(plain[0]): -100}
    )
    ids, text = offline(live, "a b c", {plain[0]: -100.0})
    assert ids[0] != plain[0] and banned.choices[0].text == text
    forced = client.completions.create(
        model="tiny", prompt="a b c", max_tokens=6, temperature=0.8, seed=3, logit_bias={"42": 100}
    )
    _, text = offline(live, "a b c", {42: 100.0})
    assert forced.choices[0].text == text == live.llm.tokenizer.decode([42] * 6)


def offline(live, prompt: str, bias: dict[int, float]) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias=bias)
    out = live.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def test_models_retrieve(client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_messages_name_reaches_the_chat_template(tiny_model):
    messages = [
        ChatMessage(role="user", content="hi", name="ada"),
        ChatMessage(role="user", content="x"),
    ]
    assert conversation(messages) == [
        {"role": "user", "content": "hi", "name": "ada"},
        {"role": "user", "content": "x"},
    ]
    llm = tiny_llm(tiny_model(MODEL))
    llm.tokenizer.chat_template = (
        "{% for m in messages %}{{ m.get('name', 'anon') }}: {{ m['content'] }}\n{% endfor %}"
    )
    with serving(llm) as live:

        def tokens(message: dict) -> list[int]:
            body = {"messages": [message], "add_generation_prompt": False}
            return httpx.post(live.url + "/tokenize", json=body).json()["tokens"]

        named = tokens({"role": "user", "content": "hi", "name": "ada"})
        assert llm.tokenizer.decode(named) == "ada: hi\n"
        assert llm.tokenizer.decode(tokens({"role": "user", "content": "hi"})) == "anon: hi\n"


def test_the_role_chunk_comes_with_the_first_token(live, monkeypatch):
    """A client timing the first chunk (vLLM's benchmark) times the first token: with every
    step held back 0.3 s, no chunk arrives before the first step is done."""
    core = live.llm.engine
    step = core.step
    monkeypatch.setattr(core, "step", lambda: (time.sleep(0.3), step())[1])
    body = {"model": "tiny", "messages": USER, "max_tokens": 3, "stream": True}
    start = time.monotonic()
    with (
        httpx.Client(timeout=patience(30)) as http,
        http.stream("POST", live.url + "/v1/chat/completions", json=body) as r,
    ):
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)
        waited = time.monotonic() - start
        rest = list(lines)
    assert '"role": "assistant"' in first and waited >= 0.3
    assert rest[-1] == "data: [DONE]"


def test_cors_lets_the_named_origins_in(tiny_model):
    with serving(
        tiny_llm(tiny_model(MODEL)), api_key="k", allowed_origins="https://a.example"
    ) as live:
        preflight = httpx.options(
            live.url + "/v1/chat/completions",
            headers={
                "Origin": "https://a.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200  # no key in a preflight, and none needed
        assert preflight.headers["access-control-allow-origin"] == "https://a.example"
        got = httpx.get(
            live.url + "/v1/models",
            headers={"Origin": "https://a.example", "Authorization": "Bearer k"},
        )
        assert got.status_code == 200
        assert got.headers["access-control-allow-origin"] == "https://a.example"
        other = httpx.get(
            live.url + "/v1/models",
            headers={"Origin": "https://b.example", "Authorization": "Bearer k"},
        )
        assert "access-control-allow-origin" not in other.headers
        refused = httpx.get(live.url + "/v1/models", headers={"Origin": "https://a.example"})
        assert refused.status_code == 401  # the key still guards every route
        assert refused.headers["access-control-allow-origin"] == "https://a.example"


def test_the_docs_pages_need_no_cdn(live):
    for page in ("/docs", "/redoc"):
        html = httpx.get(live.url + page)
        assert html.status_code == 200 and "cdn" not in html.text.lower()
        scripts = [p for p in html.text.split('"') if p.startswith("/static-offline-docs/")]
        assert any(p.endswith(".js") for p in scripts), scripts
        for path in scripts:
            asset = httpx.get(live.url + path)
            assert asset.status_code == 200 and len(asset.content) > 1000, path


def test_no_cors_headers_unless_asked(live):
    got = httpx.get(live.url + "/v1/models", headers={"Origin": "https://a.example"})
    assert "access-control-allow-origin" not in got.headers


def test_the_access_log_when_asked(live, tiny_model, caplog):
    access = logging.getLogger("uvicorn.access")  # uvicorn's own: it does not propagate
    access.addHandler(caplog.handler)
    try:
        httpx.get(live.url + "/v1/models?quiet")  # off by default
    finally:
        access.removeHandler(caplog.handler)
    with serving(tiny_llm(tiny_model(MODEL)), access_log=True) as logged:
        access.addHandler(caplog.handler)  # after uvicorn set up its loggers (and handlers)
        try:
            httpx.get(logged.url + "/v1/models?logged")
        finally:
            access.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    assert any("/v1/models?logged" in line for line in lines), lines
    assert not any("quiet" in line for line in lines), lines


def test_version_and_vllms_spellings():
    out = subprocess.run(
        [sys.executable, "-m", "pypto_serving.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=patience(60),
    )
    assert out.stdout.startswith("pypto ") and out.stdout.split()[1][0].isdigit()
    args = build_parser().parse_args(["serve", "some/model", "-tp", "2", "-pp", "1", "-dp", "3"])
    assert args.model_path == "some/model"
    knobs = engine_knobs(args)
    assert knobs["tensor_parallel_size"] == 2 and knobs["data_parallel_size"] == 3
    assert knobs["pipeline_parallel_size"] == 1


def test_two_different_models_are_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "pypto_serving.cli", "serve", "a", "--model", "b"],
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert proc.returncode != 0 and "two models given" in proc.stderr
    assert "Traceback" not in proc.stderr
