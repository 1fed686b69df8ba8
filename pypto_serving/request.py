"""Request: one prompt's journey through the engine, and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pypto_serving.errors import RequestFailedError, RequestRejectedError
from pypto_serving.kv.handoff import Handoff
from pypto_serving.ops.sampler import Sampled
from pypto_serving.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """A sequence to extend. Its computed tokens catch up with its tokens step by step; that one
    rule covers chunked prefill, prefix hits, decode and resumption after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    """Lower runs first; ties go to the earlier arrival."""
    arrival: int = 0
    """Arrival order (breaks priority ties)."""
    arrival_time: float = 0.0
    """time.monotonic() when the request arrived (for queue-time and latency metrics)."""
    scheduled_time: float | None = None
    """time.monotonic() when the scheduler first admitted it."""
    max_model_len: int | None = None
    cache_salt: str | None = None
    """Isolates this request's prefix-cache entries from requests with another salt."""
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[Sampled] = field(default_factory=list)
    """With params.prompt_logprobs: prompt token i + 1's logprob given tokens 0..i, for the
    positions computed so far (filled by the executor as the prompt is computed)."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at admission."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """Of those, how many each KV tier held (device, cpu, ssd)."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    """Why the request was lost to a fault (its worker died or hung, or its logits were NaN),
    if it was, or (`rejected`) why its own constraints stopped it."""
    rejected: bool = False
    generator: torch.Generator | None = None
    matcher: Any = None
    """The llguidance matcher of a request with structured outputs (grammar.py), made by
    the engine that runs it; it advances with each token appended."""
    export_kv: bool = False
    """A prefill server's request for a decode server: once its first token is sampled, its
    KV and that token are handed off (`handoff`), and it ends."""
    handoff: Handoff | None = None
    """On a prefill server, what it hands off once its first token is sampled; on a decode
    server, what it was handed (the request goes on from there)."""
    num_told: int = 0
    """Output tokens a data-parallel replica has told its parent of (a step may append
    several: speculative decoding)."""

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (the executor's hot path)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append(self, sampled: Sampled) -> None:
        """Record a sampled token and finish the request if it hits a stop condition (or fail
        it when the sampler found its logits unusable)."""
        if sampled.error is not None:
            self.fail(sampled.error, sampled.rejected)
            return
        self.output_token_ids.append(sampled.token_id)
        if self.params.logprobs is not None:
            self.output_logprobs.append(sampled)
        p, n, token = self.params, len(self.output_token_ids), sampled.token_id
        if self.matcher is not None and not self.matcher.consume_token(token):
            self.fail(f"the structured output failed: {self.matcher.get_error()}")
            return
        if self.matcher is not None and self.matcher.is_stopped():
            self.finish("stop")  # the grammar is complete: nothing may follow but EOS
        elif n >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            self.finish("stop")
        elif (p.max_tokens is not None and n >= p.max_tokens) or (
            self.max_model_len is not None and self.num_tokens >= self.max_model_len
        ):
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason

    def fail(self, why: str, rejected: bool = False) -> None:
        """Finish a request lost to a fault (or, `rejected`, stopped by its own constraints),
        not to a stop condition."""
        self.error, self.rejected = why, rejected
        self.finish("error")

    def failure(self) -> RequestFailedError | RequestRejectedError:
        """The error of a failed request: the engine's fault (503) or its input's (400)."""
        assert self.error is not None
        return RequestRejectedError(self.error) if self.rejected else RequestFailedError(self.error)
