"""Bad requests, table-driven: every kind x both generation endpoints x stream on/off.

Each must get a 4xx in OpenAI's error shape, at most 2 KB whatever the request's size, with
no file paths or stack traces; afterwards the server is healthy and still answers. "stream"
is set in the body wherever the body can carry it (not in an empty, null or number body).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from live_server import Live, serving, tiny_llm
from patience import patience

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"
CONTEXT = 64
"""max_model_len of the server: "over the context" cases stay cheap."""
BODY_LIMIT = 64 << 10
"""max_request_bytes of the server: the oversized cases are just over it."""
MAX_ERROR_BYTES = 2048
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
JSON_HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def live(tiny_model: Callable[[str], Any]) -> Iterator[Live]:
    llm = tiny_llm(tiny_model(MODEL), max_model_len=CONTEXT)
    with serving(llm, max_request_bytes=BODY_LIMIT) as server:
        yield server


@pytest.fixture(
    scope="module",
    params=[(e, s) for e in PATHS for s in (False, True)],
    ids=[f"{e}-{'stream' if s else 'nostream'}" for e in PATHS for s in (False, True)],
)
def group(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """(endpoint, stream): pytest runs every test of one group before the next group."""
    return request.param


# --- building requests ----------------------------------------------------------------------


def base(endpoint: str) -> dict[str, Any]:
    """A valid request body for the endpoint."""
    if endpoint == "completions":
        return {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


Body = bytes | Callable[[], Iterator[bytes]]


def dump(body: Any) -> bytes:
    """Compact JSON; NaN and Infinity come out as the (non-standard) literals."""
    return json.dumps(body, separators=(",", ":")).encode()


def patch(
    common: dict[str, Any] | None = None,
    *,
    completions: dict[str, Any] | None = None,
    chat: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> Callable[[str, bool], bytes]:
    """The valid body with `drop` removed and the fields given (common, then per endpoint)."""

    def build(endpoint: str, stream: bool) -> bytes:
        body = {k: v for k, v in base(endpoint).items() if k not in drop} | {"stream": stream}
        body |= common or {}
        body |= (completions if endpoint == "completions" else chat) or {}
        return dump(body)

    return build


def stream_field(stream: bool) -> str:
    return f'"stream": {json.dumps(stream)}'


def input_field(endpoint: str) -> str:
    """The valid body's prompt or messages as JSON text."""
    key = "prompt" if endpoint == "completions" else "messages"
    return f'"{key}": {json.dumps(base(endpoint)[key])}'


def garbage(size: int, seed: int = 0) -> str:
    """Printable ASCII that JSON keeps as is (no quotes, no backslashes)."""
    alphabet = string.ascii_letters + string.digits + "!#$%&'()*+,-./:;<=>?@[]^_`{|}~ "
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(size))


def in_chunks(build: Callable[[str, bool], bytes]) -> Callable[[str, bool], Body]:
    """The same body sent chunked (no Content-Length), 4 KiB at a time."""

    def chunked(endpoint: str, stream: bool) -> Callable[[], Iterator[bytes]]:
        data = build(endpoint, stream)
        return lambda: (data[i : i + 4096] for i in range(0, len(data), 4096))

    return chunked


def shortened(prefix: str) -> Callable[[str | None], bool]:
    """An expected param: a huge name comes back cut short."""
    return lambda p: p is not None and p.startswith(prefix) and p.endswith("...") and len(p) <= 200


@dataclass(frozen=True)
class Bad:
    name: str
    build: Callable[[str, bool], Body]
    param: Any = None
    """The error's param: a value, {endpoint: value}, or a predicate."""
    code: Any = "invalid_value"
    """The error's code: a value or {endpoint: value}."""
    status: int = 400
    headers: dict[str, str] = field(default_factory=lambda: JSON_HEADERS)

    def expected(self, endpoint: str) -> tuple[Any, Any]:
        """(param, code) for the endpoint."""
        param, code = self.param, self.code
        return (
            param[endpoint] if isinstance(param, dict) else param,
            code[endpoint] if isinstance(code, dict) else code,
        )


def by_endpoint(completions: str | None, chat: str | None) -> dict[str, str | None]:
    return {"completions": completions, "chat": chat}


INPUT = by_endpoint("prompt", "messages")
DEEP = 20_000
STOPS = 10_000
BIG = 60_000
"""Characters of the big garbage prompt: under BODY_LIMIT with the rest of the body."""

CASES = [
    # --- the body is not a JSON object --------------------------------------------------------
    Bad(
        "invalid_json_truncated",
        (lambda e, s: f'{{"model": "tiny", {stream_field(s)}, {input_field(e)}'.encode()),
        code="invalid_json",
    ),
    Bad(
        "invalid_json_trailing_comma",
        (lambda e, s: f"{{{input_field(e)}, {stream_field(s)},}}".encode()),
        code="invalid_json",
    ),
    Bad(
        "invalid_json_trailing_data",
        (lambda e, s: f"{{{input_field(e)}, {stream_field(s)}}} and more".encode()),
        code="invalid_json",
    ),
    Bad(
        "invalid_json_single_quotes",
        (lambda e, s: f"{{'prompt': 'x', 'stream': {json.dumps(s)}}}".encode()),
        code="invalid_json",
    ),
    Bad("empty_body", (lambda e, s: b""), code="invalid_json"),
    Bad("whitespace_body", (lambda e, s: b" \r\n\t "), code="invalid_json"),
    Bad("body_list", (lambda e, s: b"[" + patch()(e, s) + b"]"), code="invalid_type"),
    Bad("body_number", (lambda e, s: b"42"), code="invalid_type"),
    Bad("body_null", (lambda e, s: b"null"), code="invalid_type"),
    Bad("body_string", (lambda e, s: json.dumps(f"stream={s}").encode()), code="invalid_type"),
    Bad(
        "invalid_utf8",
        (lambda e, s: b'{"model": "tiny\xff\xfe", ' + stream_field(s).encode() + b"}"),
        code="invalid_json",
    ),
    Bad(
        "deeply_nested_json",
        (lambda e, s: patch()(e, s)[:-1] + b',"x":' + b"[" * DEEP + b"]" * DEEP + b"}"),
        code="invalid_json",
    ),
    Bad(
        "integer_literal_5000_digits",
        (lambda e, s: patch()(e, s)[:-1] + b',"max_tokens":1' + b"0" * 5000 + b"}"),
        code="invalid_json",
    ),
    # --- transport ----------------------------------------------------------------------------
    Bad(
        "content_type_text_plain",
        patch(),
        code="unsupported_media_type",
        status=415,
        headers={"content-type": "text/plain"},
    ),
    Bad(
        "content_type_form",
        patch(),
        code="unsupported_media_type",
        status=415,
        headers={"content-type": "application/x-www-form-urlencoded"},
    ),
    Bad(
        "content_type_missing",
        patch(),
        code="unsupported_media_type",
        status=415,
        headers={},
    ),
    Bad(
        "oversized_body",
        patch(
            completions={"prompt": "x" * BODY_LIMIT},
            chat={"messages": [{"role": "user", "content": "x" * BODY_LIMIT}]},
        ),
        code="request_too_large",
        status=413,
    ),
    Bad(
        "oversized_body_chunked",
        in_chunks(patch({"user": "x" * 2 * BODY_LIMIT})),
        code="request_too_large",
        status=413,
    ),
    # --- model, input -------------------------------------------------------------------------
    Bad("unknown_model", patch({"model": "gpt-4"}), "model", "model_not_found", 404),
    Bad("model_wrong_type", patch({"model": 123}), "model"),
    Bad(
        "empty_input",
        patch(completions={"prompt": ""}, chat={"messages": []}),
        INPUT,
    ),
    Bad(
        "missing_input",
        patch(drop=("prompt", "messages")),
        INPUT,
        "missing_required_parameter",
    ),
    Bad("input_null", patch(completions={"prompt": None}, chat={"messages": None}), INPUT),
    Bad("input_wrong_type", patch(completions={"prompt": 123}, chat={"messages": "hi"}), INPUT),
    Bad(
        "input_item_wrong_type",
        patch(
            completions={"prompt": [["a", "b"]]},
            chat={"messages": [{"role": "user", "content": 5}]},
        ),
        by_endpoint("prompt", "messages.0.content"),
    ),
    Bad(
        "input_item_empty",
        patch(completions={"prompt": [[1, 2], []]}, chat={"messages": [{}]}),
        by_endpoint("prompt", "messages.0.role"),
        by_endpoint("invalid_value", "missing_required_parameter"),
    ),
    Bad(
        "empty_role",
        patch(
            completions={"prompt": [{"role": "", "content": "x"}]},
            chat={"messages": [{"role": "", "content": "x"}]},
        ),
        by_endpoint("prompt", "messages.0.role"),
    ),
    Bad(
        "unknown_nested_field",
        patch(
            completions={"stream_options": {"include_usage": True, "colour": "red"}},
            chat={"response_format": {"type": "text", "colour": "red"}},
        ),
        by_endpoint("stream_options.colour", "response_format.colour"),
        "unsupported_parameter",
    ),
    Bad(
        "lone_surrogate",
        patch(
            completions={"prompt": "a\ud800b"},
            chat={"messages": [{"role": "user", "content": "a\ud800b"}]},
        ),
        by_endpoint("prompt", "messages.0.content"),
    ),
    Bad(
        "prompt_over_context",
        patch(
            completions={"prompt": [5] * (CONTEXT + 10)},
            chat={"messages": [{"role": "user", "content": "hello " * CONTEXT}]},
        ),
        INPUT,
    ),
    Bad(
        "big_prompt_error_elsewhere",
        patch(
            {"temperature": -1},
            completions={"prompt": garbage(BIG)},
            chat={"messages": [{"role": "user", "content": garbage(BIG)}]},
        ),
        "temperature",
    ),
    # --- token ids ----------------------------------------------------------------------------
    Bad(
        "token_id_negative",
        patch(completions={"prompt": [1, -5]}, chat={"stop_token_ids": [-1]}),
        by_endpoint("prompt", "stop_token_ids"),
    ),
    Bad(
        "token_id_outside_vocab",
        patch(completions={"prompt": [1, 99_999]}, chat={"stop_token_ids": [99_999]}),
        by_endpoint("prompt", "stop_token_ids"),
    ),
    Bad(
        "token_id_over_int64",
        patch(completions={"prompt": [1, 2**70]}, chat={"stop_token_ids": [2**70]}),
        by_endpoint("prompt", "stop_token_ids"),
    ),
    Bad("stop_token_ids_outside_vocab", patch({"stop_token_ids": [2, 10**6]}), "stop_token_ids"),
    Bad(
        "echo_with_token_id_over_int64",
        patch(completions={"prompt": [1, 2**70], "echo": True}, chat={"echo": [1]}),
        by_endpoint("prompt", "echo"),
    ),
    Bad(
        "stop_token_ids_outside_vocab_min_tokens",
        patch({"stop_token_ids": [10**6], "min_tokens": 1}),
        "stop_token_ids",
    ),
    Bad("stop_token_ids_wrong_type", patch({"stop_token_ids": ["eos"]}), "stop_token_ids.0"),
    # --- lengths ------------------------------------------------------------------------------
    Bad("max_tokens_zero", patch({"max_tokens": 0}), "max_tokens"),
    Bad("max_tokens_negative", patch({"max_tokens": -5}), "max_tokens"),
    Bad("max_tokens_wrong_type", patch({"max_tokens": "ten"}), "max_tokens"),
    Bad("max_tokens_fractional", patch({"max_tokens": 2.5}), "max_tokens"),
    Bad("max_tokens_infinite", patch({"max_tokens": float("inf")}), "max_tokens"),
    Bad("max_tokens_over_context", patch({"max_tokens": CONTEXT}), "max_tokens"),
    Bad("max_tokens_huge", patch({"max_tokens": 10**30}), "max_tokens"),
    Bad("min_tokens_negative", patch({"min_tokens": -1}), "min_tokens"),
    Bad("min_tokens_over_max_tokens", patch({"min_tokens": 10}), "min_tokens"),
    # --- sampling -----------------------------------------------------------------------------
    Bad("temperature_negative", patch({"temperature": -0.5}), "temperature"),
    Bad("temperature_nan", patch({"temperature": float("nan")}), "temperature"),
    Bad("temperature_inf", patch({"temperature": float("inf")}), "temperature"),
    Bad("temperature_wrong_type", patch({"temperature": "hot"}), "temperature"),
    Bad("top_p_zero", patch({"top_p": 0}), "top_p"),
    Bad("top_p_above_one", patch({"top_p": 1.5}), "top_p"),
    Bad("top_p_nan", patch({"top_p": float("nan")}), "top_p"),
    Bad("top_k_below_minus_one", patch({"top_k": -2}), "top_k"),
    Bad("top_k_fractional", patch({"top_k": 1.5}), "top_k"),
    Bad("top_k_over_int64", patch({"top_k": 2**70}), "top_k"),
    Bad("min_p_above_one", patch({"min_p": 1.5}), "min_p"),
    Bad("presence_penalty_out_of_range", patch({"presence_penalty": 2.5}), "presence_penalty"),
    Bad("frequency_penalty_out_of_range", patch({"frequency_penalty": -3}), "frequency_penalty"),
    Bad(
        "frequency_penalty_minus_inf",
        patch({"frequency_penalty": float("-inf")}),
        "frequency_penalty",
    ),
    Bad("repetition_penalty_zero", patch({"repetition_penalty": 0}), "repetition_penalty"),
    Bad(  # the fuzzer's: seen tokens' logits divided by it were infinite (a 503)
        "repetition_penalty_tiny",
        patch({"repetition_penalty": 5.2757274371191525e-245}),
        "repetition_penalty",
    ),
    Bad("seed_over_int64", patch({"seed": 2**64}), "seed"),
    Bad("seed_wrong_type", patch({"seed": "abc"}), "seed"),
    Bad("n_zero", patch({"n": 0}), "n"),
    Bad("n_over_cap", patch({"n": 129}), "n"),
    Bad("n_huge", patch({"n": 10**30}), "n"),
    Bad(
        "logprobs_out_of_range",
        patch(completions={"logprobs": 21}, chat={"logprobs": True, "top_logprobs": 21}),
        by_endpoint("logprobs", "top_logprobs"),
    ),
    Bad(
        "logprobs_conflict",
        patch(completions={"echo": True, "logprobs": 21}, chat={"top_logprobs": 2}),
        by_endpoint("logprobs", "top_logprobs"),
    ),
    # --- stop ---------------------------------------------------------------------------------
    Bad("stop_empty_string", patch({"stop": ""}), "stop"),
    Bad("stop_list_with_empty_string", patch({"stop": ["end", ""]}), "stop"),
    Bad("stop_wrong_type", patch({"stop": 5}), "stop"),
    Bad("stop_nested_lists", patch({"stop": [[["x"]]] * 100}), "stop"),
    Bad("stop_10000_strings_one_empty", patch({"stop": ["ab"] * (STOPS - 1) + [""]}), "stop"),
    Bad("stop_65_strings", patch({"stop": ["end"] * 65}), "stop"),
    Bad("stop_over_4096_characters", patch({"stop": ["x" * 4000, "y" * 97]}), "stop"),
    # --- other types --------------------------------------------------------------------------
    Bad("user_wrong_type", patch({"user": 5}), "user"),
    Bad("ignore_eos_wrong_type", patch({"ignore_eos": "maybe"}), "ignore_eos"),
    Bad(
        "stream_wrong_type",
        (lambda e, s: patch({"stream": [True] if s else "maybe"})(e, s)),
        "stream",
    ),
    Bad(
        "stream_options_invalid",
        (lambda e, s: patch({"stream_options": "yes" if s else {"include_usage": True}})(e, s)),
        "stream_options",
    ),
    # --- unsupported parameters ---------------------------------------------------------------
    Bad(  # tools on completions: not an OpenAI field there
        "tool_choice_names_no_tool",
        patch(
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            }
        ),
        by_endpoint("tools", "tool_choice"),
        by_endpoint("unsupported_parameter", "invalid_value"),
    ),
    Bad(
        "out_of_range_logit_bias",
        patch({"logit_bias": {"1": 500}}),
        "logit_bias",
        "invalid_value",
    ),
    # keys str.isdigit() takes and int() refuses: a superscript digit, 5,000 digits
    Bad("logit_bias_key_superscript_digit", patch({"logit_bias": {"²": 1}}), "logit_bias"),
    Bad("logit_bias_key_5000_digits", patch({"logit_bias": {"1" * 5000: 1}}), "logit_bias"),
    Bad(  # 130 sequences, over 128: named best_of, which set their number, not n
        "best_of_over_the_sequence_limit",
        patch(completions={"prompt": ["hello"] * 26, "best_of": 5}, chat={"best_of": 129}),
        "best_of",
    ),
    Bad(
        "unenforceable_response_format",
        patch(
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            }
        ),
        "response_format",
        "invalid_value",
    ),
    Bad(
        "unsupported_huge_name",
        patch({"p" * 30_000: 1}),
        shortened("ppp"),
        "unsupported_parameter",
    ),
    Bad(
        "unsupported_unicode_name",
        patch({'\U0001f600\n"\\' * 2000: 1}),
        shortened("\U0001f600\n"),
        "unsupported_parameter",
    ),
    Bad(
        "lone_surrogate_in_name",
        patch({"colour\ud800": 1}),
    ),
    Bad("lone_surrogate_in_stop", patch({"stop": ["end", "a\ud800"]}), "stop.1"),
    Bad("lone_surrogate_in_user", patch({"user": "\udfff"}), "user"),
    Bad("lone_surrogate_in_cache_salt", patch({"cache_salt": "a\ud800"}), "cache_salt"),
    Bad("lone_surrogate_in_model", patch({"model": "tiny\ud800"}), "model"),
    Bad(
        "lone_surrogate_in_message_name",
        patch(
            completions={"prompt": ["ok", "a\ud800"]},
            chat={"messages": [{"role": "user", "content": "hi", "name": "a\ud800"}]},
        ),
        by_endpoint("prompt.1", "messages.0.name"),
    ),
    Bad(
        "unsupported_huge_model_name",
        patch({"model": "\x01\U0001f600" * 3000}),
        "model",
        "model_not_found",
        404,
    ),
]

LEAKS = re.compile(
    r"Traceback|File \"|\.py\b|site-packages|pypto_serving|line \d+|"
    r"(?<![\w.])/(home|usr|opt|tmp|work|root|var|etc|lib|proc|dev|srv)\b"
)


def send(live: Live, endpoint: str, body: Body, headers: dict[str, str]) -> httpx.Response:
    content = body() if callable(body) else body
    return httpx.post(
        live.url + PATHS[endpoint], content=content, headers=headers, timeout=patience(60)
    )


def check_error(r: httpx.Response, status: int, param: Any, code: str | None) -> None:
    """A 4xx JSON error in OpenAI's shape, small, with nothing internal in it."""
    assert r.status_code == status, r.text[:2000]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert len(r.content) <= MAX_ERROR_BYTES, len(r.content)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    assert err["code"] == code, err
    if callable(param):
        assert param(err["param"]), err
    else:
        assert err["param"] == param, err
    assert not LEAKS.search(err["message"]), err["message"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(live: Live, group: tuple[str, bool], case: Bad) -> None:
    endpoint, stream = group
    r = send(live, endpoint, case.build(endpoint, stream), case.headers)
    check_error(r, case.status, *case.expected(endpoint))


def test_still_serves(live: Live, group: tuple[str, bool]) -> None:
    """After the group's bad requests: /health is 200 and a normal request succeeds."""
    endpoint, stream = group
    assert httpx.get(live.url + "/health").status_code == 200
    r = send(live, endpoint, patch()(endpoint, stream), JSON_HEADERS)
    assert r.status_code == 200, r.text
    if not stream:
        assert len(r.json()["choices"]) == 1
        return
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "knobs",
    [
        {"seed": 2**64},
        {"top_k": 2**63},
        {"n": 10**30},
        {"max_tokens": -(2**70)},
        {"stop_token_ids": [2**64]},
        {"temperature": float("nan")},
        {"stop": ["x"] * 10_000 + [""]},
    ],
    ids=["seed", "top_k", "n", "max_tokens", "stop_token_ids", "temperature", "stop"],
)
def test_offline_api_shares_the_rules(knobs: dict[str, Any]) -> None:
    """SamplingParams rejects what the server rejects, with a short message naming the field."""
    with pytest.raises(PyptoError) as e:
        SamplingParams(**knobs)
    assert e.value.param == next(iter(knobs)) and len(str(e.value)) < 200


def test_table_is_big_enough() -> None:
    assert len({c.name for c in CASES}) == len(CASES) >= 40
