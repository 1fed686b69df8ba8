"""Constrained decoding: a request's structured output (a JSON schema, any JSON object, a
regular expression, a choice of strings or a Lark/GBNF grammar) is compiled by llguidance
into a matcher, which says before each step which tokens may come next, as a bitmask the
sampler applies, and advances with each token the request accepts.

Why llguidance (PyPI `llguidance`, the engine behind vLLM's `guidance` backend and
llama.cpp's `%llguidance`): one wheel with no dependencies (xgrammar 0.2.8 pulls triton,
apache-tvm-ffi and pydantic into a CPU install), a lexer built lazily (a matcher for a
nested schema over SmolLM2's 49,152 tokens is ready in under 1 ms), and JSON Schema coverage
with a clear error for the rest (docs/serving.md). Every grammar runs under `_limits()`
(llguidance's own: each token's lexer and parser work bounded), so no grammar costs a step
more than a bounded amount per constrained row.

A grammar's cost is its admission's, never the engine's:

    server (a grammar thread)             engine thread               mask thread
    check: the grammar's own errors
    Vocabulary.compiled: the matcher
      over the vocabulary, its first
      WALK_TOKENS walked (llguidance builds
      lexer and parser lazily: a costly
      grammar hits its limits here) -> 400
                    cached by the spec's text
                                          Grammars.matcher: a copy
                                          (cheap; the lexer shared)
                                          each step: its forward  ||  fill_masks (outside
                                                                      the GIL, counted as
                                                                      the step's progress)

`Request.append` advances the matcher. A request keeps its output tokens through preemption,
a swap or a prefix hit, so its matcher stays where its tokens are.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import StructuredOutputsParams

MAX_GRAMMAR_SYMBOLS = 50_000
"""llguidance's max_grammar_size, a tenth of its default."""
INITIAL_LEXER_FUEL = 200_000
"""llguidance's initial_lexer_fuel (the lexer's work before the first token), a fifth of its
default (sized for 3.5 MB schemas; ours are under 200,000 characters): a regex like
`a{1000}{1000}` is refused in 0.6 s, not 7 s (2 loaded cores). The rest of the limits are
llguidance's defaults: each token's lexer fuel 200,000 and parser items 50,000."""
WALK_TOKENS = 4
"""Tokens of a grammar's output walked when it is compiled (the lowest allowed token id each
time): where llguidance builds its lexer and parser, so where a costly grammar fails."""
ADMISSION_THREADS = 2
"""Threads compiling grammars for the server: a flood of costly grammars queues for these, and
holds up neither the tokenizer's threads (asyncio's default executor) nor the engine."""
ADMISSION = ThreadPoolExecutor(ADMISSION_THREADS, thread_name_prefix="pypto-grammar-admit")
COMPILED_CACHE = 128
"""Compiled grammars kept per model (the server compiles, the engine copies)."""
MASK_CHUNK = 32
"""Constrained rows whose masks are filled per call of llguidance's parallel fill: the step's
progress moves on after each."""
JSON_WHITESPACE = r"[ \t\n\r]{0,40}"
"""Whitespace JSON may hold between two of its tokens: enough for any indentation a model
writes, and bounded, so a model cannot stall in whitespace until max_tokens (small ones do)."""


@functools.cache
def _limits() -> Any:
    import llguidance

    # errors without the parser's state (it would echo the schema)
    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SYMBOLS,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        verbose_errors=False,
    )


def _limit_names() -> tuple[tuple[str, str], ...]:
    """(a fragment of llguidance's error, the limit it means) for each limit."""
    lim = _limits()
    fuel = f"{lim.initial_lexer_fuel:,} for the first token, {lim.step_lexer_fuel:,} for each"
    return (
        ("grammar size", f"max_grammar_size: {lim.max_grammar_size:,} symbols"),
        ("too many expressions", f"initial_lexer_fuel / step_lexer_fuel: {fuel}"),
        ("precomputation", f"initial_lexer_fuel: {lim.initial_lexer_fuel:,}"),
        ("too many states", f"max_lexer_states: {lim.max_lexer_states:,}"),
        ("too many items", f"step_max_items: {lim.step_max_items:,} parser items per token"),
        ("items; max is", f"max_items_in_row: {lim.max_items_in_row:,} items in a parser row"),
    )


def _choice_lark(choices: list[str]) -> str:
    """The strings as one lexeme (as llguidance compiles a JSON enum): a rule with an
    alternative per string puts all of them in one parser row, so more than max_items_in_row
    (2,000) fail once the first token is taken."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


@functools.lru_cache(maxsize=256)
def _grammar_text(key: str) -> str:
    import llguidance

    kind, value, whitespace = json.loads(key)
    options: Any = {  # llguidance's JsonCompileOptions
        "whitespace_flexible": whitespace,
        **({"whitespace_pattern": JSON_WHITESPACE} if whitespace else {}),
    }
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else value
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        if kind == "choice":
            return str(llguidance.grammar_from("lark", _choice_lark(value)))
        return str(llguidance.grammar_from("regex" if kind == "regex" else "grammar", value))
    except (ValueError, TypeError) as e:
        raise PyptoError(f"invalid {kind}: {e}", "structured_outputs") from e


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for the spec (cached by its text)."""
    return _grammar_text(spec.key())


def _short(error: str) -> str:
    said = " ".join(error.replace("<non-verbose/>", "").split()) or "unknown error"
    return said if len(said) <= 300 else said[:297] + "..."


def _refusal(error: str, forced: bool = False) -> PyptoError:
    """A 400 for llguidance's error, naming the limit where one was passed; forced: passed
    while following the text the grammar forces (one that never ends, or too long)."""
    limit = next((name for part, name in _limit_names() if part in error.lower()), None)
    if limit is None:
        return PyptoError(
            f"the structured output cannot be enforced: {_short(error)}", "structured_outputs"
        )
    what = (
        "forces a text that never ends (or too long to follow)"
        if forced
        else "is too costly to enforce"
    )
    return PyptoError(
        f"the structured output {what}: {_short(error)} (over llguidance's limit {limit}; "
        "docs/serving.md)",
        "structured_outputs",
    )


@functools.lru_cache(maxsize=256)
def _grammar_error(key: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(_grammar_text(key), None, limits=_limits()))


def check(spec: StructuredOutputsParams) -> None:
    """Raise PyptoError (a 400) naming what is wrong unless the spec compiles and every
    feature of it can be enforced (without the vocabulary: `Vocabulary.compiled` checks
    the rest; the verdict cached by the spec's text)."""
    error = _grammar_error(spec.key())
    if error:
        raise _refusal(error)


@dataclass(slots=True, frozen=True)
class Compiled:
    """A grammar compiled over a model's vocabulary, its first tokens walked."""

    matcher: Any
    """At its start: each request takes a copy (the lexer built so far is shared)."""
    empty_only: bool
    """It matches only the empty text: EOS is the one token it allows first."""


def _first_token(row: torch.Tensor, skip: list[int]) -> int | None:
    """The lowest token id a mask row allows, other than those in skip."""
    for word in row.nonzero().flatten().tolist():
        bits = int(row[word]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            token = word * 32 + low.bit_length() - 1
            if token not in skip:
                return token
            bits ^= low
    return None


class Vocabulary:
    """llguidance's view of one model's tokenizer, and the grammars compiled over it (one
    per model in a process: what the server's admission compiles, the engine copies)."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._tokenizer: Any = None
        self._reading = threading.Lock()  # the tokenizer (seconds, once)
        self._lock = threading.Lock()  # the cache (never held long: the event loop takes it)
        self._compiled: OrderedDict[str, Compiled | str] = OrderedDict()
        """Spec key -> its compiled grammar, or why it is refused."""

    def tokenizer(self) -> Any:
        """At least the model's vocabulary (a tokenizer with more tokens than the model's
        logits makes the masks that much wider); read on the first constrained request."""
        with self._reading:
            if self._tokenizer is None:
                import llguidance.hf

                from pypto_serving.models.loader import load_tokenizer

                hf = load_tokenizer(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, max(self.vocab_size, len(hf)))
            return self._tokenizer

    def cached(self, spec: StructuredOutputsParams) -> Compiled | None:
        """The spec compiled before (None where it was not), or PyptoError where it was
        refused."""
        key = spec.key()
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
        if isinstance(found, str):
            raise PyptoError(found, "structured_outputs")
        return found

    def compiled(self, spec: StructuredOutputsParams) -> Compiled:
        """`compile(spec)`, cached by the spec's text (refusals too)."""
        found = self.cached(spec)
        if found is not None:
            return found
        try:
            found = self.compile(spec)
        except PyptoError as e:
            self._keep(spec.key(), str(e))
            raise
        self._keep(spec.key(), found)
        return found

    def _keep(self, key: str, compiled: Compiled | str) -> None:
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)

    def compile(self, spec: StructuredOutputsParams) -> Compiled:
        """The spec's matcher over this vocabulary, or PyptoError (a 400) where it cannot be
        enforced, matches no text, or passes a limit in its first WALK_TOKENS tokens."""
        import llguidance

        check(spec)
        tokenizer = self.tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0, limits=_limits())
        if matcher.is_error():
            raise _refusal(matcher.get_error())
        return Compiled(matcher, self._walk(matcher.deep_copy(), list(tokenizer.eos_tokens)))

    def _walk(self, matcher: Any, eos: list[int]) -> bool:
        """Take up to WALK_TOKENS tokens (the lowest allowed each time); whether EOS alone was
        allowed at the start."""
        mask = torch.zeros(1, -(-self.tokenizer().vocab_size // 32), dtype=torch.int32)
        for step in range(WALK_TOKENS):
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if matcher.is_error():
                if step == 0 and "NoExtensionBias" in matcher.get_error():
                    raise PyptoError(
                        "the structured output matches no text at all", "structured_outputs"
                    )
                raise _refusal(matcher.get_error())
            token = _first_token(mask[0], eos)
            if token is None:  # complete: EOS alone may follow
                return step == 0
            if not matcher.consume_token(token):
                raise _refusal(matcher.get_error(), "ff_tokens" in matcher.get_error())
        return False


@functools.cache
def vocabulary(model_dir: Path, vocab_size: int) -> Vocabulary:
    """The process's Vocabulary of a model."""
    return Vocabulary(model_dir, vocab_size)


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor()


class Grammars:
    """Matchers over one model's vocabulary, and their masks (an engine's, or the server's
    admission)."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.vocabulary = vocabulary(model_dir, vocab_size)
        self.masks_filled = 0
        """Masks filled so far: moves on while a step waits for its masks (the watchdog's
        sign of life, with the layers done)."""

    def admit(self, spec: StructuredOutputsParams, min_tokens: int = 0) -> Compiled:
        """The spec compiled (cached), or PyptoError (a 400) where it cannot be enforced, is
        too costly, or matches only the empty text while min_tokens asks for more."""
        return self._fits(self.vocabulary.compiled(spec), min_tokens)

    def admitted(self, spec: StructuredOutputsParams, min_tokens: int = 0) -> bool:
        """Whether `admit` has nothing to compile (the spec was compiled before), raising
        as it would where the spec is refused."""
        compiled = self.vocabulary.cached(spec)
        return compiled is not None and self._fits(compiled, min_tokens) is compiled

    @staticmethod
    def _fits(compiled: Compiled, min_tokens: int) -> Compiled:
        if compiled.empty_only and min_tokens > 0:
            raise PyptoError(
                "the structured output matches only the empty text, so min_tokens "
                f"({min_tokens}) cannot be met",
                "structured_outputs",
            )
        return compiled

    def matcher(self, spec: StructuredOutputsParams, min_tokens: int = 0) -> Any:
        """A fresh matcher for spec, or PyptoError (a 400) as `admit`."""
        return self.admit(spec, min_tokens).matcher.deep_copy()

    def fill_draft_masks(self, matcher: Any, drafts: list[int]) -> torch.Tensor:
        """The matcher's masks (as `fill_masks`) at each row of a speculative step: before the
        drafts, after the first, ..., after all (len(drafts) + 1 rows), the matcher left as it
        was (its grammar accepts the drafts: `Speculator.draft` cut them where it did not)."""
        masks = self._empty(len(drafts) + 1)
        consumed = 0
        for i in range(len(drafts) + 1):
            self._fill([(matcher, i)], masks)
            if i < len(drafts):
                if not matcher.consume_token(drafts[i]):  # (never: the drafts were cut)
                    break
                consumed += 1
        matcher.rollback(consumed)
        return masks

    def _empty(self, rows: int) -> torch.Tensor:
        words = -(-self.vocabulary.tokenizer().vocab_size // 32)
        return torch.zeros(rows, words, dtype=torch.int32)

    def _fill(self, rows: list[tuple[Any, int]], masks: torch.Tensor) -> None:
        _executor().unsafe_compute_mask_ptr(
            rows, masks.data_ptr(), masks.shape[1] * 4, masks.shape[0]
        )
        self.masks_filled += len(rows)

    def fill_masks(self, matchers: list[Any]) -> torch.Tensor:
        """Each matcher's allowed next tokens, one row of int32 words (bit t % 32 of word
        t // 32 is token t), filled by llguidance's threads outside the GIL, MASK_CHUNK rows
        at a time (its own `fill_next_token_bitmask_par`, without importing llguidance.torch:
        that compiles a kernel with torch.compile); a matcher in error allows only EOS."""
        masks = self._empty(len(matchers))
        for lo in range(0, len(matchers), MASK_CHUNK):
            self._fill([(m, i) for i, m in enumerate(matchers[lo : lo + MASK_CHUNK], lo)], masks)
        return masks
