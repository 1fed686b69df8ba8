"""Request bodies of the OpenAI-compatible API (pydantic), and their SamplingParams.

Every model forbids unknown fields: an OpenAI parameter we do not implement is rejected
with 400 naming it, never silently ignored. Value ranges are checked by SamplingParams,
so the server and the offline API share one set of rules. Every string of a request must be
valid Unicode (no lone surrogate, which JSON's escapes allow): 400 naming the field.

Validation runs on the event loop, so its cost is bounded before it starts: lists stop at
their first bad item (`fail_fast`; otherwise a union collects one error per item and member,
seconds for a large body), and the number of prompts and of chat items is checked first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    model_validator,
)

from pypto_serving.beam_search import BeamSearchParams
from pypto_serving.chat_prompt import ChatTemplateOptions
from pypto_serving.config import GRAMMAR_BACKENDS
from pypto_serving.errors import PyptoError
from pypto_serving.sampling import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams
from pypto_serving.server.errors import APIError, quoted

NONE: Mapping[str, Any] = MappingProxyType({})
"""No defaults."""
GUIDED = ("json", "regex", "choice", "grammar")
"""vLLM's older guided_* fields, in StructuredOutputsParams' order."""
MAX_SEQUENCES_PER_REQUEST = 128
"""Prompts x n of one request: more is refused (one request must not flood the queue)."""
MAX_TEMPLATE_CHARS = 64 << 10
"""Longest chat template a request may bring."""
MAX_TOOLS = 128
"""Most tools one request may offer (OpenAI's limit)."""
MAX_CHAT_ITEMS = 10_000
"""Most messages plus content parts in one conversation."""
MAX_ROLE_CHARS = 64
"""Longest role name of a message."""
MAX_TOKEN_ID_DIGITS = 19
"""Digits of the largest token id a logit_bias key may name (a 64-bit integer's)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(_Body):
    """A whole request body: every string in it is checked to be valid Unicode."""

    @model_validator(mode="after")
    def _valid_unicode(self) -> _Request:
        where = lone_surrogate(self, "")
        if where is not None:
            raise PyptoError(f"{where} is not valid Unicode (a lone surrogate)", where)
        return self


def lone_surrogate(value: Any, path: str) -> str | None:
    """The path (`messages.0.name`) of the first string in `value` (a model, a list, a
    string) that is not valid Unicode, or None."""
    if isinstance(value, str):
        return None if is_unicode(value) else path
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            where = lone_surrogate(getattr(value, name), f"{path}.{name}".lstrip("."))
            if where is not None:
                return where
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for i, item in enumerate(value):  # token id lists are skipped: all ints
            where = lone_surrogate(item, f"{path}.{i}")
            if where is not None:
                return where
    return None


def few_prompts(param: str) -> Callable[[Any], Any]:
    """A validator refusing a list of more prompts than one request may run, before they
    are validated (an error naming `param`)."""

    def check(prompt: Any) -> Any:
        many = isinstance(prompt, list) and len(prompt) > MAX_SEQUENCES_PER_REQUEST
        if many and isinstance(prompt[0], str | list):  # a list of prompts, not of token ids
            raise PyptoError(
                f"{len(prompt)} prompts are over the limit of {MAX_SEQUENCES_PER_REQUEST} "
                "sequences per request",
                param,
            )
        return prompt

    return check


def _few_biases(bias: Any) -> Any:
    """Refuse a logit_bias of more than MAX_LOGIT_BIAS tokens, before validating its keys."""
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise PyptoError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias"
        )
    return bias


def _few_chat_items(messages: Any) -> Any:
    """Refuse a conversation of more than MAX_CHAT_ITEMS messages and content parts, before
    validating them."""
    if not isinstance(messages, list):
        return messages
    count = len(messages)
    for m in messages:
        if count > MAX_CHAT_ITEMS:
            break
        content = m.get("content") if isinstance(m, dict) else None
        count += len(content) if isinstance(content, list) else 0
    if count > MAX_CHAT_ITEMS:
        raise PyptoError(
            f"a conversation may hold at most {MAX_CHAT_ITEMS} messages and content parts together",
            "messages",
        )
    return messages


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """With include_usage: every chunk carries the usage so far (vLLM's)."""


class JsonSchemaFormat(_Body):
    """response_format's json_schema: the schema the output must match."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """True: objects take no properties their schema does not name (OpenAI's strict mode)."""


class ResponseFormat(_Body):
    """OpenAI's `response_format`: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise PyptoError("response_format json_schema needs its json_schema", "response_format")
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return StructuredOutputsParams(
            json=closed_objects(schema) if self.json_schema.strict else schema
        )


def closed_objects(schema: Any) -> Any:
    """A copy of schema whose object schemas that say nothing of additionalProperties take
    none (OpenAI's strict mode)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[StrictStr], Field(fail_fast=True)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
            whitespace=not self.disable_any_whitespace,
        )


def unsupported(name: str, message: str) -> APIError:
    """400 `unsupported_parameter` naming the field: a value this server does not implement."""
    return APIError(400, message, param=name, code="unsupported_parameter")


def _neutral(value: Any, name: str, what: str) -> None:
    """Refuse a value that would change the answer in a way this server does not implement
    yet; the neutral values clients send by default (None, {}, [], False) pass."""
    if value:
        raise unsupported(
            name, f"{name} is not supported yet ({what}); send it empty or leave it out"
        )


class _Sampling(_Request):
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
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    stop_token_ids: Annotated[list[int], Field(fail_fast=True)] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    """Accepted for compatibility (an end-user id); it does not change the answer."""
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    """Prefix-cache isolation (vLLM's name): requests share cached KV pages only with
    requests of the same salt (and requests without one only with each other)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's, for prefill and decode on separate servers (engine/kv_transfer.py):
    `{"do_remote_decode": true}` asks a prefill server to compute the prompt and its first
    token and hand them off (the response's `kv_transfer_params` say where);
    `{"do_remote_prefill": true, ...}` (those params) asks a decode server to go on from
    there. `pypto router` sends both."""
    logit_bias: Annotated[dict[str, float] | None, BeforeValidator(_few_biases)] = None
    """Token id (as a string, OpenAI's JSON) -> a bias in [-100, 100] added to its logit."""
    best_of: int | None = None
    """Candidates to sample per prompt (default n): the n of highest cumulative logprob are
    returned. Above n, not with stream."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """vLLM's: json, regex, choice, grammar or json_object."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[StrictStr], Field(fail_fast=True)] | None = None
    guided_grammar: str | None = None
    """vLLM's older names (before structured_outputs)."""
    guided_decoding_backend: str | None = None
    """vLLM's choice of grammar library (`xgrammar`, `guidance`, `outlines`, ..., with
    `:option,...`): every name means this server's one engine, llguidance (grammar.py);
    the options `disable-any-whitespace` and `disable-additional-properties` keep their
    meaning, `no-fallback` has nothing to turn off."""
    allowed_token_ids: Annotated[list[StrictInt], Field(fail_fast=True)] | None = None
    """vLLM's: only these tokens may be sampled."""
    logprob_token_ids: Annotated[list[StrictInt], Field(fail_fast=True)] | None = None
    """vLLM's: at each generated position, these tokens' logprobs (and the sampled one's) are
    its top_logprobs, in place of the most likely; needs logprobs."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs name every token `token_id:<id>` (default: the server's
    --return-tokens-as-token-ids)."""
    return_token_ids: bool | None = None
    """vLLM's: the response carries the prompt's token ids and each choice's generated ones
    (`prompt_token_ids`, `token_ids`), as the model saw and wrote them."""
    store: bool | None = None
    """OpenAI's stored completions: nothing is stored here, so true is refused."""
    metadata: dict[str, str] | None = None
    """Tags for stored completions (OpenAI): accepted, with nothing stored."""
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's logprob and this many top logprobs at each position."""
    include_stop_str_in_output: bool = False
    """vLLM's: the stop string that ended a choice stays at the end of its text."""
    bad_words: Annotated[list[StrictStr], Field(fail_fast=True)] | None = None
    """vLLM's: words never generated."""
    skip_special_tokens: bool = True
    """vLLM's: special tokens are left out of the text (false: kept, as the model wrote)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """vLLM's: only k of the prompt's tokens are used (-1: the longest the context takes,
    max_model_len - 1), its last ones unless truncation_side says otherwise."""
    truncation_side: Literal["left", "right"] = "left"
    """vLLM's: where truncate_prompt_tokens cuts: left (the last k kept) or right (the first
    k)."""
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    """vLLM's: what the response's id is made of (`cmpl-<id>`, `chatcmpl-<id>`); the
    X-Request-Id header gives it too."""
    priority: int = 0
    """vLLM's: the lower runs first when requests wait (ties in arrival order); a request
    waiting behind lower ones is the first preempted."""
    use_beam_search: bool = False
    """vLLM's: the n best beams of a beam search of width n (beam_search.py), not samples."""
    length_penalty: float = 1.0
    """vLLM's, with use_beam_search: a finished beam scores its cumulative logprob over its
    length to this power."""

    def beam_params(self, max_tokens: int | None) -> BeamSearchParams | None:
        """The beam search asked for (None: sampling), `max_tokens` the request's own or
        what the context leaves. A field beam search cannot honour is a 400 naming it."""
        if not self.use_beam_search:
            return None
        if self.stream:
            raise PyptoError(
                "beam search cannot be streamed: the best beams are known only at the end",
                "stream",
            )
        for name in BEAM_FREE:
            value = getattr(self, name)
            if name == "best_of":
                given = value is not None and value != self.n
            elif name == "logprobs":  # 0 asks for logprobs too
                given = value is not None and value is not False
            else:  # a penalty's, a list's or a count's nothing
                given = value not in (None, False, 0, 1.0, [], {})
            if given:
                raise PyptoError(
                    f"{name} does not apply to beam search (it ranks beams by the model's own "
                    "logprobs, none sampled); leave it out or drop use_beam_search",
                    name,
                )
        if self.structured() is not None:
            raise PyptoError("beam search takes no structured output", self.structured_param())
        assert max_tokens is not None
        return BeamSearchParams(
            self.n, max_tokens, ignore_eos=self.ignore_eos, length_penalty=self.length_penalty
        )

    def scored_prompt(self) -> int | None:
        """Top logprobs to score each prompt position with (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def truncated(self, prompt: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it (its last k tokens; -1: room for
        one new token)."""
        k, side = self.truncate_prompt_tokens, self.truncation_side
        return keep_last(prompt, k, max_model_len - 1, side)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, Any] = NONE
    ) -> SamplingParams:
        """The request's SamplingParams; `defaults` (the model's generation config) give the
        sampling fields it leaves out, and its max_tokens where it gives none."""
        if "max_tokens" in defaults and not {"max_tokens", "max_completion_tokens"} & (
            self.model_fields_set
        ):
            max_tokens = defaults["max_tokens"]
        if self.stream_options is not None and not self.stream:
            raise PyptoError("stream_options is only allowed with stream: true", "stream_options")
        _neutral(self.store, "store", "nothing is stored")
        best_of = self.candidates()
        if best_of > self.n and self.stream:
            raise PyptoError(
                "best_of above n cannot be streamed: the best are known only at the end",
                "best_of",
            )
        if best_of > self.n and logprobs is None:
            logprobs = 0  # each token's own logprob, to rank the candidates by
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        given = {k: v for k, v in defaults.items() if k != "max_tokens"} | {
            k: v for k, v in given.items() if v is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=best_of,
            logit_bias=token_ids_of(self.logit_bias or {}),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.scored_prompt(),
            allowed_token_ids=self.allowed_token_ids,
            logprob_token_ids=self.logprob_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            bad_words=list(self.bad_words or []),
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured(),
            **given,
        )

    def sequences_param(self) -> str:
        """The field that sets the sequences sampled per prompt: best_of where it is above
        n (what errors about their number name)."""
        return "best_of" if self.best_of is not None and self.best_of > self.n else "n"

    def candidates(self) -> int:
        """Sequences sampled per prompt: best_of, at least n."""
        if self.best_of is None:
            return self.n
        if self.best_of < self.n:
            raise PyptoError(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        return self.best_of

    def structured(self) -> StructuredOutputsParams | None:
        """What the output must match: response_format, structured_outputs or vLLM's older
        guided_* fields, one of them at most (compiled when the server admits the request,
        off the event loop: `OpenAIServing.admit_grammar`)."""
        return next(iter(self._structured().values()), None)

    def structured_param(self) -> str:
        """The field that gives the structured output: what errors about it name."""
        return next(iter(self._structured()), "structured_outputs")

    def _structured(self) -> dict[str, StructuredOutputsParams]:
        guided = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        found: dict[str, StructuredOutputsParams | None] = {
            "response_format": self.response_format.structured() if self.response_format else None,
            "structured_outputs": self.structured_outputs.params()
            if self.structured_outputs
            else None,
            next(  # vLLM's older fields, named by the first given
                (f"guided_{k}" for k, v in zip(GUIDED, guided, strict=True) if v is not None),
                "guided_json",
            ): StructuredOutputsParams(*guided) if any(v is not None for v in guided) else None,
        }
        given = {k: v for k, v in found.items() if v is not None}
        if len(given) > 1:
            raise PyptoError(
                f"give one of {', '.join(given)}: each constrains the output", next(iter(given))
            )
        options = backend_options(self.guided_decoding_backend)
        return {k: with_backend_options(v, options) for k, v in given.items()}


BEAM_FREE = (
    "stop",
    "bad_words",
    "stop_token_ids",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "logprob_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
    "logprobs",
    "best_of",
)
"""Fields beam search cannot honour: a value other than the neutral one is a 400."""


BACKEND_OPTIONS = frozenset(
    {"disable-any-whitespace", "disable-additional-properties", "no-fallback"}
)


def backend_options(backend: str | None) -> set[str]:
    """The options of a guided_decoding_backend (`xgrammar:disable-any-whitespace`); 400 for
    a name or an option vLLM does not have."""
    if backend is None:
        return set()
    name, _, rest = backend.partition(":")
    options = {o.strip() for o in rest.split(",") if o.strip()}
    if name not in GRAMMAR_BACKENDS or not options <= BACKEND_OPTIONS:
        raise PyptoError(
            f"guided_decoding_backend {quoted(backend)} is not one of "
            f"{', '.join(sorted(GRAMMAR_BACKENDS))} (each means this server's grammar engine, "
            f"llguidance), with options among {', '.join(sorted(BACKEND_OPTIONS))}",
            "guided_decoding_backend",
        )
    return options


def with_backend_options(
    spec: StructuredOutputsParams, options: set[str]
) -> StructuredOutputsParams:
    """`spec` as guided_decoding_backend's options change it."""
    if "disable-any-whitespace" in options:
        spec = replace(spec, whitespace=False)
    if "disable-additional-properties" in options and isinstance(spec.json, dict):
        spec = replace(spec, json=closed_objects(spec.json))
    return spec


def keep_last(prompt: list[int], k: int | None, longest: int, side: str = "left") -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the `longest` the
    context takes; None: all of it); its first k where `side` is right."""
    if k is None:
        return prompt
    if k == 0:
        raise PyptoError(
            "truncate_prompt_tokens must be -1 (the context's length) or at least 1",
            "truncate_prompt_tokens",
        )
    keep = longest if k == -1 else k
    return prompt[:keep] if side == "right" else prompt[-keep:]


def token_ids_of(bias: Mapping[str, float]) -> dict[int, float]:
    """logit_bias with its keys as token ids: ASCII decimal digits (blanks around them
    allowed), at most MAX_TOKEN_ID_DIGITS of them once leading zeros are gone; the error
    names the first few keys that are not. The vocabulary's bound is the engine's check."""
    out, bad = {}, []
    for key, value in bias.items():
        text = key.strip()
        digits = text.lstrip("0") or "0"  # int() refuses over 4,300 digits, leading zeros too
        if not (text.isascii() and text.isdigit()) or len(digits) > MAX_TOKEN_ID_DIGITS:
            bad.append(key)
        else:
            out[int(digits)] = value
    if bad:
        shown = ", ".join(quoted(k) for k in bad[:5]) + (
            f" and {len(bad) - 5} more" * (len(bad) > 5)
        )
        raise PyptoError(
            f"logit_bias keys must be token ids: ASCII decimal integers within the "
            f"vocabulary, got {shown}",
            "logit_bias",
        )
    return out


TokenIds = Annotated[list[StrictInt], Field(fail_fast=True)]
PromptInput = (
    StrictStr
    | Annotated[list[StrictStr], Field(fail_fast=True)]
    | TokenIds
    | Annotated[list[TokenIds], Field(fail_fast=True)]
)


class CompletionRequest(_Sampling):
    prompt: Annotated[PromptInput, BeforeValidator(few_prompts("prompt"))]
    max_tokens: int | None = 16
    """OpenAI's default for completions; null means up to the context length."""
    logprobs: int | None = None
    echo: bool = False
    """With logprobs: the prompt's tokens' logprobs too (lm-evaluation-harness' loglikelihood)."""

    def scored_prompt(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token id lists."""
        return prompt_list(self.prompt, "prompt")


def prompt_list(given: Any, param: str) -> list[str | list[int]]:
    """A validated PromptInput as a list of strings or token id lists; an empty one is a 400
    naming `param`."""
    if isinstance(given, str):
        return [given]
    if not given:
        raise PyptoError(f"the {param} is empty", param)
    if isinstance(given[0], int):  # validated: a list of token ids, or of prompts, not mixed
        return [given]  # not read, nor copied: the engine's check reads its length first
    return [x if isinstance(x, str) else list(x) for x in given]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""


class ToolCallItem(_Body):
    """A call an assistant message made (a conversation's history)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    model_config = ConfigDict(extra="ignore")
    """Fields of a message beyond these are ignored (vLLM's rule: clients add their own)."""

    role: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ROLE_CHARS)]
    """system, user, assistant, developer, tool, or a role of the client's own (the chat
    template decides what it shows)."""
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None
    """None (or left out) only for an assistant message that called tools."""
    name: str | None = None
    """The participant's name: given to the chat template (which may show it or not)."""
    tool_calls: Annotated[list[ToolCallItem], Field(fail_fast=True)] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tool_calls") and "content" not in data:
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PyptoError("only an assistant message has tool_calls", "messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise PyptoError("only a tool message has a tool_call_id", "messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PyptoError(
                f"a {self.role} message needs its content (only an assistant message that "
                "calls tools may leave it null)",
                "messages",
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
"""The arguments of a tool that gives no parameters: an empty object."""


class FunctionSpec(_Body):
    """A tool the model may call: OpenAI's `tools[].function`."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema; none: the tool takes no arguments."""
    strict: bool | None = None
    """Accepted: calls are always generated as OpenAI's strict mode generates them."""

    @model_validator(mode="after")
    def _object_parameters(self) -> FunctionSpec:
        """A call's arguments are a JSON object: parameters must say so (OpenAI's rule);
        empty ones (`{}`) are taken as no parameters."""
        if self.parameters and self.parameters.get("type") != "object":
            raise PyptoError(
                f"the parameters of tool {self.name!r} must be the JSON schema of an object "
                '({"type": "object", ...}): a call\'s arguments are a JSON object',
                "tools",
            )
        return self

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude_none=True)}

    def arguments_schema(self) -> dict[str, Any]:
        """The schema a call's arguments are generated to: the tool's, with objects taking no
        properties it does not name (what strict mode means; without it a model may go on
        inventing properties until max_tokens). Such arguments validate either way."""
        return closed_objects(self.parameters or NO_ARGUMENTS)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionSpec


class ToolName(_Body):
    name: str


class NamedToolChoice(_Body):
    """tool_choice naming one tool: the reply calls it."""

    type: Literal["function"]
    function: ToolName


Conversation = Annotated[list[ChatMessage], Field(fail_fast=True), BeforeValidator(_few_chat_items)]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[
        list[ChatMessage], Field(min_length=1, fail_fast=True), BeforeValidator(_few_chat_items)
    ]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens; null (and no max_tokens) means up to the context."""
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], Field(fail_fast=True, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: auto where there are tools, none where there are none (OpenAI's rule)."""
    parallel_tool_calls: bool | None = None
    """False: one call at most. Default true."""
    parse_special_tokens_in_content: bool = False
    """True (a trusted client's choice): control tokens written in the messages and tools
    (`<|im_end|>`) are control tokens; by default they are text (chat_prompt.py)."""
    add_generation_prompt: bool = True
    """vLLM's: end the prompt with the template's opening of an assistant reply."""
    continue_final_message: bool = False
    """vLLM's: leave the last message open, for the reply to continue it (a prefill of the
    reply); not with add_generation_prompt."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: more variables for the chat template (`{"enable_thinking": false}`)."""
    chat_template: Annotated[str, Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)] | None = None
    """vLLM's: a Jinja chat template for this request, in place of the model's; only where
    the server trusts its clients' templates (--trust-request-chat-template)."""
    add_special_tokens: bool = False
    """vLLM's: the tokenizer's special tokens (a BOS) added around what the template wrote."""
    echo: bool = False
    """vLLM's: the reply starts with the last message's content where that message has the
    reply's role (with continue_final_message: the whole continued message)."""
    reasoning_effort: str | None = None
    """OpenAI's: given to the chat template as `reasoning_effort` (as vLLM does), for the
    templates that read it (gpt-oss's, some thinking models')."""
    include_reasoning: bool = True
    """vLLM's: with a --reasoning-parser, the reply's thinking comes as its `reasoning`
    (false: it is left out)."""

    def tool_plan(self) -> ToolPlan | None:
        """What the reply may call, or None where it calls nothing (no tools, or none)."""
        tools = self.tools or []
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if not tools:
            if choice == "required" or isinstance(choice, NamedToolChoice):
                raise PyptoError("tool_choice requires tools, and none are given", "tool_choice")
            return None
        names = [t.function.name for t in tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PyptoError(f"two tools are named {quoted_names(twice)}", "tools")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise PyptoError(
                    f"tool_choice names {choice.function.name!r}, which is not among the tools",
                    "tool_choice",
                )
            allowed = [t.function for t in tools if t.function.name == choice.function.name]
        else:
            allowed = [t.function for t in tools]
        if self.structured() is not None:
            raise PyptoError(
                "give tools or a structured output (response_format, structured_outputs, "
                "guided_*), not both: each constrains the reply",
                "tools",
            )
        return ToolPlan(
            [t.function for t in tools],
            allowed,
            required=choice != "auto",
            parallel=self.parallel_tool_calls is not False,
        )

    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise PyptoError("give max_tokens or max_completion_tokens, not both", "max_tokens")
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise PyptoError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise PyptoError(
                "top_logprobs must be >= 0, or -1 (the whole vocabulary, where the server's "
                "max_logprobs allows it)",
                "top_logprobs",
            )
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)

    def template(self) -> ChatTemplateOptions:
        return template_options(self, self.add_special_tokens)

    def reply_role(self) -> str:
        """The role the reply is given: assistant, or the last message's own where the
        prompt opens no new message (vLLM's rule)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """What the reply starts with under `echo`: the last message's text where it has the
        reply's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role() else ""


TEMPLATE_PARAMETERS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Names chat_template_kwargs may not give: the renderer's own arguments, set by the request's
own fields."""


def template_options(
    body: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool
) -> ChatTemplateOptions:
    """A request's chat-template options, checked (vLLM's rules)."""
    kwargs = dict(body.chat_template_kwargs or {})
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    taken = sorted(TEMPLATE_PARAMETERS & kwargs.keys())
    if taken:
        raise PyptoError(
            f"chat_template_kwargs may not set {quoted_names(taken)}: give the request's "
            "own fields instead",
            "chat_template_kwargs",
        )
    return ChatTemplateOptions(
        body.add_generation_prompt,
        body.continue_final_message,
        kwargs,
        add_special_tokens,
        body.chat_template,
    )


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them."""
    return [m.for_template() for m in messages]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools: those shown to the model, those it may call, and how."""

    tools: list[FunctionSpec]
    allowed: list[FunctionSpec]
    required: bool
    """Only calls (tool_choice required, or a named tool); else text or calls (auto)."""
    parallel: bool


def quoted_names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def is_unicode(text: str) -> bool:
    """False for text with a lone surrogate (JSON's "\\ud800" escapes allow them), which no
    tokenizer can encode."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: Conversation | None = None
    tools: Annotated[list[Tool], Field(fail_fast=True, max_length=MAX_TOOLS)] | None = None
    """With messages: the tools the template shows."""
    add_special_tokens: bool | None = None
    """The tokenizer's special tokens (a BOS) added: by default for a prompt, not around a
    conversation's template (vLLM's defaults)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Annotated[str, Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)] | None = None
    """As chat's."""
    parse_special_tokens_in_content: bool = False
    """As chat's: control tokens written in the messages are text unless this is true."""
    return_token_strs: bool = False
    """vLLM's: each token's vocabulary string too (`token_strs`)."""

    def template(self) -> ChatTemplateOptions:
        return template_options(self, bool(self.add_special_tokens))


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


MAX_BATCH_CONVERSATIONS = 128
"""Most conversations one /v1/chat/completions/batch request may hold."""


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: the fields of a chat request, `messages` a list of
    conversations, each answered as its own request with the same parameters; not streamed,
    no tools, one choice per conversation."""

    messages: Annotated[  # type: ignore[assignment]
        list[
            Annotated[
                list[ChatMessage],
                Field(min_length=1, fail_fast=True),
                BeforeValidator(_few_chat_items),
            ]
        ],
        Field(min_length=1, max_length=MAX_BATCH_CONVERSATIONS, fail_fast=True),
    ]

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation (the fields are checked already)."""
        for name, given in (("stream", self.stream), ("tools", self.tools)):
            if given:
                raise PyptoError(f"a batch of conversations takes no {name}", name)
        if self.n != 1 or self.use_beam_search:
            param = "n" if self.n != 1 else "use_beam_search"
            raise PyptoError("a batch of conversations gets one reply each", param)
        fields = dict(self)
        return [
            ChatCompletionRequest.model_construct(
                self.model_fields_set, **(fields | {"messages": conversation})
            )
            for conversation in self.messages
        ]
