"""SamplingParams: how to pick each next token and when to stop (vLLM's names and meanings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pypto_serving.errors import PyptoError

INT64 = range(-(2**63), 2**63)
"""Integer parameters must fit here: they end up in torch tensors and generators."""
MAX_SHOWN_CHARS = 40
"""A value shown in an error message longer than this is cut short."""
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS = 300
"""Most tokens one request may bias (OpenAI's limit)."""
MAX_STOP_CHARS = 4096
"""Most stop strings per request, and most characters in them together: each is searched
for in every new piece of text (OpenAI allows 4 strings; vLLM no limit)."""
MAX_SPEC_CHARS = 200_000
"""Longest schema, grammar, regex or choice list (as JSON) a request may send."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (vLLM's rule). Such a distribution is the argmax to
float32 precision anyway, and dividing float32 logits by a tinier one overflows them (below
~1e-38 the temperature itself is 0 in float32 and every logit becomes NaN)."""


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of the fields (vLLM's names)."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text)."""
    regex: str | None = None
    choice: list[str] | None = None
    """One of these strings exactly."""
    grammar: str | None = None
    """A Lark grammar, or GBNF (llama.cpp's)."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format json_object)."""
    whitespace: bool = field(default=True, compare=False)
    """JSON may hold whitespace between its tokens as the model likes (else compact)."""

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise PyptoError(
                "structured outputs take exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(given) or 'none'}",
                "structured_outputs",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise PyptoError("choice must be a non-empty list of strings", "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise PyptoError(f"{name} must be a string", "structured_outputs")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise PyptoError("json must be a JSON schema (an object)", "structured_outputs")
        if len(self.key()) > MAX_SPEC_CHARS:
            raise PyptoError(
                f"the structured output spec is over {MAX_SPEC_CHARS} characters",
                "structured_outputs",
            )

    def key(self) -> str:
        """The spec as text: what a compiled grammar is cached by."""
        kind = (
            "json_object"
            if self.json_object
            else next(
                k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
            )
        )
        value: Any = None if self.json_object else getattr(self, kind)
        try:
            return json.dumps([kind, value, self.whitespace], sort_keys=True)
        except (TypeError, ValueError) as e:
            raise PyptoError(f"invalid {kind}: {e}", "structured_outputs") from e


MIN_REPETITION_PENALTY = 0.01
"""The smallest repetition_penalty: seen tokens' positive logits are divided by it, and a
tinier one (the fuzzer sent 5e-245) makes them infinite, which nothing can be sampled from."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping controls; `validate()` runs on construction."""

    n: int = 1
    """Number of independent samples for the prompt (they share the prompt's KV pages)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens exist."""
    temperature: float = 1.0
    """0 (or anything below GREEDY_BELOW, 1e-5) means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Makes this request's samples reproducible whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; they are left out of the returned text (unless
    include_stop_str_in_output)."""
    include_stop_str_in_output: bool = False
    """The stop string that ended the text stays at its end (vLLM's)."""
    skip_special_tokens: bool = True
    """Special tokens (EOS, control tokens) are left out of the text (vLLM's default)."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return this many top logprobs per sampled token (plus the sampled one's)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (the first's is None) and this many top logprobs at
    each prompt position (vLLM's). Such a request computes its whole prompt: it takes no prefix
    cache hit (the logits of cached positions were never computed)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to these tokens' logits before sampling (OpenAI's: -100 bans a token, 100 all
    but forces it); logprobs stay the model's own."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated (vLLM's): the token that would complete one (its token
    sequence, with or without a leading space) is banned at each step."""
    bad_words_token_ids: list[list[int]] | None = None
    """bad_words as token sequences: filled by the LLM with its tokenizer (or given)."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (vLLM's): every other token's logit is -inf; logprobs
    stay the model's own."""
    logprob_token_ids: list[int] | None = None
    """vLLM's: at each generated position, the logprobs of these tokens (and of the sampled
    one) instead of the most likely `logprobs`; needs logprobs."""
    structured_outputs: StructuredOutputsParams | None = None
    """What the output must match (grammar.py): each step samples only tokens that keep it
    matching, and the request stops where the grammar ends. logprobs stay the model's own."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise PyptoError(f"invalid structured_outputs: {e}", "structured_outputs") from e
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def bad(name: str, why: str) -> PyptoError:
            shown = repr(getattr(self, name))
            if len(shown) > MAX_SHOWN_CHARS:
                shown = shown[: MAX_SHOWN_CHARS - 3] + "..."
            return PyptoError(f"invalid {name}={shown}: {why}", param=name)

        for name in (
            "n",
            "max_tokens",
            "min_tokens",
            "top_k",
            "seed",
            "logprobs",
            "prompt_logprobs",
        ):
            value = getattr(self, name)
            if isinstance(value, int) and value not in INT64:
                raise bad(name, "must fit in a 64-bit integer")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must not exceed max_tokens")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or an integer >= 0")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            raise bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, 2]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise bad("stop", f"the stop strings may hold at most {MAX_STOP_CHARS} characters")
        if any(not isinstance(t, int) or not 0 <= t < INT64.stop for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative 64-bit integers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or not 0 <= t < INT64.stop:
                raise bad("logit_bias", "token ids must be non-negative 64-bit integers")
            if not isinstance(b, int | float) or not math.isfinite(b) or not -100 <= b <= 100:
                raise bad("logit_bias", "biases must be numbers in [-100, 100]")
        if len(self.bad_words) > MAX_STOP_STRINGS or any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise bad("bad_words", f"at most {MAX_STOP_STRINGS} non-empty words")
        if sum(map(len, self.bad_words)) > MAX_STOP_CHARS:
            raise bad("bad_words", f"the words may hold at most {MAX_STOP_CHARS} characters")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must name at least one token (or be left out)")
            if any(
                not isinstance(t, int) or not 0 <= t < INT64.stop for t in self.allowed_token_ids
            ):
                raise bad("allowed_token_ids", "token ids must be non-negative 64-bit integers")
        for name in ("logprobs", "prompt_logprobs"):  # the bound is the engine's max_logprobs
            count = getattr(self, name)
            if count is not None and (not isinstance(count, int) or count < 0):
                raise bad(name, "must be an integer >= 0")
        if self.logprob_token_ids is not None:
            if self.logprobs is None or not self.logprob_token_ids:
                raise bad("logprob_token_ids", "needs logprobs, and at least one token id")
            if any(not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
                raise bad("logprob_token_ids", "token ids must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
