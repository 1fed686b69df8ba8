"""Logprobs name every token by its own bytes: tokens holding part of a UTF-8 character
(byte-level BPE, SentencePiece byte fallback) decode alone to U+FFFD, and were merged in
completions' top_logprobs (fewer entries than asked for) and given chat `bytes` [239, 191, 189].

Ground truth for the byte-level vocabularies is transformers' own `bytes_to_unicode`.
"""

from __future__ import annotations

import httpx
import pytest
from live_server import serving, tiny_llm
from patience import patience
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pypto_serving.ops.sampler import Sampled
from pypto_serving.server.logprobs import TextOffsets, TokenBytes, completion_logprobs

MODEL = "llama-gqa4-tied"
BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def true_bytes(tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's bytes, from the vocabulary (added tokens: their content)."""
    added = tokenizer.added_tokens_decoder
    if token_id in added:
        return added[token_id].content.encode()
    return bytes(BYTE_OF[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def expected_name(tokenizer, token_id: int) -> str:
    return name_of(true_bytes(tokenizer, token_id))


def name_of(data: bytes) -> str:
    """A token's name: its text, or OpenAI's `bytes:\\xNN...` when not valid UTF-8."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def check_vocabulary(tokenizer) -> int:
    """Every token's bytes are its vocabulary bytes, names are distinct, and a token whose
    bytes are text is named by its decoded text. Returns how many tokens are partial."""
    names = TokenBytes(tokenizer)
    assert names.kind == "byte_level"
    seen: dict[str, int] = {}
    partial = 0
    for i in range(len(tokenizer)):
        assert names(i) == true_bytes(tokenizer, i)
        name = names.name(i)
        assert name not in seen, (i, seen.get(name), name)
        seen[name] = i
        if name.startswith("bytes:"):
            partial += 1
            assert "\ufffd" in tokenizer.decode([i])
        else:
            assert name == tokenizer.decode([i])
    return partial


def test_tiny_byte_level_vocabulary_names_every_token_apart(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model(MODEL))
    assert check_vocabulary(tokenizer) > 60  # bytes 0x80-0xff on their own


def test_default_model_vocabulary_names_every_token_apart():
    """SmolLM2's 49,152 tokens: 265 decode alone to U+FFFD; all get distinct names."""
    from pypto_serving.models.default_model import resolve_model_path
    from pypto_serving.models.loader import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path("default"))
    assert check_vocabulary(tokenizer) > 200


def test_sentencepiece_byte_fallback_tokens_are_their_byte():
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"\u2581": 259, "a": 260, "\u2581a": 261, "é": 262}
    backend = Tokenizer(BPE(vocab, [("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    names = TokenBytes(tokenizer)
    assert names.kind == "sentencepiece"
    assert names(3 + 0xE2) == b"\xe2" and names.name(3 + 0xE2) == "bytes:\\xe2"
    assert names(261) == b" a" and names.name(261) == " a"
    assert names(262) == "é".encode() and names(3 + ord("a")) == b"a"
    # "<0x61>" and "a" are the same bytes: in one top_logprobs dict they stay apart; the
    # sampled token comes first (vLLM's order) and keeps its name
    top = {260: -0.5, 3 + ord("a"): -1.0, 3 + 0xE2: -2.0, 3 + 0xE3: -3.0}
    out = completion_logprobs(names, [Sampled(3 + ord("a"), -1.0, top)], TextOffsets())
    assert out["top_logprobs"] == [
        {"a": -1.0, "token_id:260": -0.5, "bytes:\\xe2": -2.0, "bytes:\\xe3": -3.0}
    ]
    assert out["tokens"] == ["a"]  # the key it has in top_logprobs


def test_text_offsets_count_characters_of_the_text():
    """A token holding part of a character starts where the character does."""
    offsets = TextOffsets()
    pieces = ["，".encode(), b"\xe9\x80", b"\x82", b" ok"]
    assert [offsets.next(p) for p in pieces] == [0, 1, 1, 2]


@pytest.fixture(scope="module")
def live(tiny_model):
    with serving(tiny_llm(tiny_model(MODEL))) as server:
        yield server


def prompt(i: int) -> list[int]:
    return [(11 * i + 5 * j) % 300 + 10 for j in range(4 + i % 5)]


def test_completions_top_logprobs_hold_as_many_tokens_as_asked(live):
    """A random tiny model puts many of its ~128 partial-byte tokens among its top 20."""
    tokenizer = live.llm.tokenizer
    partial_seen = 0
    for i in range(4):
        body = {"prompt": prompt(i), "max_tokens": 8, "temperature": 0, "logprobs": 20}
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=patience(60))
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        for top in lp["top_logprobs"]:
            assert len(top) == 20
            partial_seen += sum(k.startswith("bytes:") for k in top)
        ids = live.llm.generate([prompt(i)], live_params(8), use_tqdm=False)[0].outputs[0]
        assert lp["tokens"] == [expected_name(tokenizer, t) for t in ids.token_ids]
        assert all(lp["tokens"][k] in top for k, top in enumerate(lp["top_logprobs"]))
    assert partial_seen > 0


def live_params(max_tokens: int):
    from pypto_serving.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=20)


def test_chat_bytes_are_the_tokens_own_bytes(live):
    tokenizer = live.llm.tokenizer
    body = {
        "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
    }
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=patience(60))
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    by_name = {expected_name(tokenizer, i): i for i in range(len(tokenizer))}
    assert len(by_name) == len(tokenizer)
    partial = 0
    for entry in [*content, *(t for c in content for t in c["top_logprobs"])]:
        assert entry["bytes"] == list(true_bytes(tokenizer, by_name[entry["token"]]))
        partial += entry["token"].startswith("bytes:")
    assert partial > 0
    names = [{t["token"] for t in c["top_logprobs"]} for c in content]
    assert all(len(n) == 20 for n in names)
