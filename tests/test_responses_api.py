"""/v1/responses (issue 27): OpenAI's Responses API through the official SDK's
`client.responses`, text and tools, streamed and not, on a tiny Qwen3 with Qwen's tool calling.

Ground truth: a response's text is the chat endpoint's reply to the same conversation (greedy);
a streamed response's final object equals the non-streamed one in its output; the SDK's own
stream helper accepts the event sequence; calls validate against their tools."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from checkpoints import build_hermes_model
from live_server import serving, tiny_llm

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ASK = "the weather in paris?"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    out = build_hermes_model(tmp_path_factory.mktemp("qwen3-hermes"))
    with tiny_llm(out, num_kv_pages=512) as llm, serving(llm, "tiny") as live:
        yield live, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_text_is_the_chat_reply_and_streams_to_the_same_response(live):
    _live, api = live
    kw = dict(model="tiny", temperature=0, max_output_tokens=12)
    r = api.responses.create(**kw, instructions="be brief", input=ASK)
    chat = api.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=12,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": ASK}],
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == chat.usage.prompt_tokens
    events = list(api.responses.create(**kw, instructions="be brief", input=ASK, stream=True))
    final = events[-1].response  # cut by max_output_tokens: response.incomplete, as OpenAI
    assert final.output_text == r.output_text and final.status == r.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text


def test_tools_calls_and_their_results(live):
    _live, api = live
    kw = dict(model="tiny", temperature=0, tools=TOOLS, max_output_tokens=300)
    r = api.responses.create(**kw, input=ASK, tool_choice="required")
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with api.responses.stream(**kw, input=ASK, tool_choice="required") as stream:  # the SDK's
        streamed = list(stream)
        done = stream.get_final_response().output[0]
    assert (done.name, done.arguments) == (call.name, call.arguments)
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    named = api.responses.create(
        **kw, input=ASK, tool_choice={"type": "function", "name": "get_weather"}
    )
    assert [o.name for o in named.output] == ["get_weather"]
    follow = api.responses.create(
        **(kw | {"max_output_tokens": 6}),
        input=[
            {"role": "user", "content": ASK},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tool_choice="none",
    )
    assert follow.output_text and follow.output[0].type == "message"


def test_text_format_json_schema_holds(live):
    _live, api = live
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = api.responses.create(
        model="tiny",
        input=ASK,
        temperature=0,
        max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        ({"store": True}, "store", "nothing is stored"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "nothing is stored"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "context length"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "nothing is stored"),
        ({"input": [{"type": "function_call_output"}]}, "input", "a list of input items"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_the_field(live, extra, param, said):
    live_, _api = live
    r = httpx.post(live_.url + "/v1/responses", json={"input": ASK} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and said in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_come_with_the_text_and_raw_messages_when_asked(live, stream):
    """top_logprobs (or include's message.output_text.logprobs): each output token's logprob
    and its alternatives, as chat's logprobs give them, on the text deltas and the output_text
    part; vLLM's enable_response_messages: the prompt and reply as token ids and raw text."""
    live_, api = live
    kw = dict(model="tiny", temperature=0, max_output_tokens=8, input=ASK, top_logprobs=3)
    chat = api.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=8,
        messages=[{"role": "user", "content": ASK}],
        logprobs=True,
        top_logprobs=3,
    )
    expected = [c.model_dump() for c in chat.choices[0].logprobs.content]
    if stream:
        events = list(api.responses.create(**kw, stream=True))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        got = [lp.model_dump() for e in deltas for lp in e.logprobs]
        done = next(e for e in events if e.type == "response.output_text.done")
        assert [lp.model_dump() for lp in done.logprobs] == got
    else:
        r = api.responses.create(**kw)
        got = [lp.model_dump() for lp in r.output[0].content[0].logprobs]
    assert got == expected and all(len(lp["top_logprobs"]) == 3 for lp in got)
    body = {"input": ASK, "max_output_tokens": 4, "temperature": 0}
    body |= {"include": ["message.output_text.logprobs"], "enable_response_messages": True}
    raw = httpx.post(live_.url + "/v1/responses", json=body, timeout=60).json()
    assert len(raw["output"][0]["content"][0]["logprobs"]) == 4
    tokenizer = live_.llm.tokenizer
    (prompt,), (reply,) = raw["input_messages"], raw["output_messages"]
    assert prompt["type"] == reply["type"] == "raw_message_tokens"
    assert tokenizer.decode(prompt["tokens"]) == prompt["message"] and ASK in prompt["message"]
    assert len(reply["tokens"]) == 4 and tokenizer.decode(reply["tokens"]) == reply["message"]
