"""What the engine returns for a request (vLLM's RequestOutput / CompletionOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pypto_serving.ops.sampler import Sampled


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """'stop' (EOS, stop token or stop string), 'length', 'abort', or None while running."""
    logprobs: list[Sampled] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """Of the cached prompt tokens, how many each KV tier held (device, cpu, ssd)."""
    prompt_logprobs: list[Sampled | None] | None = None
    """With SamplingParams.prompt_logprobs: each prompt token's logprob and top logprobs
    (None for the first token, which nothing predicts)."""


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What LLM.embed returns for one prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclass(slots=True)
class CompletionDelta:
    """What one sequence produced since its previous delta (the unit of streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Sampled] | None
    finish_reason: str | None
