"""Constrained decoding: a request's structured output (a JSON schema, any JSON object, a
regular expression, a choice of strings or a Lark/GBNF grammar) is compiled by llguidance
into a matcher, which says before each step which tokens may come next, as a bitmask the
sampler applies, and advances with each token the request accepts.

Why llguidance (PyPI `llguidance`, the engine behind vLLM's `guidance` backend and
llama.cpp's `%llguidance`): one wheel with no dependencies (xgrammar 0.2.8 pulls triton,
apache-tvm-ffi and pydantic into a CPU install), a lexer built lazily (a matcher for a
nested schema over SmolLM2's 49,152 tokens is ready in under 1 ms, so compiling never
stalls a step), and JSON Schema coverage with a clear error for the rest (docs/serving.md).
Every grammar runs under `LIMITS`: work past them is an error naming the limit, never a
stall of the step.

What runs where: `check` (no tokenizer: the grammar's own errors) when a request is
checked, so a bad one is a 400 before it is queued; `Grammars.matcher` (the tokenizer's
vocabulary, made on the first constrained request: free requests pay nothing) when the
engine takes it; `fill_masks` in the executor, in a thread while the step's forward runs;
`Request.append` advances the matcher. A request keeps its output tokens through preemption,
a swap or a prefix hit, so its matcher stays where its tokens are.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import StructuredOutputsParams


@functools.cache
def _limits() -> Any:
    import llguidance

    # llguidance's defaults (each step's lexer and parser work bounded) but the grammar's
    # size, a tenth; errors without the parser's state (it would echo the schema)
    return llguidance.LLParserLimits(max_grammar_size=50_000, verbose_errors=False)


JSON_WHITESPACE = r"[ \t\n\r]{0,40}"
"""Whitespace JSON may hold between two of its tokens: enough for any indentation a model
writes, and bounded, so a model cannot stall in whitespace until max_tokens (small ones do)."""
LIMITS_TEXT = (
    "grammars are limited to 50,000 symbols, and each step's lexing and parsing to "
    "llguidance's default work limits"
)


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
            return str(llguidance.grammar_from("choice", json.dumps(value)))
        return str(llguidance.grammar_from("regex" if kind == "regex" else "grammar", value))
    except (ValueError, TypeError) as e:
        raise PyptoError(f"invalid {kind}: {e}", "structured_outputs") from e


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for the spec (cached by its text)."""
    return _grammar_text(spec.key())


def _refusal(error: str) -> PyptoError:
    said = " ".join(error.split()) or "unknown error"
    said = said if len(said) <= 300 else said[:297] + "..."
    limit = f" (limits: {LIMITS_TEXT})" if "limit" in error.lower() else ""
    return PyptoError(
        f"the structured output cannot be enforced: {said}{limit}", "structured_outputs"
    )


@functools.lru_cache(maxsize=256)
def _grammar_error(key: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(_grammar_text(key), None, limits=_limits()))


def check(spec: StructuredOutputsParams) -> None:
    """Raise PyptoError (a 400) naming what is wrong unless the spec compiles and every
    feature of it can be enforced (the verdict cached by the spec's text: the server, the
    engine's check and its matcher each ask)."""
    error = _grammar_error(spec.key())
    if error:
        raise _refusal(error)


class Grammars:
    """Matchers over one model's vocabulary (its tokenizer read once, on first use), and their
    masks."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer: at least the model's vocabulary (a tokenizer
        with more tokens than the model's logits makes the masks that much wider)."""
        if self._tokenizer is None:
            import llguidance.hf

            from pypto_serving.models.loader import load_tokenizer

            hf = load_tokenizer(self.model_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(hf, max(self.vocab_size, len(hf)))
        return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for spec, or PyptoError (a 400) where it cannot be enforced."""
        import llguidance

        check(spec)
        matcher = llguidance.LLMatcher(
            self.tokenizer(), grammar_text(spec), log_level=0, limits=_limits()
        )
        if matcher.is_error():
            raise _refusal(matcher.get_error())
        return matcher

    def fill_masks(self, matchers: list[Any]) -> torch.Tensor:
        """Each matcher's allowed next tokens, one row of int32 words (bit t % 32 of word
        t // 32 is token t); a matcher in error allows only EOS (llguidance's rule)."""
        import llguidance.torch

        words = -(-self.tokenizer().vocab_size // 32)
        masks = torch.zeros(len(matchers), words, dtype=torch.int32)
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, masks, i)
        return masks
