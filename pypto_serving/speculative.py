"""Speculative decoding: what a step verifies beside a request's last token, and how much.

A decoding request may be given draft tokens, guesses of the tokens that follow its last one.
The step then computes the last token and the drafts as rows of the same forward (the target
model reads its weights once for all of them), samples each row as it would have sampled that
position, and keeps the drafts up to the first one its own sample disagrees with, plus that
sample: one to k + 1 tokens for one step. Every kept token is the target's own sample given
the tokens before it, so greedy outputs are the plain ones, and sampled ones come from the
same distribution (a draft that is one fixed token is accepted exactly as often as the target
draws it, and a draw that differs is a draw from the target's distribution without it: the
rejection rule of speculative sampling for a one-token proposal).

Drafts come from a `Proposer`: n-gram lookup (vLLM's `ngram` method, llama.cpp's lookup
decoding: the longest recent n-gram of the request's tokens that occurred before, continued
by what followed it then; `NgramProposer`), or a smaller draft model sharing the tokenizer,
run greedily on its own paged KV (`executor/draft_model.py`). Either proposal is one fixed
token per position, so the rule above is exact for both. How many a request gets follows
how its drafts have fared (`Speculator.budget`): as many as pay for their rows at the rate its
drafts are being kept, so a text that repeats itself verifies k at a time even after a slip,
and drafts that keep missing cost one row a step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pypto_serving.config import SpeculativeSpec
from pypto_serving.request import Request

ROW_COST = 0.08
"""What one draft row adds to a step, as a fraction of a step of one row, where the plan says
nothing more precise (`native_decode.draft_row_cost` does for the native step: 0.08 over
records with AVX512-VNNI, 0.25 on AVX2, 0.15 over bf16 weights)."""
KEPT_PRIOR = (6.0, 1.0)
"""A request's first drafts are judged as if 6 of 7 had been kept: 8 of them where a row costs
0.08 of a step, 4 where it costs 0.25. A few misses at the start bring it down fast: the
counts decay."""
DECAY = 0.8
"""Each step's weight in the running counts against the one after it: the rate follows the
text's last ten or so steps (a copied passage, then new words, then a copy again)."""


def worth_drafting(rate: float, k: int, row_cost: float = ROW_COST) -> int:
    """The number of drafts, 1 to k, that makes the most tokens per step's cost when each is
    kept with probability `rate` once the ones before it were: n drafts give 1 + rate + ...
    + rate^n tokens for 1 + n * row_cost steps. At least one: a request that drafts nothing
    would never learn that its text turned repetitive."""
    best, best_n, tokens, p = 0.0, 1, 1.0, 1.0
    for n in range(1, k + 1):
        p *= rate
        tokens += p
        value = tokens / (1 + n * row_cost)
        if value > best:
            best, best_n = value, n
    return best_n


@dataclass(slots=True)
class NgramIndex:
    """One request's n-grams (sizes lo..hi) by where their latest occurrence ends, indexed as
    its tokens grow (each token once)."""

    lo: int
    hi: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    """Tokens whose n-grams ending there are in `ends`."""

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
        the tokens end with; where that occurrence runs into the end (a repeating pattern),
        the draft goes on as the pattern does. Empty: none occurred before."""
        end = len(tokens)
        for e in range(self.indexed + 1, end):  # n-grams ending before the last token
            for n in range(self.lo, min(self.hi, e) + 1):
                self.ends[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            at = self.ends.get(tuple(tokens[end - n :]))
            if at is not None:
                out: list[int] = []
                for i in range(k):
                    j = at + i
                    out.append(tokens[j] if j < end else out[j - end])
                return out
        return []


class Proposer(Protocol):
    """What proposes drafts: for each request asked for, up to its count of tokens guessed to
    follow its tokens (fewer, or none, where it has no guess)."""

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]: ...

    def forget(self, request_id: str) -> None:
        """The request left the engine: what was kept for it goes."""


class NgramProposer:
    """vLLM's `ngram` method: each request's `NgramIndex`, grown as its tokens do."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = {}
        for request, k in wanted:
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(self.lo, self.hi)
            out[request.request_id] = index.draft(request.token_ids, k)
        return out

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Speculative decoding's running totals (vLLM's `spec_decode_*` counters)."""

    num_drafts: int
    """Request steps that verified drafts."""
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    """How often a step's i-th draft token was kept."""

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(
                a + b
                for a, b in itertools.zip_longest(
                    self.accepted_per_position, other.accepted_per_position, fillvalue=0
                )
            ),
        )


class Speculator:
    """Drafts for decoding requests, and what came of them (the engine's counters): the
    scheduler asks `draft` for the requests about to decode, and tells `observe` how many of
    a request's drafts the step kept."""

    def __init__(
        self, spec: SpeculativeSpec, proposer: Proposer | None = None, row_cost: float = ROW_COST
    ) -> None:
        """proposer: where drafts come from (None: n-gram lookup, as the spec bounds it);
        row_cost: what a draft's row adds to a step, as a fraction of a one-row step (the
        target's rows only: a draft model's own forwards are not counted)."""
        self.spec, self.row_cost = spec, row_cost
        self.proposer = proposer or NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self._kept: dict[str, tuple[float, float]] = {}
        """Each request's drafts kept and steps that missed one, decayed by DECAY a step."""
        self.num_drafts = 0
        """Steps that verified drafts (vLLM's spec_decode_num_drafts)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * spec.num_speculative_tokens
        """How often the i-th draft token of a step was kept."""

    def budget(self, request_id: str) -> int:
        """How many drafts the request gets now: `worth_drafting` at the rate its drafts have
        been kept (each kept draft a success, each step that missed one a failure, older steps
        weighing less; KEPT_PRIOR before any). Near k while drafts hold (k where a row is
        cheap); one slip in a copied passage leaves it there; drafts that keep missing fall
        to one a step."""
        kept, missed = self._kept.get(request_id, KEPT_PRIOR)
        k = self.spec.num_speculative_tokens
        return worth_drafting(kept / (kept + missed), k, self.row_cost)

    def draft(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Draft tokens to verify after each request's last token: at most its limit (what
        its max_tokens, context and the step's budget leave) and its `budget`; a structured
        output's drafts end before the first one its grammar refuses."""
        asked = [(r, min(limit, self.budget(r.request_id))) for r, limit in wanted if limit > 0]
        out = self.proposer.propose(asked) if asked else {}
        for r, _ in asked:
            drafts = out.get(r.request_id)
            if drafts and r.matcher is not None:
                out[r.request_id] = drafts[: r.matcher.validate_tokens(drafts)]
        return out

    def observe(self, request_id: str, drafted: int, kept: int) -> None:
        """A step verified `drafted` drafts of the request and kept the first `kept`."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += kept
        for i in range(kept):
            self.accepted_per_position[i] += 1
        before_kept, before_missed = self._kept.get(request_id, KEPT_PRIOR)
        self._kept[request_id] = (
            DECAY * before_kept + kept,
            DECAY * before_missed + (kept < drafted),
        )

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_per_position),
        )

    def forget(self, request_id: str) -> None:
        """The request left the engine (finished, aborted): what was kept for it goes."""
        self.proposer.forget(request_id)
        self._kept.pop(request_id, None)
