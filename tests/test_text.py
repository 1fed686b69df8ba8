"""Incremental detokenization: pieces never split a character, cost does not grow with output."""

from __future__ import annotations

from pypto_serving.engine.text import TextAssembler
from pypto_serving.models.loader import load_tokenizer
from pypto_serving.sampling import SamplingParams

TEXT = "héllo wörld — 東京 🚀🎉 the quick fox, ça va? 😀"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def test_multibyte_characters_are_never_split(tiny_model):
    tok = load_tokenizer(tiny_model("llama-gqa4-tied"))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # byte-level: most of these characters take several tokens
    counting = CountingTokenizer(tok)
    prompt = tok.encode("prompt:", add_special_tokens=False)
    text = TextAssembler(counting, prompt, SamplingParams())
    pieces = []
    for t in ids * 8:  # a long output
        text.add(t)
        pieces.append(text.take(final=False))
    pieces.append(text.take(final=True))
    assert "".join(pieces) == TEXT * 8
    assert not any("\ufffd" in p for p in pieces)
    assert max(counting.lengths) <= 16  # a short window, however long the output


def test_stop_string_split_across_tokens_is_held_back(tiny_model):
    tok = load_tokenizer(tiny_model("llama-gqa4-tied"))
    ids = tok.encode("the quick brown fox jumps", add_special_tokens=False)
    text = TextAssembler(tok, [], SamplingParams(stop=["brown fox"]))
    released = ""
    for t in ids:
        text.add(t)
        released += text.take(final=False)
        if text.stopped:
            break
    released += text.take(final=True)
    assert text.stopped and released == "the quick "
