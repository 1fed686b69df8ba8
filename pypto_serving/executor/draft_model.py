"""Speculative decoding's draft model (vLLM's `{"model": DIR, ...}`): a smaller model sharing
the target's tokenizer guesses each decoding request's next tokens, greedily, on a paged
executor and KV pool of its own.

The draft model keeps a shadow of each request it drafts for: the request's tokens, then the
drafts it proposed. Asked again, it keeps the KV of the longest prefix the shadow shares with
the request's tokens now (the prompt, the tokens the target kept: its own drafts where they
were kept), gives back the pages past it, computes the tokens it lacks, and decodes on from
there: one batched step of every request asked for per draft position. Its drafts are one
fixed token each, the proposals `speculative.py`'s verification is exact for. A request the
draft pool has no pages for gets no drafts this step.
"""

from __future__ import annotations

from pypto_serving.executor.paged import PagedExecutor
from pypto_serving.ops.sampler import Sampled
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams
from pypto_serving.scheduler import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
FEW = 4
"""The most tokens a shadow catches up on as decode rows (more: as one chunk)."""


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens the two lists agree on."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


class DraftModel:
    """A draft model's proposer (`speculative.Proposer`) over its own executor."""

    def __init__(self, executor: PagedExecutor, max_model_len: int) -> None:
        """max_model_len: the longest sequence the draft model takes (its context, its pool)."""
        self.executor, self.max_model_len = executor, max_model_len
        self._shadows: dict[str, Request] = {}

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Greedy guesses of each request's next tokens; a structured output's under its
        grammar's masks (the request's matcher advanced over them, then rolled back)."""
        out: dict[str, list[int]] = {}
        limits: dict[str, int] = {}
        step: list[tuple[Request, int]] = []  # (shadow, tokens to compute)
        for request, k in wanted:
            k = min(k, self.max_model_len - request.num_tokens)
            if k < 1:
                continue
            shadow = self._catch_up(request)
            if shadow is None:
                continue
            shadow.matcher = request.matcher
            step.append((shadow, shadow.num_tokens - shadow.num_computed_tokens))
            out[request.request_id], limits[request.request_id] = [], k
        shadows = [shadow for shadow, _ in step]
        try:
            while step:
                # a few tokens to catch up on (the kept drafts, the target's own token): as
                # decode rows of the native step (a chunk of two on the graphs cost eight
                # times one row); more (a prompt): as a chunk
                sampled = self.executor.execute(
                    SchedulerOutput([ScheduledRequest(s, n, as_rows=n <= FEW) for s, n in step])
                )
                step = [
                    (shadow, 1)
                    for shadow, n in step
                    if self._take(shadow, n, sampled[shadow.request_id][0], out, limits)
                ]
        finally:
            for shadow in shadows:  # the requests' grammars as they were
                if shadow.matcher is not None:
                    shadow.matcher.rollback(len(out[shadow.request_id]))
                    shadow.matcher = None
        return out

    def _take(
        self,
        shadow: Request,
        computed: int,
        got: Sampled,
        out: dict[str, list[int]],
        limits: dict[str, int],
    ) -> bool:
        """A draft step computed `computed` tokens of the shadow and sampled `got`: whether
        it drafts on (its limit not reached, its grammar going on, a page for it)."""
        shadow.num_computed_tokens += computed
        if got.error is not None:
            return False
        matcher = shadow.matcher
        if matcher is not None and not matcher.consume_token(got.token_id):
            return False  # (never: it sampled under the grammar's mask)
        drafts = out[shadow.request_id]
        drafts.append(got.token_id)
        shadow.output_token_ids.append(got.token_id)
        if matcher is not None and matcher.is_stopped():
            return False  # the grammar is complete: the target ends here
        return len(drafts) < limits[shadow.request_id] and self.executor.kv.allocate(shadow, 1)

    def _catch_up(self, request: Request) -> Request | None:
        """The request's shadow holding its tokens, its KV kept as far as it agrees with them
        and pages for the rest allocated; None where the pool has too few pages (the shadow
        is dropped: it starts over next time). The shadow's prompt is the tokens the request
        had when last asked (they never change), its output the drafts proposed then: only
        those are compared with what the request has now."""
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, request.token_ids, GREEDY)
            self._shadows[request.request_id] = shadow
        else:
            known, drafts = len(shadow.prompt_token_ids), shadow.output_token_ids
            kept = known + shared_prefix(drafts, request.tokens(known, known + len(drafts)))
            kept = min(kept, shadow.num_computed_tokens, request.num_tokens - 1)
            if kept < shadow.num_computed_tokens:  # (the last token: again, for its logits)
                self.executor.kv.trim(shadow, kept)
            shadow.prompt_token_ids += request.tokens(known, request.num_tokens)
            shadow.output_token_ids = []
            shadow.num_computed_tokens = kept
        if not self.executor.kv.allocate(shadow, shadow.num_tokens - shadow.num_computed_tokens):
            self.forget(request.request_id)
            return None
        return shadow

    def forget(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.executor.kv.free(shadow)

    def close(self) -> None:
        for request_id in list(self._shadows):
            self.forget(request_id)
        self.executor.close()
