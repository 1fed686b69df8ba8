"""Tool calling (issue 27): tools, tool_choice and parallel_tool_calls through the OpenAI API,
calls parsed into message.tool_calls and streamed as delta.tool_calls (tool_parser.py), held
to the tools' schemas by a grammar (tools.py), in both formats: Hermes (a tiny Qwen3 whose
template renders tools, `<tool_call>` as a token of its own) and SmolLM2's (the default model,
whose template renders none).

Ground truth: every call's arguments parse and validate with `jsonschema` against the tool's
parameters; a streamed reply reassembles to the non-streamed one (greedy); the parser splits
text the same way whatever the pieces it is fed in."""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import openai
import pytest
from checkpoints import (
    CHATML,
    LLAMA3_TOOLS,
    MISTRAL_TOOLS,
    build_hermes_model,
    build_tokenizer,
    build_tools_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import serving, tiny_llm

from pypto_serving.server.protocol import closed_objects
from pypto_serving.server.tool_parser import ToolCallParser
from pypto_serving.server.tools import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    SMOLLM2,
    call_grammar,
    call_schema,
    tool_format,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["paris", "rome", "oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def check_calls(calls) -> list[str]:
    """Each call's arguments parse and validate against its tool; the tools' names."""
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id and call.type == "function"
    return [c.function.name for c in calls]


def reassembled(chunks) -> tuple[dict[int, dict], dict[int, str | None], str]:
    """Streamed tool calls by index ({"id", "name", "arguments"}), finish reasons by choice, and
    the content."""
    calls: dict[int, dict] = {}
    reasons: dict[int, str | None] = {}
    content = ""
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function and d.function.name)
                call["arguments"] += (d.function and d.function.arguments) or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return calls, reasons, content


def answered(message, call) -> list[dict]:
    """ASK, the reply that made `call`, and the call's result: a conversation to go on."""
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}
    return [*ASK, message.model_dump(exclude_none=True), result]


# --- the parser ----------------------------------------------------------------------------

REPLIES = [
    (
        SMOLLM2,
        'Let me see. <tool_call>[\n{"name": "a", "arguments": {"x": "}\\"", "y": [1, {}]}},'
        '\n{"name": "b", "arguments": {}}\n]</tool_call>',
    ),
    (
        HERMES,
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": 12 }\n</tool_call>\n',
    ),
    (HERMES, "no call here <tool_ but <b> text"),
    (HERMES, 'cut <tool_call>\n{"name": "a", "arguments": {"x": 1'),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]',
    ),
    (MISTRAL, "a [TOOL_ that is not [TOOL_CALLS"),
    (LLAMA3_JSON, '{"name": "a", "parameters": {"x": "}"}}; {"name": "b", "parameters": 3}'),
    (LLAMA3_JSON, 'text first {"name": "a", "parameters": {}}'),
]


def test_a_whole_reply_splits_into_content_and_calls():
    got = []
    for fmt, text in REPLIES:
        parser = ToolCallParser(fmt)
        parser.feed(text)
        parser.flush()
        got.append((parser.message_content(), [(c.name, c.arguments) for c in parser.calls]))
    assert got == [
        ("Let me see. ", [("a", '{"x": "}\\"", "y": [1, {}]}'), ("b", "{}")]),
        (None, [("a", '{"x": 1}'), ("b", "12")]),
        ("no call here <tool_ but <b> text", []),
        ("cut ", [("a", '{"x": 1')]),  # cut off by max_tokens: as far as it was streamed
        (None, [("a", '{"x": "]"}'), ("b", "{}")]),
        ("a [TOOL_ that is not [TOOL_CALLS", []),
        (None, [("a", '{"x": "}"}'), ("b", "3")]),
        ('text first {"name": "a", "parameters": {}}', []),  # a call opens the reply or none
    ]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(range(len(REPLIES))), cuts=st.lists(st.integers(1, 200), max_size=30))
def test_streamed_pieces_reassemble_to_the_whole_reply(case, cuts):
    fmt, text = REPLIES[case]
    whole = ToolCallParser(fmt)
    whole.feed(text)
    whole.flush()
    parser, content, calls = ToolCallParser(fmt), [], {}
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for a, b in itertools.pairwise(bounds):
        said, deltas = parser.feed(text[a:b])
        content.append(said)
        for d in deltas:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.name or ""
            call[1] += d.arguments
    content.append(parser.flush())
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.name, c.arguments) for c in whole.calls]
    assert "".join(content) == "".join(whole.content)


@pytest.mark.parametrize("hermes_tags", [False, True])
def test_the_grammar_admits_only_valid_calls_of_the_allowed_tools(tmp_path, hermes_tags):
    """Over a tokenizer where the tags are text, and one where they are tokens (Qwen's)."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pypto_serving.server.tools import tag_tokens

    build_tokenizer(tmp_path, hermes=hermes_tags)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    vocab, tags = llguidance.hf.from_tokenizer(hf), tag_tokens(hf.get_added_vocab())
    assert (tags[0] is not None) == hermes_tags
    calls = [call_schema(n, s | {"additionalProperties": False}) for n, s in SCHEMAS.items()]

    def admits(fmt, required, parallel, text):
        matcher = llguidance.LLMatcher(vocab, call_grammar(fmt, calls, required, parallel, tags))
        return all(matcher.consume_token(t) for t in hf.encode(text)) and matcher.is_accepting()

    def block(fmt, *bodies):
        if fmt is SMOLLM2:
            return "<tool_call>[" + ", ".join(bodies) + "]</tool_call>"
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)

    weather = '{"name": "get_weather", "arguments": {"city": "oslo", "days": 3}}'
    time = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    for fmt in (HERMES, SMOLLM2):
        assert admits(fmt, True, True, block(fmt, weather, time))
        assert not admits(fmt, True, False, block(fmt, weather, time))  # one call at most
        assert not admits(fmt, True, True, "sure: " + block(fmt, weather))  # calls only
        assert not admits(fmt, True, True, block(fmt, weather.replace("oslo", "bergen")))
        assert not admits(fmt, True, True, block(fmt, time.replace("get_time", "get_date")))
        assert not admits(fmt, True, True, block(fmt, time.replace("}}", ', "x": 1}}')))
        assert admits(fmt, False, True, "no call at all")
        assert admits(fmt, False, True, "let me look. " + block(fmt, weather))
        assert not admits(fmt, False, True, "let me look. " + block(fmt, weather[:-2] + "0}}"))


def test_the_tagless_and_mistral_grammars_admit_only_valid_calls(tmp_path):
    """Mistral's `[TOOL_CALLS]` list (the tag as text here) and Llama 3's JSON calls (a call
    opens the reply or none does, `;` between calls, their arguments under `parameters`)."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    vocab = llguidance.hf.from_tokenizer(hf)
    for fmt, join in ((MISTRAL, "[TOOL_CALLS][{}]".format), (LLAMA3_JSON, "{}".format)):
        key = fmt.arguments
        calls = [
            call_schema(n, s | {"additionalProperties": False}, key) for n, s in SCHEMAS.items()
        ]
        weather = f'{{"name": "get_weather", "{key}": {{"city": "oslo", "days": 3}}}}'
        time = f'{{"name": "get_time", "{key}": {{"zone": "CET"}}}}'
        between = ", " if fmt is MISTRAL else "; "

        def admits(required, parallel, text, fmt=fmt, calls=calls):
            grammar = call_grammar(fmt, calls, required, parallel)
            matcher = llguidance.LLMatcher(vocab, grammar)
            return all(matcher.consume_token(t) for t in hf.encode(text)) and matcher.is_accepting()

        both = join(between.join([weather, time]))
        assert admits(True, True, both), fmt.name
        assert not admits(True, False, both)  # one call at most
        assert admits(True, False, join(weather))
        assert not admits(True, True, "sure: " + join(weather))  # calls only
        assert not admits(True, True, join(weather.replace("oslo", "bergen")))
        assert not admits(True, True, join(weather.replace(key, "args")))  # the format's key
        assert admits(False, True, "no call at all")
        assert admits(False, True, join(weather))
        # after text: Mistral's tag opens a call, held to the schemas; Llama 3's calls open
        # the reply or never come, so this is text to it (the parser reads no call: REPLIES)
        assert admits(False, True, "let me see. " + join(weather))
        bad = "let me see. " + join(weather.replace("oslo", "bergen"))
        assert admits(False, True, bad) == (fmt is LLAMA3_JSON)


def test_each_tools_references_resolve_to_its_own_definitions(tmp_path):
    """Two tools defining `Loc` differently, one zod-style (`definitions`), one recursive
    (`#`): each call is held to its own tool's definitions, in both formats."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    def loc(key, value):
        return {"type": "object", "properties": {key: {"const": value}}, "required": [key]}

    def at(ref, defs, place):
        body = {"type": "object", "properties": {"at": {"$ref": ref}}, "required": ["at"]}
        return body | {defs: {"Loc": place}}

    params = {
        "a": at("#/$defs/Loc", "$defs", loc("city", "rome")),
        "b": at("#/definitions/Loc", "definitions", loc("zone", 1)),
        "c": {
            "type": "object",
            "properties": {"n": {"enum": [1, 2]}, "next": {"$ref": "#"}},
            "required": ["n"],
        },
    }
    calls = [call_schema(n, closed_objects(s)) for n, s in params.items()]
    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    vocab = llguidance.hf.from_tokenizer(hf)
    good = [
        '{"name": "a", "arguments": {"at": {"city": "rome"}}}',
        '{"name": "b", "arguments": {"at": {"zone": 1}}}',
        '{"name": "c", "arguments": {"n": 1, "next": {"n": 2, "next": {"n": 1}}}}',
    ]
    bad = [
        '{"name": "a", "arguments": {"at": {"zone": 1}}}',  # b's Loc
        '{"name": "b", "arguments": {"at": {"city": "rome"}}}',  # a's Loc
        '{"name": "c", "arguments": {"n": 1, "next": {"n": 3}}}',
    ]
    for body, schema in zip(good, params.values(), strict=True):
        jsonschema.validate(json.loads(body)["arguments"], schema)  # what each tool means
    blocks = {SMOLLM2: "<tool_call>[{}]</tool_call>", HERMES: "<tool_call>\n{}\n</tool_call>"}
    for fmt, block in blocks.items():
        grammar = call_grammar(fmt, calls, required=True, parallel=False)
        admitted = []
        for body in good + bad:
            matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
            ids = hf.encode(block.format(body))
            admitted.append(all(map(matcher.consume_token, ids)) and matcher.is_accepting())
        assert admitted == [True] * 3 + [False] * 3, fmt


def test_the_format_follows_the_chat_template():
    assert tool_format(CHATML) is SMOLLM2  # renders no tools: SmolLM2's, in our template
    assert tool_format("{{ tools }} <tool_call>") is HERMES
    assert tool_format("{% for t in tools %}[TOOL_CALLS]{% endfor %}") is MISTRAL
    assert tool_format('{{ tools }} {"name": x, "parameters": y}') is LLAMA3_JSON
    assert tool_format("{{ tools }} <|python_tag|>") is LLAMA3_JSON
    assert tool_format("{% for t in tools %}{{ t }}{% endfor %}") is None  # unknown
    assert tool_format("{{ tools }}", "mistral") is MISTRAL  # --tool-call-parser decides
    assert tool_format(CHATML, "hermes") is SMOLLM2  # the same tags, in our template


# --- a tiny Qwen3 with a Hermes template ------------------------------------------------------


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    out = build_hermes_model(tmp_path_factory.mktemp("qwen3-hermes"))
    with tiny_llm(out, num_kv_pages=512) as llm, serving(llm, "tiny") as live:
        yield live, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "the weather in paris?"}]


def test_required_and_named_choices_call_valid_tools(hermes):
    _live, api = hermes
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=0)
    out = api.chat.completions.create(**kw, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert check_calls(choice.message.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        out = api.chat.completions.create(  # one call: a random model would go on calling
            **(kw | {"temperature": 1.0}),
            seed=seed,
            tool_choice=named,
            n=2,
            parallel_tool_calls=False,
        )
        for c in out.choices:  # a named tool: stop and "" (OpenAI's and vLLM's rule)
            assert c.finish_reason == "stop" and c.message.content == ""
            assert set(check_calls(c.message.tool_calls)) == {"get_time"}
    one = api.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(one.choices[0].message.tool_calls)) == 1


def test_streamed_calls_reassemble_to_the_same_calls(hermes):
    _live, api = hermes
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=0)
    whole = api.chat.completions.create(**kw, tool_choice="required").choices[0]
    calls, reasons, content = reassembled(
        api.chat.completions.create(**kw, tool_choice="required", stream=True)
    )
    assert reasons == {0: "tool_calls"} and content == ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_calls_where_the_model_opens_a_block_and_none_never_calls(hermes):
    _live, api = hermes
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes[0].llm.model_dir)
    open_id = tok.convert_tokens_to_ids("<tool_call>")
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=0)
    # the model pushed to open a block: from there the block is held to the tools' schemas
    pushed = api.chat.completions.create(
        **kw, tool_choice="auto", parallel_tool_calls=False, logit_bias={str(open_id): 100}
    ).choices[0]
    assert len(check_calls(pushed.message.tool_calls)) == 1
    free = api.chat.completions.create(**kw, tool_choice="auto", logit_bias={str(open_id): -100})
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    none = api.chat.completions.create(**kw, tool_choice="none", logit_bias={str(open_id): 100})
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


def test_a_tool_result_goes_back_through_the_template(hermes):
    live, api = hermes
    kw = dict(model="tiny", tools=TOOLS, max_tokens=400, temperature=0)
    first = api.chat.completions.create(**kw, messages=ASK, tool_choice="required").choices[0]
    call = first.message.tool_calls[0]
    history = answered(first.message, call)
    follow = api.chat.completions.create(**(kw | {"max_tokens": 8}), messages=history)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = httpx.post(live.url + "/tokenize", json={"messages": history}).json()["tokens"]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(live.llm.model_dir).decode(rendered)
    assert f'"name": "{call.function.name}"' in text and '{"sky": "clear"}' in text
    assert "<tool_response>" in text


ARRAY = {"type": "array", "items": {"type": "integer"}}
HUGE = {"type": "object", "properties": {"x": {"enum": [f"v{i:07d}" for i in range(20_000)]}}}
"""Parameters over 200,000 characters of JSON."""


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "two tools are named"),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}},
            "tools",
            "not both",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ]
            },
            "tools",
            "uniqueItems",
        ),
        (  # a call's arguments are an object
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": ARRAY}}]},
            "tools",
            "must be the JSON schema of an object",
        ),
        (  # over the grammar size limit: named as tools, not as structured_outputs
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE}}]},
            "tools",
            "over the limit of 200000",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "",
        ),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(hermes, extra, param, said):
    live, _api = hermes
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4} | extra
    r = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and said in error["message"], error


def test_a_pydantic_tool_with_nested_models_is_called_to_its_schema(hermes):
    """openai.pydantic_function_tool of a model nesting another: its parameters refer to
    their `$defs` from their root (`#/$defs/Place`), which must resolve inside the grammar's
    combined schema. Forced by the grammar (required, named), every call validates against
    the tool's schema and parses as the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: Literal["paris", "rome", "oslo"]
        days: int = Field(ge=1, le=7)

    class Trip(BaseModel):
        start: Place
        stops: list[Place] = Field(max_length=2)

    tool = openai.pydantic_function_tool(Trip)
    schema = tool["function"]["parameters"]
    assert "$defs" in schema and schema["properties"]["start"] == {"$ref": "#/$defs/Place"}
    schemas = {"Trip": schema, "get_time": TIME}
    _live, api = hermes
    kw = dict(model="tiny", messages=ASK, tools=[tool, TOOLS[1]], max_tokens=400)
    named = {"type": "function", "function": {"name": "Trip"}}
    names = []
    for tool_choice in ("required", named):  # sampled: 3 different calls each
        out = api.chat.completions.create(
            **kw, tool_choice=tool_choice, temperature=1.0, seed=0, n=3, parallel_tool_calls=False
        )
        for choice in out.choices:
            forced = "stop" if tool_choice is named else "tool_calls"
            assert choice.finish_reason == forced, choice
            (call,) = choice.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if call.function.name == "Trip":
                Trip.model_validate_json(call.function.arguments)
            names.append(call.function.name)
    assert names.count("Trip") >= 3  # every named call at least


def test_message_shapes_are_checked(hermes):
    live, _api = hermes
    for messages, said in (
        ([{"role": "user", "content": None}], "needs its content"),
        ([{"role": "user", "content": "a", "tool_call_id": "x"}], "only a tool message"),
        (
            [{"role": "user", "content": "a", "tool_calls": []}],
            "only an assistant message has tool_calls",
        ),
    ):
        body = {"model": "tiny", "messages": messages, "max_tokens": 4}
        r = httpx.post(live.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text


def test_langchain_binds_tools_and_structured_output(hermes):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    live, _api = hermes
    chat = ChatOpenAI(
        model="tiny", base_url=live.url + "/v1", api_key="unused", temperature=0, max_tokens=400
    )

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(pattern="^(paris|rome)$")
        days: int = Field(ge=1, le=7)

    bound = chat.bind_tools([Weather], tool_choice="Weather")
    reply = bound.invoke("the weather in paris?")
    assert [c["name"] for c in reply.tool_calls] == ["Weather"]
    Weather.model_validate(reply.tool_calls[0]["args"])
    for method in ("json_schema", "function_calling"):
        got = chat.with_structured_output(Weather, method=method).invoke("paris weather?")
        assert isinstance(got, Weather), method


# --- the default model, SmolLM2's format ------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_calls_tools_through_the_openai_client():
    from pypto_serving import LLM

    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    with LLM("default", enforce_eager=True) as llm, serving(llm, "SmolLM2") as live:
        api = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="SmolLM2", messages=ask, tools=TOOLS, max_tokens=120, temperature=0)
        required = api.chat.completions.create(**kw, tool_choice="required").choices[0]
        assert required.finish_reason == "tool_calls"
        assert "get_weather" in check_calls(required.message.tool_calls)
        assert {"city": "paris"}.items() <= json.loads(
            required.message.tool_calls[0].function.arguments
        ).items()
        calls, reasons, _ = reassembled(
            api.chat.completions.create(**kw, tool_choice="required", stream=True)
        )
        assert reasons == {0: "tool_calls"}
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in required.message.tool_calls
        ]
        for seed in range(2):  # sampled, n = 2: every call still valid
            out = api.chat.completions.create(
                **(kw | {"temperature": 1.0}), tool_choice=named, n=2, seed=seed
            )
            for c in out.choices:
                assert set(check_calls(c.message.tool_calls)) == {"get_time"}
        auto = api.chat.completions.create(**kw, tool_choice="auto").choices[0]
        if auto.message.tool_calls:  # the model's choice; whatever it is, it parses
            check_calls(auto.message.tool_calls)
        else:
            assert auto.message.content
        none = api.chat.completions.create(**kw, tool_choice="none").choices[0]
        assert none.message.tool_calls is None and none.message.content
        history = [
            *ask,
            required.message.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": required.message.tool_calls[0].id,
                "content": json.dumps({"temperature_c": 18, "sky": "clear"}),
            },
        ]
        follow = api.chat.completions.create(**(kw | {"messages": history})).choices[0]
        assert follow.message.content or follow.message.tool_calls


# --- tiny models with Mistral's and Llama 3's formats ------------------------------------------


@pytest.fixture(scope="module", params=["mistral", "llama3_json", "pythonic"])
def other_format(request, tmp_path_factory):
    """A tiny model whose template writes calls in this format; pythonic's is named by the
    server's --tool-call-parser (its template is Llama 3's, which renders the tools)."""
    template = {"mistral": MISTRAL_TOOLS}.get(request.param, LLAMA3_TOOLS)
    out = build_tools_model(tmp_path_factory.mktemp(request.param), template)
    parser = "pythonic" if request.param == "pythonic" else None
    with (
        tiny_llm(out, num_kv_pages=512) as llm,
        serving(llm, "tiny", tool_call_parser=parser) as live,
    ):
        api = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        yield request.param, live, api


def test_mistral_llama3_and_pythonic_formats_call_valid_tools_streamed_or_not(other_format):
    name, live, api = other_format
    # one call each: a random model would go on adding calls to a list until max_tokens
    kw = dict(model="tiny", tools=TOOLS, max_tokens=300, temperature=0, parallel_tool_calls=False)
    whole = api.chat.completions.create(**kw, messages=ASK, tool_choice="required").choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, name
    assert check_calls(whole.message.tool_calls)
    calls, reasons, content = reassembled(
        api.chat.completions.create(**kw, messages=ASK, tool_choice="required", stream=True)
    )
    assert reasons == {0: "tool_calls"} and content == ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    named = {"type": "function", "function": {"name": "get_time"}}
    one = api.chat.completions.create(**kw, messages=ASK, tool_choice=named)
    assert check_calls(one.choices[0].message.tool_calls) == ["get_time"]
    # the call and its result go back through the model's own template
    call = whole.message.tool_calls[0]
    history = answered(whole.message, call)
    follow = api.chat.completions.create(**(kw | {"max_tokens": 4}), messages=history)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shown = httpx.post(
        live.url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60
    ).json()["tokens"]
    text = live.llm.tokenizer.decode(shown)
    marker = "[TOOL_CALLS]" if name == "mistral" else '"parameters": '
    assert marker in text and call.function.name in text
