"""Beam search (issue 45, items 2 and 6): `LLM.beam_search` and the server's `use_beam_search`
give HF transformers' `num_beams` output; the search's rules (EOS, length penalty, early stop)
on scores written by hand; what beam search cannot honour is refused by name.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from checkpoints import hf_model
from live_server import serving, tiny_llm

from pypto_serving import BeamSearchParams
from pypto_serving.beam_search import BeamSearch
from pypto_serving.errors import PyptoError
from pypto_serving.ops.sampler import Sampled

MODEL = "llama-gqa4-tied"
PROMPTS = [
    [5, 9, 2, 7, 11, 3],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
]
NEW = 8


@pytest.fixture(scope="module")
def llm(tiny_model):
    return tiny_llm(tiny_model(MODEL))


def hf_beams(
    model, prompt: list[int], width: int, penalty: float
) -> tuple[list[list[int]], list[float]]:
    """HF's num_beams search (EOS not special): the returned beams, best first, and their
    scores (cumulative logprob / length ** penalty)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        early_stopping=False,
        length_penalty=penalty,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = [row[len(prompt) :].tolist() for row in out.sequences]
    if width == 1:  # HF searches no beams: greedy, each token's logprob its score
        logprobs = [
            step.log_softmax(-1)[0, t] for step, t in zip(out.scores, beams[0], strict=True)
        ]
        return beams, [float(sum(logprobs)) / NEW**penalty]
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize(("width", "penalty"), [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beam_search_equals_hfs_num_beams(llm, tiny_model, width, penalty):
    hf = hf_model(tiny_model(MODEL))
    params = BeamSearchParams(
        beam_width=width, max_tokens=NEW, ignore_eos=True, length_penalty=penalty
    )
    ours = llm.beam_search(PROMPTS, params)
    for prompt, found in zip(PROMPTS, ours, strict=True):
        beams, scores = hf_beams(hf, prompt, width, penalty)
        assert [b.output_token_ids for b in found.sequences] == beams
        assert all(b.tokens[: len(prompt)] == prompt for b in found.sequences)
        torch.testing.assert_close(
            torch.tensor([b.score for b in found.sequences]),
            torch.tensor(scores),
            atol=1e-4,
            rtol=0,
        )
        for b in found.sequences:
            assert b.finish_reason == "length"
            assert b.text == llm.tokenizer.decode(b.output_token_ids, skip_special_tokens=True)
            assert math.isclose(b.score, b.cum_logprob / NEW**penalty, rel_tol=1e-6)
    if width == 1:  # a beam of one is greedy decoding
        greedy = llm.generate(PROMPTS, _greedy())
        assert [o.outputs[0].token_ids for o in greedy] == [
            f.sequences[0].output_token_ids for f in ours
        ]


def _greedy():
    from pypto_serving.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def scores(*tops: dict[int, float]) -> list[Sampled]:
    """Each running beam's next-token logprobs, written by hand."""
    return [Sampled(max(t, key=t.__getitem__), max(t.values()), t) for t in tops]


EOS = 0


def test_a_beam_ending_in_eos_finishes_with_its_length_penalised_score():
    search = BeamSearch(
        [1, 2], BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=1.0), frozenset({EOS})
    )
    assert search.queries() == [[1, 2]]
    search.advance(scores({EOS: -0.1, 7: -1.0, 8: -2.0, 9: -3.0}))
    # EOS ranked first: finished after one token; 7 and 8 run on
    assert [(b.output_token_ids, b.finish_reason) for b in search.finished] == [([EOS], "stop")]
    assert search.finished[0].score == pytest.approx(-0.1)
    assert search.queries() == [[1, 2, 7], [1, 2, 8]]
    # the running beams' best continuations: -1.5 (7, 5) and -2.5 (8, 5) over two tokens;
    # the 2 best finished are then EOS (-0.1) and 7 5 EOS ... not yet: 7 5 runs on
    search.advance(
        scores({5: -0.5, EOS: -3.0, 6: -4.0, 4: -5.0}, {5: -0.5, EOS: -0.6, 6: -4.0, 4: -5.0})
    )
    # candidates by cumulative: 7 5 (-1.5), 8 5 (-2.5), 8 EOS (-2.6), 7 EOS (-4.0): 8 EOS is
    # third, beyond the width of 2, so it does not finish; the two best run on
    assert [b.output_token_ids for b in search.finished] == [[EOS]]
    assert search.queries() == [[1, 2, 7, 5], [1, 2, 8, 5]]
    search.advance(
        scores({EOS: -0.2, 3: -9.0, 4: -9.5, 6: -9.9}, {EOS: -0.1, 3: -9.0, 4: -9.5, 6: -9.9})
    )
    # 7 5 EOS (-1.7, over 3 tokens -0.567) and 8 5 EOS (-2.6) finish; nothing runs
    assert search.done
    assert [b.output_token_ids for b in search.best()] == [[EOS], [7, 5, EOS]]
    assert search.best()[1].score == pytest.approx(-1.7 / 3)


def test_the_length_penalty_decides_between_finished_beams_of_different_lengths():
    for penalty, best in ((1.0, [9, 9, EOS]), (-1.0, [EOS])):
        params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty)
        search = BeamSearch([1], params, frozenset({EOS}))
        # 9 runs, EOS finishes (-0.9 over one token), 8 runs
        search.advance(scores({9: -0.5, EOS: -0.9, 8: -3.0, 7: -4.0}))
        # 9 9 (-0.7) and 9 6 (-4.5) run
        search.advance(
            scores({9: -0.2, 6: -4.0, 5: -4.5, 4: -5.0}, {3: -2.0, 2: -2.5, 1: -3.0, 10: -3.5})
        )
        # 9 9 EOS: -1.2 over 3 tokens; 9 6 2 reaches max_tokens at -4.6
        search.advance(
            scores({EOS: -0.5, 1: -6.0, 3: -7.0, 4: -8.0}, {2: -0.1, 3: -6.0, 4: -7.0, 5: -8.0})
        )
        assert search.done
        assert search.best()[0].output_token_ids == best, penalty
        assert {b.finish_reason for b in search.best()} == {"stop"}


def test_the_search_stops_once_no_running_beam_can_pass_the_finished_ones():
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=50), frozenset({EOS}))
    search.advance(scores({9: -0.01, EOS: -0.1}))  # EOS second, beyond the width: 9 runs
    assert not search.done and search.finished == []
    search.advance(scores({EOS: -0.1, 9: -0.2}))  # 9 EOS finishes (-0.11 over 2 tokens)
    # the running 9 9 (-0.21 over 2) cannot pass it: done, 47 tokens before max_tokens
    assert search.done and [b.output_token_ids for b in search.best()] == [[9, EOS]]


def test_beam_params_are_checked():
    for bad, param in (
        ({"beam_width": 0}, "n"),
        ({"beam_width": 11}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
    ):
        with pytest.raises(PyptoError) as e:
            BeamSearchParams(**({"beam_width": 2, "max_tokens": 4} | bad))
        assert e.value.param == param


@pytest.fixture(scope="module")
def live(llm):
    with serving(llm) as server:
        yield server


def test_the_server_searches_as_the_offline_api(live, llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.7)
    offline = llm.beam_search(PROMPTS, params)
    body = {
        "prompt": PROMPTS,
        "n": 3,
        "max_tokens": 6,
        "use_beam_search": True,
        "length_penalty": 0.7,
    }
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [b.text for out in offline for b in out.sequences]
    assert r.json()["usage"]["completion_tokens"] == sum(
        len(b.output_token_ids) for o in offline for b in o.sequences
    )
    messages = [{"role": "user", "content": "the quick brown"}]
    chat = {"messages": messages, "n": 2, "max_tokens": 5, "use_beam_search": True}
    r = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=300)
    assert r.status_code == 200, r.text
    expected = llm.beam_search(
        [llm.chat_prompt(messages)], BeamSearchParams(beam_width=2, max_tokens=5)
    )[0]
    assert [c["message"]["content"] for c in r.json()["choices"]] == [
        b.text for b in expected.sequences
    ]
    assert [c["finish_reason"] for c in r.json()["choices"]] == [
        b.finish_reason for b in expected.sequences
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 0}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"best_of": 3}, "best_of"),
        ({"n": 11}, "n"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ],
)
def test_what_beam_search_cannot_honour_is_refused_by_name(live, extra, param):
    body = {"prompt": "the fox", "n": 2, "max_tokens": 4, "use_beam_search": True} | extra
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "tools": tools}
    r = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
