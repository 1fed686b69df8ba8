"""Logprobs in OpenAI's shapes, every token named after its own bytes.

A byte-level BPE token (GPT-2's byte alphabet: SmolLM2, Llama 3, Qwen) or a SentencePiece
byte-fallback token (`<0xE2>`) may hold part of a UTF-8 character; decoded alone it is
U+FFFD, the same for all of them. So tokens are never named by their decoded text:
- a token's bytes (chat's `bytes`) are read from the vocabulary, not from decoded text;
- its name (`token`, completions' `tokens` and the keys of its `top_logprobs`) is its text
  when its bytes are valid UTF-8, else `bytes:` and the bytes as `\\xNN` escapes (OpenAI's
  form: `bytes:\\xe2\\x80`);
- in one position's `top_logprobs` dict a token whose name an earlier entry took already (two
  vocabulary entries with the same bytes) is keyed `token_id:<id>` (vLLM's form of
  --return-tokens-as-token-ids), so distinct tokens are never merged and the dict holds as
  many entries as were asked for. Completions' dicts hold the sampled token first (so it
  keeps its name), then the k most likely.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

from pypto_serving.ops.sampler import Sampled

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPIECE_SPACE = "\u2581"
"""SentencePiece's stand-in for a space ("▁")."""


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte -> the
    byte. Printable Latin-1 bytes stand for themselves; the other 68 map to U+0100 onwards."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + n
    return {chr(c): b for b, c in chars.items()}


BYTE_OF = byte_alphabet()


def vocab_kind(tokenizer: Any) -> str:
    """How the vocabulary spells bytes: "byte_level" (GPT-2), "sentencepiece" (▁ for spaces,
    `<0xNN>` byte fallback) or "text" (unknown: a token's bytes are its decoded text)."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # a slow tokenizer, or one without a decoder
        return "text"
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    return "text"


class TokenBytes:
    """token id -> the token's own bytes (cached; at most one entry per vocabulary entry)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = vocab_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._cache: dict[int, bytes] = {i: t.content.encode() for i, t in added.items()}

    def __call__(self, token_id: int) -> bytes:
        data = self._cache.get(token_id)
        if data is None:
            data = self._cache[token_id] = self._read(token_id)
        return data

    def _read(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self.kind == "byte_level":
            if all(c in BYTE_OF for c in piece):
                return bytes(BYTE_OF[c] for c in piece)
        elif isinstance(piece, str) and self.kind == "sentencepiece":
            if m := BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(m[1], 16)])
            return piece.replace(SPIECE_SPACE, " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def name(self, token_id: int) -> str:
        """The token's text, or `bytes:\\xNN...` when its bytes are not valid UTF-8."""
        data = self(token_id)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def top_names(self, top: dict[int, float]) -> dict[int, str]:
        """A distinct name for each token of one position's top logprobs (most likely first):
        a name already taken gives way to `token_id:<id>`."""
        names: dict[int, str] = {}
        taken: set[str] = set()
        for token_id in top:
            name = self.name(token_id)
            if name in taken:
                name = f"token_id:{token_id}"
            names[token_id] = name
            taken.add(name)
        return names


class TokenIdNames(TokenBytes):
    """TokenBytes that name every token `token_id:<id>` (vLLM's return_tokens_as_token_ids:
    a client reads the ids back exactly, whatever the token's bytes)."""

    def __init__(self, named: TokenBytes) -> None:
        self.tokenizer, self.kind, self._cache = named.tokenizer, named.kind, named._cache

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}"


class TextOffsets:
    """Completions' `text_offset`: where each token's text starts in the generated text, in
    characters. A token holding part of a character starts where that character will."""

    def __init__(self) -> None:
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, data: bytes) -> int:
        at = self.offset
        self.offset += len(self._decoder.decode(data))
        return at

    def copy(self) -> TextOffsets:
        """Offsets that go on from here independently (each choice after a shared echo)."""
        out = TextOffsets()
        out.offset = self.offset
        out._decoder.setstate(self._decoder.getstate())
        return out


def completion_logprobs(
    names: TokenBytes, logprobs: list[Sampled] | None, offsets: TextOffsets
) -> dict[str, Any] | None:
    """/v1/completions' `logprobs` for these sampled tokens (None when not asked for)."""
    if logprobs is None:
        return None
    tokens, tops, at = [], [], []
    for s in logprobs:
        # the sampled token first, then the top ones (vLLM's and OpenAI's: logprobs=k gives
        # up to k+1 entries, the sampled token's always among them)
        shown = {s.token_id: s.logprob, **(s.top_logprobs or {})}
        top = names.top_names(shown)
        tokens.append(top[s.token_id])
        tops.append({top[t]: lp for t, lp in shown.items()})
        at.append(offsets.next(names(s.token_id)))
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in logprobs],
        "top_logprobs": tops,
        "text_offset": at,
    }


def chat_logprobs(names: TokenBytes, logprobs: list[Sampled] | None) -> dict[str, Any] | None:
    """/v1/chat/completions' `logprobs` for these sampled tokens (None when not asked for)."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": names.name(token_id), "logprob": logprob, "bytes": list(names(token_id))}

    return {
        "content": [
            {
                **entry(s.token_id, s.logprob),
                "top_logprobs": [entry(t, lp) for t, lp in (s.top_logprobs or {}).items()],
            }
            for s in logprobs
        ]
    }


def echo_logprobs(
    names: TokenBytes,
    prompt_ids: list[int],
    scored: list[Sampled | None],
    k: int,
    offsets: TextOffsets,
) -> dict[str, Any]:
    """/v1/completions' `logprobs` of an echoed prompt: its first token has none (nothing
    predicts it), each other its logprob and k top logprobs."""
    head = {
        "tokens": [names.name(prompt_ids[0])],
        "token_logprobs": [None],
        "top_logprobs": [None],
        "text_offset": [offsets.next(names(prompt_ids[0]))],
    }
    rest = [
        Sampled(s.token_id, s.logprob, dict(list((s.top_logprobs or {}).items())[:k]))
        for s in scored[1:]
        if s is not None
    ]
    tail = completion_logprobs(names, rest, offsets)
    assert tail is not None
    return {key: head[key] + tail[key] for key in head}


def vllm_prompt_logprobs(
    names: TokenBytes, scored: list[Sampled | None] | None, k: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else the token and the
    k top ones (the prompt may have been scored with more, for an echo), keyed by token id:
    {"logprob", "rank", "decoded_token"}."""
    if scored is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for s in scored:
        if s is None:
            out.append(None)
            continue
        entry = {
            str(s.token_id): {
                "logprob": s.logprob,
                "rank": s.rank,
                "decoded_token": names.name(s.token_id),
            }
        }
        top = list((s.top_logprobs or {}).items())[:k]
        for rank, (t, lp) in enumerate(top, 1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": names.name(t)})
        out.append(entry)
    return out
