"""Prompt logprobs (issue 27): vLLM's `prompt_logprobs` and OpenAI's `echo` with `logprobs`,
what lm-evaluation-harness' loglikelihood tasks send.

Ground truth: HF transformers' log-softmax at each prompt position, for the paged executor
(whole prompt, chunked prefill, after the prompt is cached, n = 2, preempted) and the reference
executor; the API's echo logprobs and prompt_logprobs carry the same numbers."""

from __future__ import annotations

from dataclasses import replace

import httpx
import openai
import pytest
import torch
from checkpoints import hf_model
from live_server import serving, tiny_llm

from pypto_serving import LLM
from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"
PROMPT = [5, 17, 42, 99, 3, 250, 31, 8, 77, 120, 64, 11, 200, 9, 150, 33, 2, 45, 6, 301]


@pytest.fixture(scope="module")
def truth(tiny_model):
    """HF's logprob of each prompt token after the first, and the top 3 at each position."""
    with torch.no_grad():
        logits = hf_model(tiny_model(MODEL))(torch.tensor([PROMPT])).logits[0].float()
    logprobs = logits.log_softmax(-1)[:-1]
    chosen = logprobs.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    return chosen, logprobs.topk(3, dim=-1).indices


def check(scored, truth) -> None:
    chosen, top = truth
    assert scored[0] is None and len(scored) == len(PROMPT)
    got = torch.tensor([s.logprob for s in scored[1:]])
    torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)
    assert [s.token_id for s in scored[1:]] == PROMPT[1:]
    assert [list(s.top_logprobs) for s in scored[1:]] == top.tolist()
    assert all(
        s.rank == 1 + int((lp > s.logprob + 1e-6).sum())
        for s, lp in zip(
            scored[1:],
            [torch.tensor(list(s.top_logprobs.values())) for s in scored[1:]],
            strict=True,
        )
        if s.rank <= 3
    )


def test_the_paged_executor_scores_the_prompt_as_hf(tiny_model, truth):
    params = SamplingParams(prompt_logprobs=3, max_tokens=2, temperature=0)
    with tiny_llm(tiny_model(MODEL), long_prefill_token_threshold=6) as llm:  # 4 chunks
        first = llm.generate([PROMPT], params, use_tqdm=False)[0]
        check(first.prompt_logprobs, truth)
        again = llm.generate([PROMPT], params, use_tqdm=False)[0]  # the prompt is cached now
        check(again.prompt_logprobs, truth)
        plain = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit
        two = llm.generate([PROMPT], replace(params, n=2), use_tqdm=False)[0]
        check(two.prompt_logprobs, truth)
        assert two.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_preempted_request_scores_each_position_once(tiny_model, truth):
    params = SamplingParams(prompt_logprobs=3, max_tokens=28, temperature=0, ignore_eos=True)
    with tiny_llm(tiny_model(MODEL), num_kv_pages=8, page_size=8, max_num_seqs=4) as llm:
        outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        check(out.prompt_logprobs, truth)


def test_the_reference_executor_scores_the_prompt_as_hf(tiny_model, truth):
    llm = LLM(str(tiny_model(MODEL)), executor="reference", dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(prompt_logprobs=3, max_tokens=1), use_tqdm=False)
    check(out[0].prompt_logprobs, truth)


def test_echo_with_logprobs_and_prompt_logprobs_over_the_api(tiny_model, truth):
    chosen, _top = truth
    with tiny_llm(tiny_model(MODEL)) as llm, serving(llm) as live:
        api = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
        echoed = api.completions.create(**kw, echo=True).choices[0]
        plain = api.completions.create(**kw).choices[0]
        lp = echoed.logprobs
        assert echoed.text == llm.tokenizer.decode(PROMPT) + plain.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        torch.testing.assert_close(
            torch.tensor(lp.token_logprobs[1 : len(PROMPT)]), chosen, atol=1e-4, rtol=0
        )
        assert lp.token_logprobs[len(PROMPT) :] == plain.logprobs.token_logprobs
        assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])  # the token's own + 2 top
        assert [next(iter(t)) for t in lp.top_logprobs[1:]] == lp.tokens[1:]
        assert lp.text_offset[len(PROMPT)] == len(llm.tokenizer.decode(PROMPT))
        text, tokens, offsets = "", [], []
        for c in api.completions.create(**kw, echo=True, stream=True):
            text += c.choices[0].text
            if c.choices[0].logprobs is not None:
                tokens += c.choices[0].logprobs.token_logprobs
                offsets += c.choices[0].logprobs.text_offset
        assert (text, tokens, offsets) == (echoed.text, lp.token_logprobs, lp.text_offset)
        vllm = httpx.post(
            live.url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1},
        ).json()["choices"][0]["prompt_logprobs"]
        assert vllm[0] is None and len(vllm) == len(PROMPT)
        assert vllm[1][str(PROMPT[1])]["logprob"] == pytest.approx(float(chosen[0]), abs=1e-4)
        chat = httpx.post(
            live.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "prompt_logprobs": 0,
            },
        ).json()
        assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
        assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # the token itself
