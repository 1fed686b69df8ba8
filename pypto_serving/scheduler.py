"""The scheduler: decides when and for whom to compute, never where the KV lives.

Each step it hands out a token budget: running requests first (decodes and unfinished
prefill chunks), then waiting requests in priority order. A request's computed tokens catch
up with its tokens, so chunked prefill, prefix hits and decode are one rule. When the KV
store cannot take a request's new tokens, the most recently arrived running request (lowest
priority first) is preempted: the store either swaps its KV out to a lower tier (restored when
it resumes) or drops it (recompute: it starts over later). Either way it keeps its sampled
tokens, so its output is the same as an unpreempted run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pypto_serving.config import SchedulerConfig
from pypto_serving.ops.sampler import Sampled
from pypto_serving.request import Request, RequestStatus
from pypto_serving.speculative import Speculator


class KVCapacity(Protocol):
    """The questions the scheduler asks the KV store (it never sees page ids)."""

    def num_cached_tokens(self, request: Request, limit: int | None = None) -> int | None:
        """Claim the request's cached prefix (or swapped-out KV), at most `limit` tokens of it;
        return how many tokens it covers, or None if it cannot be brought in yet (try again
        later)."""
        ...

    def cached_tokens_by_tier(self, request: Request) -> dict[str, int]:
        """The tokens of the request's claim per tier they came from."""
        ...

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more of the request's tokens; False if it cannot."""
        ...

    def free(self, request: Request) -> None:
        """The request no longer needs its KV now (finished, aborted, or not admitted)."""
        ...

    def preempt(self, request: Request) -> bool:
        """Release a preempted request's pages; True if its KV was kept (swapped out) to be
        handed back by `num_cached_tokens` when it resumes, False if it must recompute."""
        ...


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)
    """Speculative decoding: tokens guessed to follow the request's last one, computed in
    this step after it (num_new_tokens counts them) and kept as far as its samples agree."""
    as_rows: bool = False
    """Its new tokens computed as decode rows, one at each position (a draft model's shadow
    catching up on a few: the native step's rows, not a chunk on the graphs)."""


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """How the decode kernel's products take a step's rows: `size` at a time, each block a
    pass over the weights, a last block of up to `widest` (>= size) rows in one pass."""

    size: int
    widest: int

    def room(self, rows: int) -> int:
        """Rows a step of `rows` may add without another pass over the weights."""
        extra = self.widest - self.size  # rows a last block may take past `size`
        passes = max(1, -(-(rows - extra) // self.size))
        return passes * self.size + extra - rows


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCapacity,
        speculator: Speculator | None = None,
        decode_rows: int | None = None,
        row_blocks: RowBlocks | None = None,
    ) -> None:
        """speculator: drafts for decoding requests (speculative decoding), None: none;
        decode_rows: the most rows a step's decodes may have, their drafts included, where
        more would move them off the kernel plain decodes of that step run on (None: any);
        row_blocks: how that kernel multiplies rows, by blocks each a pass over the weights:
        drafts fill the decodes' last block, never start another (None: no blocks)."""
        self.config, self.kv = config, kv
        self.speculator, self.decode_rows, self.row_blocks = speculator, decode_rows, row_blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swapped = 0  # of which the KV store kept the victim's KV (swap)
        self.prefix_queries = 0  # prompt tokens of admitted requests
        self.prefix_hits = 0  # of which the prefix cache held

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        spare = self._spare_rows()
        drafts = self._drafts(budget, spare)
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req, budget)
            draft = drafts.get(req.request_id, [])[: max(min(budget - n, spare), 0)]
            if draft and self.kv.allocate(req, n + len(draft)):
                out.scheduled.append(ScheduledRequest(req, n + len(draft), draft))
                budget, spare = budget - n - len(draft), spare - len(draft)
            elif self._allocate_or_preempt(req, n, out):
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
        if not out.preempted:
            budget = self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        self.waiting.sort(key=lambda r: (r.priority, r.arrival))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            limit = None  # a request scoring its prompt: no hit past the positions scored
            if req.params.prompt_logprobs is not None:
                limit = len(req.prompt_logprobs)
            cached = self.kv.num_cached_tokens(req, limit)
            if cached is None:  # its swapped-out KV does not fit yet
                break
            req.num_computed_tokens = cached
            n = self._chunk(req, budget)
            if not self.kv.allocate(req, n):
                self.kv.free(req)  # a waiting request holds no pages, so none can deadlock
                req.num_computed_tokens = 0
                break
            if req.num_preemptions == 0:  # first admission: record the prefix-cache hit
                req.scheduled_time = time.monotonic()
                req.num_cached_tokens = req.num_computed_tokens
                req.cached_tokens_by_tier = self.kv.cached_tokens_by_tier(req)
                self.prefix_queries += len(req.prompt_token_ids)
                self.prefix_hits += req.num_cached_tokens
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return budget

    def _spare_rows(self) -> int:
        """Rows this step's drafts may add: what `decode_rows` leaves beside one row per
        decoding request, and what the decodes' last block of `row_blocks` leaves (every row
        the budget leaves where there is no such limit, or the decodes exceed it anyway)."""
        if self.speculator is None:
            return 0
        decodes = sum(r.num_computed_tokens == r.num_tokens - 1 for r in self.running)
        rows = self.decode_rows
        if rows is None or decodes > rows:
            return self.config.max_num_batched_tokens
        room = self.row_blocks.room(decodes) if self.row_blocks else rows - decodes
        return min(rows - decodes, room)

    def _drafts(self, budget: int, spare: int) -> dict[str, list[int]]:
        """The speculator's drafts for this step's decoding requests, asked for all at once
        (a draft model proposes for them in one batch): each at most the room the budget and
        `spare` rows leave after the requests before it (each counted at its limit), and none
        past its max_tokens or context (the step may add one token more than it drafts)."""
        if self.speculator is None:
            return {}
        wanted: list[tuple[Request, int]] = []
        for req in self.running:
            if budget <= 0:
                break
            n = self._chunk(req, budget)
            budget -= n
            if req.num_computed_tokens != req.num_tokens - 1:
                continue
            limit = min(budget, spare)
            if req.params.max_tokens is not None:
                limit = min(limit, req.params.max_tokens - len(req.output_token_ids) - 1)
            if req.max_model_len is not None:
                limit = min(limit, req.max_model_len - req.num_tokens - 1)
            limit = min(limit, self.speculator.budget(req.request_id))
            if limit > 0:
                wanted.append((req, limit))
                budget, spare = budget - limit, spare - limit
        return self.speculator.draft(wanted) if wanted else {}

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(n, threshold) if threshold > 0 else n

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(req, n):
            victim = max(self.running, key=lambda r: (r.priority, r.arrival))
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
            out.scheduled = [s for s in out.scheduled if s.request is not victim]
        return True

    def _preempt(self, req: Request) -> None:
        self.num_swapped += self.kv.preempt(req)
        self.running.remove(req)
        req.status, req.num_computed_tokens = RequestStatus.PREEMPTED, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[Sampled]]) -> list[Request]:
        """Advance computed tokens after a step and append what it sampled (a request with
        drafts: those kept, then the sample after them); returns the requests that finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            tokens = sampled.get(req.request_id, [])
            if s.draft:  # its last token and the drafts kept are computed; the rest is not
                kept = len(tokens) - 1
                req.num_computed_tokens += 1 + kept
                assert self.speculator is not None and kept >= 0
                self.speculator.observe(req.request_id, len(s.draft), kept)
            else:
                req.num_computed_tokens += s.num_new_tokens
            for token in tokens:
                req.append(token)
                if req.finished:  # a stop among the kept drafts: what follows is dropped
                    break
            if req.finished:
                finished.append(req)
        self._remove(finished)
        return finished

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> list[Request]:
        """Stop requests at any stage (finish_reason `reason`); everything they held is freed."""
        aborted = [self.requests[r] for r in request_ids if r in self.requests]
        for req in aborted:
            req.finish(reason)
        self._remove(aborted)
        return aborted

    def _remove(self, requests: list[Request]) -> None:
        for req in requests:
            self.kv.free(req)
            if self.speculator is not None:
                self.speculator.forget(req.request_id)
            self.requests.pop(req.request_id, None)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
