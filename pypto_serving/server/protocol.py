"""Request bodies of the OpenAI-compatible API (pydantic), and their SamplingParams.

Every model forbids unknown fields: an OpenAI parameter we do not implement is rejected
with 400 naming it, never silently ignored. Value ranges are checked by SamplingParams,
so the server and the offline API share one set of rules.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The sampling fields the two generation endpoints share (OpenAI's names, vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    """Accepted for compatibility (an end-user id); it does not change the answer."""
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    """Prefix-cache isolation (vLLM's name): requests share cached KV pages only with
    requests of the same salt (and requests without one only with each other)."""
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise PyptoError("stream_options is only allowed with stream: true", "stream_options")
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            **{k: v for k, v in given.items() if v is not None},
        )


TokenIds = list[StrictInt]
PromptInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: int | None = 16
    """OpenAI's default for completions; null means up to the context length."""
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [unicode_text(p, "prompt")]
        if not p:
            raise PyptoError("the prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return [unicode_text(x, "prompt") if isinstance(x, str) else list(x) for x in p]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens; null (and no max_tokens) means up to the context."""
    logprobs: bool = False
    top_logprobs: int | None = None

    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise PyptoError("give max_tokens or max_completion_tokens, not both", "max_tokens")
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise PyptoError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise PyptoError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them."""
    return [
        {"role": m.role, "content": unicode_text(m.text(), f"messages.{i}.content")}
        for i, m in enumerate(messages)
    ]


def is_unicode(text: str) -> bool:
    """False for text with a lone surrogate (JSON's "\\ud800" escapes allow them), which no
    tokenizer can encode."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def unicode_text(text: str, param: str) -> str:
    """`text`, checked by `is_unicode`."""
    if not is_unicode(text):
        raise PyptoError(f"{param} is not valid Unicode (a lone surrogate)", param)
    return text


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, prompt: str | None) -> str | None:
        if prompt is not None and not is_unicode(prompt):
            raise ValueError("not valid Unicode (a lone surrogate)")
        return prompt


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
