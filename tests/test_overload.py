"""Backpressure: queue limits answer 503 with Retry-After at once; admitted requests finish."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from live_server import serving, tiny_llm
from patience import patience

MODEL = "llama-gqa4-tied"


def post(url: str, body: dict, results: list, barrier: threading.Barrier) -> None:
    barrier.wait()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=patience(120))
    results.append((r, time.monotonic()))  # when the answer came


def burst(url: str, model: str, n: int, prompt: list[int], max_tokens: int) -> list:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    results: list = []
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=post, args=(url, body, results, barrier)) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_limits_1_1_admit_exactly_two_of_ten(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), max_num_seqs=1)
    with serving(llm, max_queued_requests=1) as live:
        results = burst(live.url, live.model, 10, [5] * 20, 120)
        ok = [(r, t) for r, t in results if r.status_code == 200]
        refused = [(r, t) for r, t in results if r.status_code == 503]
        assert (len(ok), len(refused)) == (2, 8), [r.status_code for r, _ in results]
        for r, _ in ok:  # every admitted request completes with all its tokens
            assert r.json()["usage"]["completion_tokens"] == 120
        first_done = min(ended for _, ended in ok)
        for r, ended in refused:
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["code"] == "overloaded" and error["type"] == "service_unavailable_error"
            assert "1 running and 1 queued" in error["message"]
            # refused at once, never after waiting for the engine to free a place
            assert ended < first_done
        assert httpx.get(f"{live.url}/health").status_code == 200
        stats = live.engine.engine.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_queued_token_limit(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), max_num_seqs=4)
    with serving(llm, max_queued_tokens=40) as live:
        # one request over the limit alone is served (nothing else waits)...
        alone = httpx.post(
            f"{live.url}/v1/completions",
            json={"model": live.model, "prompt": [7] * 60, "max_tokens": 2},
            timeout=patience(60),
        )
        assert alone.status_code == 200
        # ...but while prompts wait for their first token, more tokens than the limit are not
        results = burst(live.url, live.model, 6, [9] * 30, 60)
        codes = sorted(r.status_code for r, _ in results)
        assert 200 in codes and 503 in codes, codes
        refused = next(r for r, _ in results if r.status_code == 503)
        assert "40 prompt tokens waiting" in refused.json()["error"]["message"]


@pytest.mark.parametrize("name", ["max_queued_requests", "max_queued_tokens"])
def test_queue_limit_flags_are_checked(name, capsys):
    from pypto_serving.cli import main

    assert main(["serve", f"--{name.replace('_', '-')}", "-1"]) == 1
    assert f"{name} must be an integer >= 0" in capsys.readouterr().err


def test_a_request_no_wait_can_admit_is_a_400_not_a_503(tiny_model, monkeypatch):
    """503 + Retry-After makes SDKs retry, forever for a request that is over the limits on
    an idle server. That one is a 400 naming the limits; a full queue is still a 503."""
    llm = tiny_llm(tiny_model(MODEL), max_num_seqs=2)
    with serving(llm, max_queued_requests=2) as live:
        url = f"{live.url}/v1/completions"
        body = {"model": live.model, "prompt": [5, 6, 7], "max_tokens": 3}
        ok = httpx.post(url, json=body | {"n": 4}, timeout=patience(120))
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        for extra, param, said in [
            ({"n": 5}, "n", "x n=5 "),
            ({"prompt": [[5, 6]] * 5}, "prompt", "5 prompt(s)"),
            ({"best_of": 5}, "best_of", "x best_of=5 "),  # not "n=5": n is 1
        ]:
            r = httpx.post(url, json=body | extra, timeout=patience(120))
            assert r.status_code == 400 and "retry-after" not in r.headers, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"]) == (param, "invalid_value")
            assert "2 running (--max-num-seqs) and 2 queued" in error["message"]
            assert said in error["message"], error
        # four long requests fill the running slots and the queue: then one more is a 503
        core = live.llm.engine
        slow_step = core.step
        monkeypatch.setattr(core, "step", lambda: (time.sleep(0.01), slow_step())[1])
        long = body | {"max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=patience(120)) as http:
            streams = [http.stream("POST", url, json=long) for _ in range(4)]
            responses = [s.__enter__() for s in streams]
            try:
                assert all(r.status_code == 200 for r in responses)
                full = httpx.post(url, json=body, timeout=patience(120))
                assert full.status_code == 503 and full.headers["retry-after"] == "1"
                assert full.json()["error"]["code"] == "overloaded"
                again = httpx.post(url, json=body | {"n": 5}, timeout=patience(120))
                assert again.status_code == 400
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        start = time.monotonic()
        while core.stats().num_running or core.stats().num_waiting:
            assert time.monotonic() - start < patience(30), "the closed streams were not aborted"
            time.sleep(0.01)
        assert httpx.post(url, json=body, timeout=patience(120)).status_code == 200
