"""SamplingParams validation and the sampler's behaviour on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.errors import PyptoError
from pypto_serving.ops.sampler import SamplingRow, edit_logits, sample
from pypto_serving.sampling import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"temperature": -0.1}, "temp"),
        ({"temperature": float("nan")}, "finite"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n="),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ],
)
def test_invalid_params_are_rejected(kwargs, message):
    with pytest.raises(PyptoError, match=message):
        SamplingParams(**kwargs)


def row(params, output=(), prompt=(), seed_gen=None, eos=()):
    return SamplingRow(params, list(prompt), list(output), seed_gen, eos)


def test_greedy_and_top_k_1_pick_argmax():
    logits = torch.randn(4, 50)
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(top_k=1)),
        row(SamplingParams(top_p=1e-6)),
        row(SamplingParams(min_p=1.0)),
    ]
    got = [s.token_id for s in sample(logits, rows)]
    assert got == logits.argmax(-1).tolist()


def test_seeded_rows_reproduce_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    params = SamplingParams(temperature=1.0, seed=7)

    def alone(i):
        return sample(logits[i : i + 1], [row(params, seed_gen=torch.Generator().manual_seed(7))])

    batch = sample(
        logits, [row(params, seed_gen=torch.Generator().manual_seed(7)) for _ in range(16)]
    )
    assert [s.token_id for s in batch] == [alone(i)[0].token_id for i in range(16)]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 1e-9]])).repeat(4000, 1)
    tokens = [s.token_id for s in sample(logits, [row(SamplingParams())] * 4000)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq[:3], torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    top_p = [s.token_id for s in sample(logits[:500], [row(SamplingParams(top_p=0.75))] * 500)]
    assert set(top_p) == {0, 1}


def test_penalties_and_min_tokens():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    assert (
        sample(logits, [row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])])[
            0
        ].token_id
        == 1
    )
    assert (
        sample(logits, [row(SamplingParams(temperature=0, frequency_penalty=2.0), output=[0, 0])])[
            0
        ].token_id
        == 1
    )
    assert (
        sample(logits, [row(SamplingParams(temperature=0, min_tokens=2), output=[1], eos=[0])])[
            0
        ].token_id
        == 1
    )
    assert (
        sample(
            logits,
            [
                row(
                    SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),
                    output=[1],
                    eos=[0],
                )
            ],
        )[0].token_id
        == 0
    )


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [5.0, 4.0, 1.0, 0.0]])
    biased = SamplingParams(temperature=0, logit_bias={0: -2.5, 2: 3.5}, logprobs=1)
    out = sample(logits, [row(biased), row(SamplingParams(temperature=0))])
    assert [s.token_id for s in out] == [2, 0]  # 1 + 3.5 beats 5 - 2.5 and 4; the other row plain
    assert out[0].logprob == pytest.approx(logits[0].log_softmax(-1)[2].item())
    edited = edit_logits(logits, [row(biased), row(SamplingParams())])
    assert edited[0].tolist() == [2.5, 4.0, 4.5, 0.0] and torch.equal(edited[1], logits[1])
    banned = SamplingParams(temperature=1.0, seed=1, logit_bias={0: -100.0, 1: -100.0})
    draws = {
        sample(logits[:1], [row(banned, seed_gen=torch.Generator().manual_seed(i))])[0].token_id
        for i in range(20)
    }
    assert draws <= {2, 3}


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = sample(logits, [row(SamplingParams(temperature=0, logprobs=2))])[0]
    expected = logits.log_softmax(-1)[0]
    assert s.token_id == 0 and s.logprob == pytest.approx(expected[0].item())
    assert list(s.top_logprobs) == [0, 1]
    assert s.top_logprobs[1] == pytest.approx(expected[1].item())


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-30, 1e-6, 9.9e-6])
def test_tiny_temperatures_are_greedy(temperature):
    """Below 1e-5 a temperature is greedy (vLLM's rule): 1e-40 is 0 in float32, and dividing
    by it made every logit NaN, which sampled token 0."""
    torch.manual_seed(1)
    logits = torch.randn(6, 300) * 5
    logits[:, 0] = -50.0  # token 0 is never the answer
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.greedy
    gens = [torch.Generator().manual_seed(3) for _ in range(6)]
    got = sample(logits, [row(params, seed_gen=g) for g in gens])
    assert [s.token_id for s in got] == logits.argmax(-1).tolist()
    assert all(s.error is None for s in got)


def test_small_temperature_at_the_greedy_bound_is_still_finite():
    """1e-5 samples (it is not below the bound); logits of any finite size stay finite."""
    logits = torch.tensor([[3e30, 1e30, -3e30, 0.0], [5.0, 4.99999, 1.0, 0.0]])
    params = SamplingParams(temperature=1e-5)
    assert not params.greedy
    for s in sample(logits, [row(params), row(params)]):
        assert s.error is None and s.token_id in (0, 1)


def test_rows_with_nan_or_inf_logits_fail_alone():
    """A row holding NaN or +inf (or masking every token) gets an error instead of a token;
    the rest of the batch samples as if it were alone."""
    torch.manual_seed(2)
    logits = torch.randn(5, 40)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("nan")
    logits[4, 1] = float("nan")
    greedy, hot = SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7)
    rows = [row(greedy), row(greedy), row(hot), row(hot), row(hot)]
    out = sample(logits, rows)
    assert out[0].error is None and out[0].token_id == logits[0].argmax().item()
    assert "NaN" in out[1].error and "NaN" in out[3].error and "NaN" in out[4].error
    assert "infinite" in out[2].error
    assert not any(s.rejected for s in out)  # the model's fault, not the request's
    masked = torch.full((1, 4), -float("inf"))
    [s] = sample(masked, [row(SamplingParams(temperature=0))])
    assert "-inf" in s.error and not s.rejected
    # finite logits, and the request's own constraints ban the one token they allow
    banned = SamplingParams(temperature=0, allowed_token_ids=[2], bad_words_token_ids=[[2]])
    [s] = sample(torch.randn(1, 4), [row(banned)])
    assert s.rejected and "rule out every token" in s.error


def test_request_with_unusable_logits_fails_instead_of_taking_a_token():
    from pypto_serving.ops.sampler import Sampled
    from pypto_serving.request import Request

    req = Request("r", [1, 2], SamplingParams(max_tokens=4))
    req.append(Sampled(0, float("nan"), None, "the model produced NaN logits"))
    assert req.finished and req.finish_reason == "error" and req.output_token_ids == []
    assert req.error == "the model produced NaN logits"
