"""Beam search (vLLM's `use_beam_search` and `LLM.beam_search`), as HF transformers searches.

A search keeps `beam_width` running beams. Each step scores every running beam's next token
(one engine request per beam: the prompt and the beam's tokens, one new token, the model's own
`2 * beam_width` top logprobs; the prefix cache shares the pages they have in common), ranks
all the candidates by cumulative logprob and keeps the best `2 * beam_width`. Of those, a
candidate ending in EOS among the first `beam_width` finishes (scored by its cumulative
logprob over its length to the power `length_penalty`); the first `beam_width` others run on.
The search ends at `max_tokens` (the running beams finish, scored alike) or once
`beam_width` beams have finished and the best running one cannot score above the worst of them
(HF's `early_stopping=False` rule). The best `beam_width` finished beams are the answer, best
first.

The algorithm is here once; the offline LLM and the server each drive it with their own
requests (`BeamSearch.queries` to score, `BeamSearch.advance` with the scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pypto_serving.errors import PyptoError
from pypto_serving.ops.sampler import Sampled
from pypto_serving.sampling import SamplingParams

MAX_BEAM_WIDTH = 10
"""Widest search: each step asks for 2 x width top logprobs, at most 20."""


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's names and meanings."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    """Never finish a beam at EOS: every beam runs to max_tokens."""
    temperature: float = 0.0
    """Accepted for vLLM's signature: beams are ranked by the model's own logprobs, which no
    temperature changes."""
    length_penalty: float = 1.0
    """A finished beam's score is its cumulative logprob / its length ** length_penalty
    (above 0 favours longer beams, below 0 shorter ones)."""

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise PyptoError(
                f"the beam width (n) must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}",
                "n",
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise PyptoError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens"
            )
        if not math.isfinite(self.length_penalty):
            raise PyptoError("length_penalty must be a finite number", "length_penalty")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise PyptoError("temperature must be >= 0", "temperature")


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam (vLLM's fields)."""

    tokens: list[int]
    """The prompt's tokens, then the beam's."""
    cum_logprob: float
    text: str = ""
    """The beam's own text (not the prompt's)."""
    finish_reason: str = "length"
    """'stop' (it ended in EOS) or 'length' (max_tokens)."""
    score: float = 0.0
    """What beams are ranked by: cum_logprob / (beam length ** length_penalty)."""
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """The best beams, best first."""


@dataclass(slots=True)
class _Beam:
    tokens: list[int]
    cum_logprob: float = 0.0


@dataclass(slots=True)
class BeamSearch:
    """One prompt's search, step by step."""

    prompt: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    running: list[_Beam] = field(default_factory=list)
    finished: list[BeamSearchSequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise PyptoError("the prompt is empty", "prompt")
        self.running = [_Beam([])]

    @property
    def done(self) -> bool:
        return not self.running

    def queries(self) -> list[list[int]]:
        """The token ids whose next token each running beam needs scored."""
        return [self.prompt + b.tokens for b in self.running]

    def step_params(self) -> SamplingParams:
        """How each query is scored: one token, the 2 x width most likely with logprobs."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width, ignore_eos=True
        )

    def advance(self, scored: list[Sampled]) -> None:
        """Take one step: `scored[i]` is running beam i's next-token scores."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        candidates = [
            (beam.cum_logprob + logprob, beam, token)
            for beam, s in zip(self.running, scored, strict=True)
            for token, logprob in (s.top_logprobs or {}).items()
        ]
        candidates.sort(key=lambda c: -c[0])
        length = len(self.running[0].tokens) + 1  # every running beam has the same length
        running: list[_Beam] = []
        for rank, (cum, beam, token) in enumerate(candidates[: 2 * width]):
            if token in self.eos_token_ids and not self.params.ignore_eos:
                if rank < width:
                    self._finish(_Beam([*beam.tokens, token], cum), "stop")
            elif len(running) < width:
                running.append(_Beam([*beam.tokens, token], cum))
        if length >= self.params.max_tokens:
            for beam in running:
                self._finish(beam, "length")
            running = []
        self.running = running
        full = len(self.finished) == width
        if full and running and running[0].cum_logprob / length**penalty <= self.finished[-1].score:
            self.running = []  # no running beam can pass the worst finished one

    def _finish(self, beam: _Beam, reason: str) -> None:
        score = beam.cum_logprob / len(beam.tokens) ** self.params.length_penalty
        done = BeamSearchSequence(
            self.prompt + beam.tokens,
            beam.cum_logprob,
            finish_reason=reason,
            score=score,
            num_prompt_tokens=len(self.prompt),
        )
        self.finished.append(done)
        self.finished.sort(key=lambda s: -s.score)
        del self.finished[self.params.beam_width :]

    def best(self, tokenizer: Any = None) -> list[BeamSearchSequence]:
        """The finished beams, best first (once `done`), each with its text where a
        tokenizer is given."""
        for beam in self.finished if tokenizer is not None else ():
            beam.text = tokenizer.decode(beam.output_token_ids, skip_special_tokens=True)
        return list(self.finished)
