"""A response's size is bounded before the request runs, its prompt's logprobs are computed
and formatted once for all n choices, and a large one is built off the event loop (issue 42,
item 6: a 50 KB body once asked for 258 MB of JSON and stalled /health for 13 s)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from live_server import Live, serving, tiny_llm
from test_front_end_limits import health_during

from pypto_serving.executor import paged
from pypto_serving.server import openai_serving

MODEL = "llama-gqa4-tied"
LONG = "hello world, the quick brown fox " * 40
"""About 300 of the tiny model's 512 positions."""


@pytest.fixture(scope="module")
def live(tiny_model: Callable[[str], Any]) -> Iterator[Live]:
    with serving(tiny_llm(tiny_model(MODEL))) as server:
        yield server


def counted(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, calls: list[int]) -> None:
    """Wrap `module.name` to append the number of prompt positions (or 1) it handles."""
    inner = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(sum(hi - lo for _, lo, hi in args[2]) if name == "score_prompts" else 1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_an_amplifying_request_is_a_400_naming_the_limit(live: Live) -> None:
    # the attack, scaled to the tiny model's context: about 128 x 300 x 21 x 2 logprobs
    attack = {
        "prompt": LONG,
        "max_tokens": 1,
        "prompt_logprobs": 20,
        "n": 128,
        "echo": True,
        "logprobs": 20,
    }
    r = httpx.post(live.url + "/v1/completions", json=attack, timeout=600)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert "limit of 1,000,000 logprobs" in error["message"]
    assert "--max-response-logprobs" in error["message"]
    assert error["param"] in ("logprobs", "prompt_logprobs")
    # chat without max_tokens: what the context leaves, for each of 128 choices
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 128,
        "logprobs": True,
        "top_logprobs": 20,
    }
    r = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(live.url + "/v1/chat/completions", json=chat | {"max_tokens": 8}, timeout=600)
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def test_prompt_logprobs_are_computed_and_formatted_once_for_all_n(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    scored: list[int] = []
    echo_calls: list[int] = []
    vllm_calls: list[int] = []
    counted(monkeypatch, paged, "score_prompts", scored)
    counted(monkeypatch, openai_serving, "echo_logprobs", echo_calls)
    counted(monkeypatch, openai_serving, "vllm_prompt_logprobs", vllm_calls)
    body = {
        "prompt": "the quick brown fox jumps over the lazy dog",
        "max_tokens": 2,
        "n": 4,
        "echo": True,
        "logprobs": 3,
        "prompt_logprobs": 1,
        "seed": 1,
    }
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text[:300]
    prompt = live.llm.tokenizer.encode(body["prompt"])
    choices = r.json()["choices"]
    assert len(choices) == 4
    assert sum(scored) == len(prompt) - 1  # one sample scored the prompt, once
    assert (len(echo_calls), len(vllm_calls)) == (1, 1)  # formatted once for the 4 choices
    first = choices[0]["prompt_logprobs"]
    assert all(c["prompt_logprobs"] == first for c in choices)
    assert first[0] is None and all(len(e) <= 2 for e in first[1:])  # the token + 1 top
    echoed = [{k: v[: len(prompt)] for k, v in c["logprobs"].items()} for c in choices]
    assert all(e == echoed[0] for e in echoed)
    tokens = echoed[0]["tokens"][1:]  # each position: the prompt's token first, then the top 3
    tops = echoed[0]["top_logprobs"][1:]
    assert all(
        next(iter(t)) == token and len(t) in (3, 4) for t, token in zip(tops, tokens, strict=True)
    )
    end = len(live.llm.tokenizer.decode(prompt))
    assert all(c["logprobs"]["text_offset"][len(prompt)] == end for c in choices)


def test_each_choice_echoes_its_own_prompt_with_best_of(live: Live) -> None:
    prompts = ["the quick brown fox", "hello world, what is"]
    body = {"prompt": prompts, "max_tokens": 1, "n": 1, "best_of": 2, "echo": True}
    r = httpx.post(live.url + "/v1/completions", json=body | {"logprobs": 1}, timeout=600)
    assert r.status_code == 200, r.text[:300]
    for choice, prompt in zip(r.json()["choices"], prompts, strict=True):
        assert choice["text"].startswith(prompt)
        ids = live.llm.tokenizer.encode(prompt)
        names = [live.llm.tokenizer.decode([t]) for t in ids]
        assert choice["logprobs"]["tokens"][: len(ids)] == names


def test_streamed_echoes_are_the_same_in_every_choice(live: Live) -> None:
    body = {
        "prompt": "the quick brown fox",
        "max_tokens": 2,
        "n": 3,
        "echo": True,
        "logprobs": 2,
        "prompt_logprobs": 2,
        "stream": True,
    }
    echoes: dict[int, Any] = {}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = httpx.Response(200, content=line[6:]).json()["choices"][0]
                if c["prompt_logprobs"] is not None:
                    echoes[c["index"]] = (c["text"], c["logprobs"], c["prompt_logprobs"])
    assert sorted(echoes) == [0, 1, 2]
    assert echoes[0] == echoes[1] == echoes[2]


def test_health_answers_while_a_large_response_is_built(live: Live) -> None:
    # about 16 x 300 x 21 x 2 = 200,000 logprobs: seconds of formatting and encoding, on a
    # worker thread, where before they held the event loop (and /health) the whole time.
    # As in test_front_end_limits, a process-wide pause may stretch one probe: three tries.
    body = {
        "prompt": LONG,
        "max_tokens": 1,
        "n": 16,
        "echo": True,
        "logprobs": 20,
        "prompt_logprobs": 20,
    }
    tries = []
    for _ in range(3):
        r, seconds, probes = health_during(live, "POST", "/v1/completions", body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 16
        tries.append((seconds, len(probes), max(probes)))
        if len(probes) >= 3 and max(probes) < seconds / 3:
            return
    pytest.fail(f"/health waited for the response in every try (seconds, probes, max): {tries}")
