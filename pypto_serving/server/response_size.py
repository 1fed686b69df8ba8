"""A response's size: bounded before the request runs, and rendered off the event loop.

Logprobs are what make a response large: a small body (`n: 128`, `echo`, `logprobs: 20`,
`prompt_logprobs: 20`, a 1,000-token prompt) once asked for 258 MB of JSON. So each request's
logprob entries are counted before it is queued, as its endpoint lays them out, and a request
that could pass `--max-response-logprobs` is a 400 naming the limit. An entry is one token's
logprob or one of its top alternatives:

    per prompt:  returned x prompt tokens x (1 + echo's top)           completions' echo
               + copies   x prompt tokens x (1 + prompt_logprobs)      vLLM's prompt_logprobs
               + sampled  x new tokens    x (1 + logprobs)             the generated tokens

`copies` is `returned` on completions (each choice holds them) and 1 on chat (the response
does); completions' top logprobs count one more (each holds the token's own entry too);
`sampled` is best_of; new tokens are `max_tokens`, or what the context leaves.

A response within the limit can still be tens of MB: it is built and encoded on a worker
thread by the pure-Python encoder (`render_json`), which gives the GIL back every few
milliseconds, where the C encoder would hold it for the whole document and stall /health.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import SamplingParams
from pypto_serving.server.protocol import ChatCompletionRequest, CompletionRequest

_BODY_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""The encoder of Starlette's JSONResponse (the same bytes), run in pure Python."""
_SSE_ENCODER = json.JSONEncoder()
"""json.dumps' defaults (what `sse` writes), run in pure Python."""


def top_count(params: SamplingParams) -> int:
    """Top logprobs a generated token comes with: logprobs, or logprob_token_ids' tokens and
    the sampled one."""
    named = params.logprob_token_ids
    return len(named) + 1 if named else params.logprobs or 0


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What a response holds for each of its prompts, as its endpoint lays it out."""

    returned: int
    """Choices returned per prompt (n)."""
    sampled: int
    """Sequences sampled per prompt (best_of): each holds its tokens' logprobs until the best
    are chosen."""
    generated_top: int | None
    """Top logprobs of each generated token (None: no logprobs)."""
    echo_top: int | None = None
    """Completions' echo with logprobs: each choice's logprobs lead with the prompt's, with
    this many top ones (None: no echoed logprobs)."""
    prompt_top: int | None = None
    """vLLM's prompt_logprobs: each prompt token with this many top ones (None: not asked)."""
    prompt_once: bool = False
    """The response holds prompt_logprobs once (chat), not in every choice (completions)."""

    @staticmethod
    def of_completion(body: CompletionRequest, params: SamplingParams) -> ResponseShape:
        """Completions' top logprobs repeat each token's own entry: one more per token."""
        echo_top = body.logprobs + 1 if body.echo and body.logprobs is not None else None
        top = top_count(params) + 1 if params.logprobs is not None else None
        return ResponseShape(body.n, params.n, top, echo_top, body.prompt_logprobs)

    @staticmethod
    def of_chat(body: ChatCompletionRequest, params: SamplingParams) -> ResponseShape:
        prompt_top = body.prompt_logprobs
        top = top_count(params) if params.logprobs is not None else None
        return ResponseShape(body.n, params.n, top, None, prompt_top, True)

    def entries(self, prompt_tokens: int, new_tokens: int) -> Counter[str]:
        """Logprob entries for one prompt, by the parameter that asks for them."""
        out: Counter[str] = Counter()
        if self.echo_top is not None:
            out["logprobs"] += self.returned * prompt_tokens * (1 + self.echo_top)
        if self.generated_top is not None:
            out["logprobs"] += self.sampled * new_tokens * (1 + self.generated_top)
        if self.prompt_top is not None:
            copies = 1 if self.prompt_once else self.returned
            out["prompt_logprobs"] += copies * prompt_tokens * (1 + self.prompt_top)
        return out


def check_response_size(
    shape: ResponseShape,
    prompts: list[list[int]],
    max_tokens: int | None,
    max_model_len: int,
    limit: int,
) -> None:
    """Raise PyptoError (a 400) when the response could hold more than `limit` logprob
    entries, naming the limit and the parameter asking for the most of them."""
    parts: Counter[str] = Counter()
    for ids in prompts:
        new = max_tokens if max_tokens is not None else max(max_model_len - len(ids), 0)
        parts += shape.entries(len(ids), new)
    total = sum(parts.values())
    if total <= limit:
        return
    which = ", ".join(f"{name} {count:,}" for name, count in parts.most_common())
    raise PyptoError(
        f"the response could hold {total:,} logprobs ({which}), over this server's limit of "
        f"{limit:,} logprobs per response (--max-response-logprobs); ask for fewer choices (n), "
        "top logprobs or tokens (max_tokens), or send a shorter prompt",
        parts.most_common(1)[0][0],
    )


def render_json(content: Any) -> bytes:
    """`content` as JSONResponse writes it (run it on a worker thread: it takes a while)."""
    return "".join(_BODY_ENCODER.iterencode(content)).encode()


def render_sse(content: Any) -> str:
    """`content` as one SSE event, as `sse` writes it (for a worker thread)."""
    return f"data: {''.join(_SSE_ENCODER.iterencode(content))}\n\n"
