"""The offline API, familiar to vLLM users: `LLM(model).generate(prompts, SamplingParams())`."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self, cast

from tqdm import tqdm

from pypto_serving.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pypto_serving.chat_prompt import ChatTemplateOptions, chat_token_ids
from pypto_serving.config import engine_config
from pypto_serving.engine.core import EngineCore
from pypto_serving.engine.dp import DPEngine
from pypto_serving.engine.memory_budget import with_kv_budget
from pypto_serving.engine.text import TextAssembler
from pypto_serving.errors import PyptoError, RequestFailedError, RequestRejectedError
from pypto_serving.kv.handoff import Handoff
from pypto_serving.models.chat_defaults import chat_template_text, generation_defaults
from pypto_serving.models.config import load_model_config
from pypto_serving.models.default_model import resolve_model_path
from pypto_serving.models.loader import load_tokenizer
from pypto_serving.ops.sampler import Sampled
from pypto_serving.outputs import (
    CompletionDelta,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from pypto_serving.pooling import PoolingParams, model_pooling
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

Prompt = str | list[int]


log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Family:
    """A user request and its n sampled sequences (child requests)."""

    request_id: str
    prompt: str | None
    children: list[Request]
    texts: list[TextAssembler]
    pending: list[Request] = field(default_factory=list)
    """Samples 2..n wait until sample 1 has computed the prompt, then share its cached pages."""
    sent: list[int] = field(default_factory=list)
    """Per sample: output tokens already handed out by take_deltas(); -1 once finished."""
    prompt_logprobs_sent: bool = False

    def prompt_logprobs(self) -> list[Sampled | None] | None:
        """Each prompt token's logprob (None for the first), once the whole prompt is scored
        (by the first sample); None where they were not asked for or are not ready."""
        first = self.children[0]
        if first.params.prompt_logprobs is None:
            return None
        if len(first.prompt_logprobs) < len(first.prompt_token_ids) - 1:
            return None
        return [None, *first.prompt_logprobs]

    def take_prompt_logprobs(self) -> list[Sampled | None] | None:
        """prompt_logprobs() the first time they are ready, else None."""
        if self.prompt_logprobs_sent:
            return None
        out = self.prompt_logprobs()
        self.prompt_logprobs_sent = out is not None
        return out

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    @property
    def error(self) -> str | None:
        """Why the request was lost to a fault of the engine, or stopped by its own
        constraints (None: neither)."""
        return next((c.error for c in self.children if c.error is not None), None)

    def failure(self) -> RequestFailedError | RequestRejectedError:
        """The error of a failed family: its first failed sample's (`Request.failure`)."""
        return next(c for c in self.children if c.error is not None).failure()

    def take_deltas(self) -> list[CompletionDelta]:
        """What each sample produced since the previous call (samples with news only)."""
        deltas = []
        for i, (c, t) in enumerate(zip(self.children, self.texts, strict=True)):
            sent = self.sent[i]
            if sent < 0:
                continue
            text = t.take(final=c.finished)
            if not (text or c.finished or len(c.output_token_ids) > sent):
                continue
            logprobs = c.output_logprobs[sent:] if c.params.logprobs is not None else None
            deltas.append(
                CompletionDelta(i, text, c.output_token_ids[sent:], logprobs, c.finish_reason)
            )
            self.sent[i] = -1 if c.finished else len(c.output_token_ids)
        return deltas

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                i,
                t.text,
                list(c.output_token_ids),
                c.finish_reason,
                list(c.output_logprobs) if c.params.logprobs is not None else None,
            )
            for i, (c, t) in enumerate(zip(self.children, self.texts, strict=True))
        ]
        first = self.children[0]
        return RequestOutput(
            self.request_id,
            self.prompt,
            first.prompt_token_ids,
            outs,
            first.num_cached_tokens,
            self.finished,
            dict(first.cached_tokens_by_tier),
            self.prompt_logprobs(),
        )


def as_batch(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
    """One prompt (text or token ids) as a batch of one; a batch as it is."""
    one = isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))
    return [cast(Prompt, prompts)] if one else cast(Sequence[Prompt], prompts)


def next_token_scores(out: RequestOutput) -> Sampled:
    """The scores of the one token a beam-search query generated."""
    logprobs = out.outputs[0].logprobs
    assert logprobs, "a beam-search query asks for logprobs"
    return logprobs[0]


def child_id(request_id: str, i: int) -> str:
    """The engine's id of sample `i` of request `request_id` (one engine request each)."""
    return f"{request_id}-{i}"


class LLM:
    """Load a model once; generate for many prompts with continuous batching."""

    def __init__(self, model: str = "default", **knobs: Any) -> None:
        config = engine_config(model=model, **knobs)
        self.model_dir = resolve_model_path(config.model)
        # config errors first, before the tokenizer's or any process
        load_model_config(self.model_dir).check_max_model_len(config.max_model_len)
        config = with_kv_budget(config, self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        if config.chat_template is not None:
            self.tokenizer.chat_template = chat_template_text(config.chat_template)
        self.generation_defaults = generation_defaults(config.generation_config, self.model_dir)
        """Sampling defaults of requests that leave them out (--generation-config)."""
        declared = model_pooling(self.model_dir)
        self.pooling_rule = (
            None
            if config.runner == "generate"
            else declared or ("last" if config.runner == "pooling" else None)
        )
        """How embed() pools (the model's declared rule, or last under runner pooling); None:
        this model does not embed."""
        if self.generation_defaults:
            log.info(
                "the model's generation config sets %s for requests that leave them out "
                "(--generation-config vllm: none)",
                ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items()),
            )
        self.engine: EngineCore | DPEngine
        if config.parallel.data_parallel_size > 1:
            self.engine = DPEngine(config, self.model_dir)
        else:
            self.engine = EngineCore(config, self.model_dir)
        self._ids = itertools.count()
        self._families: dict[str, tuple[_Family, int]] = {}
        # an LLM garbage collected unclosed closes its engine too (not at exit: the child
        # processes exit with this one), so the next multi-rank engine here can start
        self._finalizer = weakref.finalize(self, self.engine.close)
        self._finalizer.atexit = False

    def close(self) -> None:
        """Finish background work (the SSD tier's queued writes), stop the engine's processes
        and threads and leave its process group. Also done when the LLM is garbage collected
        (the SSD tier's writes alone also at exit)."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's embedding (pooling.py), in order."""
        batch = as_batch(prompts)
        params = self.pooling_params(pooling_params)
        out = []
        for i, prompt in enumerate(batch):
            ids = self.encode(prompt)
            embedding = self.engine.embed(ids, params)
            out.append(EmbeddingRequestOutput(str(i), ids, EmbeddingOutput(embedding)))
        return out

    def pooling_params(self, given: PoolingParams | None) -> PoolingParams:
        """`given` with the model's pooling rule where it names none; an error where this
        model does not embed."""
        if self.pooling_rule is None:
            raise PyptoError(
                "this model does not embed: its directory declares no sentence-transformers "
                "pooling config; load it with runner 'pooling' (vLLM's --runner pooling) to "
                "embed with its last token's hidden state",
                "runner",
            )
        return (given or PoolingParams()).resolved(self.pooling_rule)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the generation config's defaults (--generation-config),
        what generate() uses when given none."""
        return SamplingParams(**self.generation_defaults)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's own chat template (or
        `chat_template`), vLLM's options as transformers takes them; control tokens written in
        the messages are control tokens (the caller is trusted, as vLLM's LLM.chat takes it)."""
        options = ChatTemplateOptions(
            add_generation_prompt, continue_final_message, dict(chat_template_kwargs or {})
        )
        return chat_token_ids(
            self.tokenizer, messages, options, tools, chat_template, parse_special=True
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, each rendered
        with the chat template (`chat_prompt`) and generated for; outputs in order."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        prompts = [
            self.chat_prompt(
                cast(list[dict[str, Any]], c),
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template,
                chat_template_kwargs,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def add(
        self,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        export_kv: bool = False,
        handoff: Handoff | None = None,
    ) -> _Family:
        """Queue one prompt (n child sequences); returns its handle. Requests share cached
        prefix pages only with requests of the same `cache_salt`. Disaggregated serving (one
        sample only): `export_kv`, a prefill server's request, ends at its first token and
        hands its KV off (`Request.handoff`); `handoff`, a decode server's, goes on from
        what a prefill server handed off."""
        if (export_kv or handoff is not None) and params.n != 1:
            raise PyptoError("a request handed between prefill and decode servers takes n=1", "n")
        if export_kv:  # its first token ends it: the decode server makes the rest
            params = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        seq = next(self._ids)
        rid = request_id if request_id is not None else str(seq)
        ids = self.encode(prompt)
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=self.word_tokens(params.bad_words))
        eos = self.engine.model_config.eos_token_ids
        family = _Family(rid, prompt if isinstance(prompt, str) else None, [], [])
        arrived = time.monotonic() if arrival_time is None else arrival_time
        for i in range(params.n):
            child = params if params.seed is None else replace(params, seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None:  # the first sample scores it
                child = replace(child, prompt_logprobs=None)
            req = Request(
                child_id(rid, i), ids, child, eos, priority, seq, arrived, cache_salt=cache_salt
            )
            req.export_kv, req.handoff = export_kv, handoff
            family.children.append(req)
            family.texts.append(TextAssembler(self.tokenizer, ids, params))
            family.sent.append(0)
        share = params.n > 1 and self.engine.config.cache.enable_prefix_caching
        family.pending = family.children[1:] if share else []
        for i, req in enumerate(family.children):  # add_request checks; raises before any is kept
            if req not in family.pending:
                self.engine.add_request(req)
            self._families[req.request_id] = (family, i)
        return family

    def word_tokens(self, words: list[str]) -> list[list[int]]:
        """Each word's token sequences: alone and after a space (at the text's start, or
        inside it), each once."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort(self, family: _Family) -> None:
        """Stop every sample of a request at whatever stage it is; all it held is freed."""
        ids = [c.request_id for c in family.children]
        self.engine.abort(ids)
        for child in family.pending:
            child.finish("abort")
        family.pending = []
        for rid in ids:
            self._families.pop(rid, None)

    def step(self) -> list[_Family]:
        """One engine step; returns the families that changed. A family with an `error` lost
        a sample to a fault of the engine; its other samples are aborted."""
        changed: dict[str, _Family] = {}
        for req in self.engine.step():
            if req.request_id not in self._families:
                continue  # its family failed earlier in this step
            family, i = self._families[req.request_id]
            if req.error is not None:
                self.abort(family)
                changed[family.request_id] = family
                continue
            text = family.texts[i]
            for token in req.output_token_ids[text.num_tokens :]:  # a handoff's first too
                text.add(token)
                if text.stopped:
                    break
            if text.stopped:  # tokens one step kept past the stop string (drafts) go
                del req.output_token_ids[text.num_tokens :]
                del req.output_logprobs[text.num_tokens :]
            if text.stopped and not req.finished:
                self.engine.abort([req.request_id], reason="stop")
            if req.finished:
                del self._families[req.request_id]
            changed[family.request_id] = family
            if family.pending and (req.output_token_ids or req.finished):
                for sibling in family.pending:
                    self.engine.add_request(sibling)
                family.pending = []
        return list(changed.values())

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order.

        `priority`: one per prompt, lower runs first (default: first come, first served)."""
        batch = as_batch(prompts)
        params = sampling_params or self.get_default_sampling_params()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        prios = list(priority) if priority is not None else [0] * len(batch)
        families = [self.add(p, sp, pr) for p, sp, pr in zip(batch, plist, prios, strict=True)]
        bar = tqdm(total=len(families), desc="generate", disable=not use_tqdm or len(families) < 2)
        while self.engine.has_unfinished():
            changed = self.step()
            if failed := next((f for f in changed if f.error is not None), None):
                for f in families:
                    self.abort(f)
                raise failed.failure()
            bar.update(sum(f.finished for f in changed))
        bar.close()
        return [f.output() for f in families]

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (beam_search.py, HF's algorithm): each prompt's best
        `beam_width` beams, best first. Every step scores all the prompts' running beams in
        one batch."""
        batch = as_batch(prompts)
        eos = frozenset(self.engine.model_config.eos_token_ids)
        searches = [BeamSearch(self.encode(p), params, eos) for p in batch]
        for search in searches:  # fits the context to the last step, before any runs
            self.engine.check(search.prompt, SamplingParams(max_tokens=params.max_tokens))
        while live := [s for s in searches if not s.done]:
            queries = [q for s in live for q in s.queries()]
            outs = self.generate(queries, live[0].step_params(), use_tqdm=False)
            scored = iter([next_token_scores(o) for o in outs])
            for search in live:
                search.advance([next(scored) for _ in search.running])
        return [BeamSearchOutput(s.best(self.tokenizer)) for s in searches]

    def stream(self, prompt: Prompt, params: SamplingParams) -> Generator[str, None, RequestOutput]:
        """Text of a single sequence (n=1), piece by piece as tokens are produced; the
        generator's return value (StopIteration's) is the request's output. Closed early (a
        reader that stops), it aborts the request: nothing is left running."""
        family = self.add(prompt, replace(params, n=1))
        text, req = family.texts[0], family.children[0]
        try:
            while not req.finished:
                self.step()
                if req.error is not None:
                    raise req.failure()
                if piece := text.take(final=req.finished):
                    yield piece
        finally:
            if not req.finished:
                self.abort(family)
        return family.output()
