"""The sampler's numeric edges through the server: tiny temperatures are greedy (1e-40 was 0
in float32 and sampled token 0 from NaN logits), and a request whose logits are NaN fails
alone with a clear error while the rest of the batch, and the engine, go on."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from live_server import FAST_KNOBS, serving, tiny_llm
from patience import patience, wait_for

from pypto_serving.errors import RequestFailedError, RequestRejectedError
from pypto_serving.executor import paged

MODEL = "llama-gqa4-tied"
POISON_SEED = 666
"""Requests with this seed get NaN logits from the poisoned sampler."""


@pytest.fixture(scope="module")
def live(tiny_model):
    with serving(tiny_llm(tiny_model(MODEL))) as server:
        yield server


def complete(live, **body):
    body = {"prompt": [5, 17, 40, 99], "max_tokens": 6, "ignore_eos": True} | body
    return httpx.post(live.url + "/v1/completions", json=body, timeout=patience(120))


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-7])
def test_tiny_temperature_gives_the_greedy_tokens(live, temperature):
    greedy = complete(live, temperature=0, logprobs=0)
    tiny = complete(live, temperature=temperature, seed=1, logprobs=0)
    assert greedy.status_code == tiny.status_code == 200, tiny.text
    tokens = greedy.json()["choices"][0]["logprobs"]["tokens"]
    assert tiny.json()["choices"][0]["logprobs"]["tokens"] == tokens
    token_zero = live.llm.tokenizer.convert_ids_to_tokens(0)
    assert tokens.count(token_zero) < len(tokens)  # not NaN logits' "token 0 repeated"


@pytest.fixture
def poisoned(monkeypatch):
    real = paged.sample

    def sample(logits, rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.seed == POISON_SEED:
                logits[i] = float("nan")
        return real(logits, rows)

    monkeypatch.setattr(paged, "sample", sample)


def idle(live) -> None:
    def quiet() -> bool:
        s = live.llm.engine.stats()
        return not (s.num_running or s.num_waiting or s.kv_usage > 0)

    wait_for(quiet, 30, "the engine went idle")


def test_nan_logits_fail_that_request_alone(live, poisoned):
    expected = complete(live, temperature=0, max_tokens=40)
    results: dict[str, httpx.Response] = {}
    healthy = threading.Thread(
        target=lambda: results.update(ok=complete(live, temperature=0, max_tokens=40))
    )
    healthy.start()
    bad = complete(live, temperature=0.8, seed=POISON_SEED)
    healthy.join()
    assert bad.status_code == 503, bad.text
    error = bad.json()["error"]
    assert "NaN logits" in error["message"] and "no token could be sampled" in error["message"]
    assert results["ok"].status_code == 200
    assert results["ok"].json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    idle(live)
    assert httpx.get(live.url + "/health", timeout=patience(10)).status_code == 200
    assert complete(live, temperature=0).status_code == 200


def test_nan_logits_end_a_stream_with_an_error_event(live, poisoned):
    body = {"prompt": "x", "max_tokens": 4, "stream": True, "seed": POISON_SEED}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=patience(120)) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert "NaN logits" in json.loads(events[-2])["error"]["message"]
    idle(live)


def test_a_replica_reports_unusable_logits_and_its_parent_fails_that_request(tiny_model, poisoned):
    """With data parallelism the sampler runs in a replica process: the failure crosses the
    pipe in the TokenDelta, and the parent fails that request alone, as the engine's fault or,
    where its own constraints left no token, as the request's (a replica's serve loop and the
    parent's _apply, run here in one process)."""
    from multiprocessing import Pipe

    from pypto_serving.config import engine_config
    from pypto_serving.engine.core import EngineCore
    from pypto_serving.engine.dp import DPEngine
    from pypto_serving.engine.replica import NewRequest, StepResult, serve
    from pypto_serving.engine.router import Router
    from pypto_serving.request import Request
    from pypto_serving.sampling import SamplingParams

    model_dir = tiny_model(MODEL)
    engine = EngineCore(engine_config(model=str(model_dir), **FAST_KNOBS), model_dir)
    parent, child = Pipe()
    replica = threading.Thread(target=serve, args=(engine, child), daemon=True)
    replica.start()
    dp = object.__new__(DPEngine)  # only what _apply reads: the requests and the router
    dp._requests, dp.router = {}, Router(1, 16, [64])
    banned = {"allowed_token_ids": [9], "bad_words_token_ids": [[9]]}  # no token left
    for rid, seed, extra in (("bad", POISON_SEED, {}), ("ok", None, {}), ("banned", None, banned)):
        params = SamplingParams(max_tokens=3, seed=seed, ignore_eos=True, **extra)
        dp._requests[rid] = request = Request(rid, [5, 6, 7], params)
        dp.router.route(request)
        parent.send(NewRequest(rid, [5, 6, 7], params, (), 0, 0, time.monotonic(), None))
    requests = dict(dp._requests)
    try:
        while dp._requests:
            assert parent.poll(patience(120)), "the replica sent nothing"
            message = parent.recv()
            assert isinstance(message, StepResult), message
            for delta in message.deltas:
                dp._apply(delta)
    finally:
        parent.send(None)
        replica.join(timeout=patience(60))
        engine.close()
    bad, ok = requests["bad"], requests["ok"]
    assert bad.finish_reason == "error" and bad.output_token_ids == []
    assert "NaN logits" in bad.error and isinstance(bad.failure(), RequestFailedError)
    assert isinstance(requests["banned"].failure(), RequestRejectedError)  # its own doing
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == 3
    assert dp.router.num_routed == [0]
