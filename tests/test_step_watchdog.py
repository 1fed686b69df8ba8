"""The step watchdog tells a long step from a hung one (issue 23, item 1).

A step may run past step_timeout_s as long as it makes progress (each layer attending moves
the engine's `progress` on; a data-parallel replica sends heartbeats meanwhile): a long
prompt on a slow CPU is answered, not taken for a hang. A step that stops making progress is
still a hang, and a prompt one layer of which would outlast the limit here is refused up
front (400 naming step_timeout_s) instead of killing the engine. Steps are slowed by
sleeping in each layer's attention; every limit scales with the machine's load.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fault_injection import SLOW_REPLICA_LAYERS, inject
from live_server import serving, tiny_llm
from patience import patience

from pypto_serving.kv.paged_attention import StepAttention

MODEL = "llama-gqa4-tied"  # two layers
PROMPT = [(7 * j) % 300 + 3 for j in range(20)]


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=patience(120))


def slow_layers(monkeypatch: pytest.MonkeyPatch, seconds) -> None:
    """Each layer's attention first sleeps seconds(tokens of the step)."""
    attend = StepAttention.attend

    def slow(self, q, *rest):
        time.sleep(seconds(len(q)))
        return attend(self, q, *rest)

    monkeypatch.setattr(StepAttention, "attend", slow)


def test_a_long_step_that_makes_progress_is_not_taken_for_a_hang(tiny_model, monkeypatch):
    limit = patience(2.0)
    slow_layers(monkeypatch, lambda tokens: 0.6 * limit)  # a step: 1.2 x the limit
    llm = tiny_llm(tiny_model(MODEL), step_timeout_s=limit)
    with serving(llm) as live:
        started = time.monotonic()
        r = complete(live.url, PROMPT, max_tokens=1)  # one step (the prompt's) is enough
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
        assert time.monotonic() - started > limit  # the step outlasted the limit
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert not live.engine.hung
    llm.close()


def test_a_step_stuck_inside_a_layer_is_still_a_hang(tiny_model, monkeypatch):
    limit = patience(1.0)
    stuck, release = threading.Event(), threading.Event()
    attend = StepAttention.attend

    def hang_in_the_second_layer(self, *args):
        if self.layers == 1 and not release.is_set():  # the step's second layer
            stuck.set()
            release.wait(60)
        return attend(self, *args)

    monkeypatch.setattr(StepAttention, "attend", hang_in_the_second_layer)
    llm = tiny_llm(tiny_model(MODEL), step_timeout_s=limit)
    try:
        with serving(llm) as live:
            r = complete(live.url, PROMPT)
            assert stuck.is_set()
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "engine_dead"
            assert f"a step made no progress for step_timeout_s ({limit:g} s)" in error["message"]
            assert live.engine.hung
    finally:
        release.set()
    llm.close()


def test_a_prompt_whose_layer_would_outlast_the_limit_is_refused_up_front(tiny_model, monkeypatch):
    limit = patience(1.0)
    slow_layers(monkeypatch, lambda tokens: tokens * limit / 200)  # 20 tokens: 0.1 x limit
    llm = tiny_llm(tiny_model(MODEL), step_timeout_s=limit)
    with serving(llm) as live:
        assert complete(live.url, PROMPT).status_code == 200  # measures what a layer costs
        long = [(5 * j) % 300 + 3 for j in range(400)]  # one layer: ~2 x the limit
        r = complete(live.url, long)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt"
        assert "400 tokens" in error["message"]
        assert f"longer than step_timeout_s ({limit:g} s)" in error["message"]
        assert "--step-timeout-s" in error["message"]
        assert httpx.get(f"{live.url}/health").status_code == 200  # the engine lives on
        assert complete(live.url, PROMPT[:10]).status_code == 200
    llm.close()


def test_a_replica_whose_long_steps_make_progress_is_not_lost(tiny_model, monkeypatch):
    limit = patience(2.0)
    inject(monkeypatch, SLOW_REPLICA_LAYERS, f"*:{0.55 * limit}")  # every step: 1.1 x the limit
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2, step_timeout_s=limit)
    with serving(llm) as live:
        results: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda: results.append(complete(live.url, PROMPT, 1)))
            for _ in range(2)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
        assert time.monotonic() - started > limit  # the steps were slowed past the limit
        assert llm.engine.router.num_routed == [0, 0]
        assert llm.engine.lost == {}
        assert httpx.get(f"{live.url}/health").status_code == 200
    llm.close()
