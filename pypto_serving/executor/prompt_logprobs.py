"""Prompt logprobs: as a request's prompt is computed, the logits at each prompt position score
the next prompt token (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`). Each
position is scored once: a request resumed after preemption skips the positions it scored
before, and the KV store gives it no prefix hit past them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pypto_serving.ops.sampler import scored
from pypto_serving.request import Request


def prompt_scoring(
    reqs: Sequence[Request], starts: Sequence[int], counts: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(b, lo, hi) for each request b of a step whose chunk holds prompt positions [lo, hi)
    to score: positions before the prompt's last, not scored yet."""
    out = []
    for b, (r, start, n) in enumerate(zip(reqs, starts, counts, strict=True)):
        if r.params.prompt_logprobs is None:
            continue
        lo = max(start, len(r.prompt_logprobs))
        hi = min(start + n, len(r.prompt_token_ids) - 1)
        if hi > lo:
            out.append((b, lo, hi))
    return out


def score_prompts(
    logits: torch.Tensor, reqs: Sequence[Request], scoring: list[tuple[int, int, int]]
) -> None:
    """Append each position's score to its request's prompt_logprobs; `logits` holds the
    positions' rows in `scoring`'s order."""
    row = 0
    for b, lo, hi in scoring:
        r = reqs[b]
        assert r.params.prompt_logprobs is not None
        targets = r.prompt_token_ids[lo + 1 : hi + 1]
        r.prompt_logprobs += scored(logits[row : row + hi - lo], targets, r.params.prompt_logprobs)
        row += hi - lo
