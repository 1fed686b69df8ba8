"""vLLM's request extras, with vLLM's meanings (issue 45, item 2).

Chat: `chat_template_kwargs` reach the template, `continue_final_message` leaves the last
message open, `add_special_tokens` adds the tokenizer's BOS, `echo` starts the reply with the
message it continues, custom roles and unknown message fields are accepted, `model: ""` is the
served model. Both endpoints: `allowed_token_ids`, `guided_decoding_backend`,
`return_tokens_as_token_ids` (and the server flag), `stream_options.continuous_usage_stats`,
`prompt_logprobs: null` where not asked for, completions' `logprobs: 0` holding the sampled
token. Routes: /tokenize's `return_token_strs`, `tools` and template options,
/tokenizer_info, /invocations and /load behind their flags.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Live, serving, tiny_llm
from patience import patience

from pypto_serving.chat_prompt import special_tokens_around
from pypto_serving.errors import PyptoError, RequestRejectedError
from pypto_serving.sampling import SamplingParams
from pypto_serving.server.tools import tool_format

MODEL = "llama-gqa4-tied"
TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message is defined) %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML that shows a `greeting` variable where one is given (chat_template_kwargs), and a
`reasoning_effort`."""
CONVERSATION = [
    {"role": "user", "content": "tell me a saying"},
    {"role": "assistant", "content": "the quick brown fox"},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def with_bos_and_template(src: Path, out: Path) -> Path:
    """A copy of a tiny model whose tokenizer adds `<s>` before a text and whose chat
    template shows a `greeting` variable."""
    shutil.copytree(src, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    bos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<s>")
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> Path:
    return with_bos_and_template(tiny_model(MODEL), tmp_path_factory.mktemp("extras") / "m")


@pytest.fixture(scope="module")
def live(model_dir):
    with serving(tiny_llm(model_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def flagged(model_dir):
    """A server started with vLLM's --return-tokens-as-token-ids,
    --enable-tokenizer-info-endpoint, --enable-server-load-tracking,
    --enable-force-include-usage, --root-path /llm, --reasoning-parser qwen3,
    --trust-request-chat-template and --max-logprobs -1."""
    with serving(
        tiny_llm(model_dir, max_logprobs=-1),
        return_tokens_as_token_ids=True,
        enable_tokenizer_info_endpoint=True,
        enable_server_load_tracking=True,
        enable_force_include_usage=True,
        root_path="/llm",
        reasoning_parser="qwen3",
        trust_request_chat_template=True,
    ) as server:
        yield server


def post(live: Live, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=120)


def ok(live: Live, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(live, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(live: Live, path: str, body: dict[str, Any], param: str, said: str) -> None:
    r = post(live, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and said in error["message"], error


def rendered(live: Live, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """What the model's tokenizer renders: the ground truth for /tokenize and the prompts."""
    tokenizer = live.llm.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)


def test_template_options_render_as_transformers_does(live):
    tokenizer = live.llm.tokenizer
    bos = tokenizer.convert_tokens_to_ids("<s>")
    assert special_tokens_around(tokenizer) == ([bos], [])
    body: dict[str, Any] = {"messages": CONVERSATION}
    assert ok(live, "/tokenize", body)["tokens"] == rendered(
        live, CONVERSATION, add_generation_prompt=True
    )
    cont = ok(live, "/tokenize", body | CONTINUE)["tokens"]
    assert cont == rendered(live, CONVERSATION, continue_final_message=True)
    assert tokenizer.decode(cont).endswith("the quick brown fox")  # left open
    greeted = ok(live, "/tokenize", body | {"chat_template_kwargs": {"greeting": "hello"}})
    assert greeted["tokens"] == rendered(
        live, CONVERSATION, add_generation_prompt=True, greeting="hello"
    )
    assert tokenizer.decode(greeted["tokens"]).startswith("hello\n")
    special = ok(live, "/tokenize", body | {"add_special_tokens": True})["tokens"]
    assert special == [bos, *rendered(live, CONVERSATION, add_generation_prompt=True)]
    # a prompt takes the BOS by default, a conversation not (vLLM's defaults)
    assert ok(live, "/tokenize", {"prompt": "the fox"})["tokens"][0] == bos
    assert (
        ok(live, "/tokenize", {"prompt": "the fox", "add_special_tokens": False})["tokens"][0]
        != bos
    )


def test_chat_renders_with_the_options_it_is_given(live):
    """The chat endpoint's prompt is the one /tokenize shows for the same options."""
    for options in (
        {},
        CONTINUE,
        {"chat_template_kwargs": {"greeting": "hi"}},
        {"add_special_tokens": True},
    ):
        body = {"messages": CONVERSATION, **options}
        usage = ok(live, "/v1/chat/completions", body | {"max_tokens": 1})["usage"]
        assert usage["prompt_tokens"] == ok(live, "/tokenize", body)["count"], options


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
            "not both",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "'tokenize'"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_template_options_that_contradict_are_refused(live, extra, param, said, path):
    refused(live, path, {"messages": CONVERSATION} | extra, param, said)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_starts_the_reply_with_the_message_it_continues(live, stream):
    body = {"messages": CONVERSATION, "max_tokens": 4, "temperature": 0, **CONTINUE}
    plain = ok(live, "/v1/chat/completions", body)["choices"][0]["message"]
    echoed = chat_text(live, body | {"echo": True, "stream": stream})
    assert plain["role"] == "assistant"
    assert echoed == "the quick brown fox" + plain["content"]
    # a new reply (add_generation_prompt) has a role the last message has not: nothing echoed
    body = {"messages": CONVERSATION[:1], "max_tokens": 4, "temperature": 0}
    assert chat_text(live, body | {"echo": True, "stream": stream}) == chat_text(live, body)


def chat_text(live: Live, body: dict[str, Any]) -> str:
    if not body.get("stream"):
        return ok(live, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    text = ""
    for chunk in sse_chunks(live, "/v1/chat/completions", body):
        for c in chunk["choices"]:
            text += c["delta"].get("content") or ""
    return text


def sse_chunks(live: Live, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", live.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
    return out


def test_custom_roles_unknown_message_fields_and_an_empty_model_name(live):
    base = {"max_tokens": 4, "temperature": 0}
    custom = ok(
        live, "/v1/chat/completions", base | {"messages": [{"role": "narrator", "content": "once"}]}
    )
    parts = [{"type": "text", "text": "on"}, {"type": "text", "text": "ce"}]
    as_parts = ok(
        live, "/v1/chat/completions", base | {"messages": [{"role": "narrator", "content": parts}]}
    )
    assert custom["choices"][0]["message"] == as_parts["choices"][0]["message"]
    prompt = ok(live, "/tokenize", {"messages": [{"role": "narrator", "content": "once"}]})[
        "tokens"
    ]
    assert "<|im_start|>narrator\nonce" in live.llm.tokenizer.decode(prompt)
    extra = [{"role": "narrator", "content": "once", "mood": "calm", "id": 7}]
    assert (
        ok(live, "/v1/chat/completions", base | {"messages": extra})["choices"] == custom["choices"]
    )
    named = ok(live, "/v1/chat/completions", base | {"messages": extra, "model": ""})
    assert named["model"] == "tiny" and named["choices"] == custom["choices"]
    r = post(live, "/v1/chat/completions", base | {"messages": [{"role": "", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"


def test_allowed_token_ids_limit_what_is_sampled(live):
    allowed = [40, 41, 42, 43]
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
    )
    out = live.llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    assert len(set(out.token_ids)) > 1  # sampled among them, not one forced token
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
    }
    served = ok(live, "/v1/completions", body | {"allowed_token_ids": allowed, "logprobs": 0})
    ids = live.llm.tokenizer.convert_tokens_to_ids(served["choices"][0]["logprobs"]["tokens"])
    assert ids == out.token_ids
    refused(
        live,
        "/v1/completions",
        body | {"allowed_token_ids": []},
        "allowed_token_ids",
        "at least one",
    )
    refused(
        live,
        "/v1/completions",
        body | {"allowed_token_ids": [10**6]},
        "allowed_token_ids",
        "in [0,",
    )


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_leave_no_token_are_the_requests_error(live, stream):
    """A choice that bad_words bans leaves no token to sample (a fuzzer's find): the request
    gets a 400 (streamed, an error event) naming its constraints, never the 503 of an engine
    fault, and the engine serves the next request."""
    body = {"prompt": "Say q", "max_tokens": 4, "guided_choice": ["q"], "bad_words": ["q"]}
    said = "rule out every token"
    if stream:
        events = sse_chunks(live, "/v1/completions", body | {"stream": True})
        assert any(said in e.get("error", {}).get("message", "") for e in events), events
    else:
        r = post(live, "/v1/completions", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and said in error["message"], error
    banned = SamplingParams(max_tokens=4, allowed_token_ids=[40], bad_words_token_ids=[[40]])
    with pytest.raises(RequestRejectedError, match=said):
        live.llm.generate([[5, 6, 7]], banned, use_tqdm=False)
    assert ok(live, "/v1/completions", body | {"bad_words": ["z"]})["choices"][0]["text"] == "q"


def test_guided_decoding_backend_names_our_grammar_engine(live):
    body = {"prompt": "pick", "max_tokens": 10, "temperature": 1.0, "seed": 1}
    for backend in ("xgrammar", "guidance", "outlines", "auto", "lm-format-enforcer"):
        text = ok(
            live,
            "/v1/completions",
            body | {"guided_choice": ["red", "blue"], "guided_decoding_backend": backend},
        )
        assert text["choices"][0]["text"] in ("red", "blue")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    # compact JSON with no properties but the schema's: it ends where the object does
    options = "xgrammar:disable-any-whitespace,disable-additional-properties"
    compact = body | {"max_tokens": 60, "guided_json": schema, "guided_decoding_backend": options}
    choice = ok(live, "/v1/completions", compact)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] in ('{"a":true}', '{"a":false}')
    for wrong in ("fast-json", "xgrammar:sideways"):
        refused(
            live,
            "/v1/completions",
            body | {"guided_decoding_backend": wrong},
            "guided_decoding_backend",
            "llguidance",
        )


def test_completion_logprobs_hold_the_sampled_token_first(live):
    body = {"prompt": "the quick", "max_tokens": 6, "temperature": 1.0, "seed": 5}
    for k in (0, 1, 3):
        lp = ok(live, "/v1/completions", body | {"logprobs": k})["choices"][0]["logprobs"]
        for token, logprob, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert next(iter(top.items())) == (token, logprob)
            assert len(top) in (max(k, 1), k + 1)
    chat = {"messages": CONVERSATION[:1], "max_tokens": 3, "logprobs": True, "top_logprobs": 0}
    content = ok(live, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    assert all(c["top_logprobs"] == [] for c in content)  # chat's top 0: none, as OpenAI's


def test_return_tokens_as_token_ids(live, flagged):
    body = {
        "prompt": "the quick brown",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    asked = ok(live, "/v1/completions", body | {"return_tokens_as_token_ids": True})["choices"][0]
    by_flag = ok(flagged, "/v1/completions", body)["choices"][0]
    assert asked["logprobs"] == by_flag["logprobs"]
    tokens = asked["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert live.llm.tokenizer.decode(ids, skip_special_tokens=True) == asked["text"]
    assert [next(iter(t)) for t in asked["logprobs"]["top_logprobs"][1:]] == tokens[1:]
    plain = ok(flagged, "/v1/completions", body | {"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"])
    chat = {"messages": CONVERSATION[:1], "max_tokens": 5, "temperature": 0, "logprobs": True}
    reply = ok(flagged, "/v1/chat/completions", chat)["choices"][0]
    ids = [int(c["token"].removeprefix("token_id:")) for c in reply["logprobs"]["content"]]
    assert live.llm.tokenizer.decode(ids) == reply["message"]["content"]


def test_prompt_logprobs_are_null_where_not_asked_for(live):
    completion = ok(live, "/v1/completions", {"prompt": "the", "max_tokens": 2})
    assert completion["choices"][0]["prompt_logprobs"] is None
    chat = ok(live, "/v1/chat/completions", {"messages": CONVERSATION[:1], "max_tokens": 2})
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(live, path):
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    body |= {"prompt": "the quick"} if path == "/v1/completions" else {"messages": CONVERSATION[:1]}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_chunks(live, path, body | {"stream_options": options})
    *running, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in running]
    assert counts == sorted(counts) and counts[-1] == 6
    prompt = last["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in running)
    assert all(
        c["usage"]["total_tokens"] == prompt + n for c, n in zip(running, counts, strict=True)
    )
    # without include_usage there is no usage to give (vLLM's rule)
    plain = sse_chunks(live, path, body | {"stream_options": {"continuous_usage_stats": True}})
    assert all(c.get("usage") is None for c in plain)


def test_tokenize_returns_token_strings_and_renders_tools(live):
    tokenizer = live.llm.tokenizer
    r = ok(live, "/tokenize", {"prompt": "the quick fox", "return_token_strs": True})
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    assert ok(live, "/tokenize", {"prompt": "the quick fox"})["token_strs"] is None
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    # the tools are shown in the template of the model's tool format, as chat shows them
    shown = ok(live, "/tokenize", {"messages": CONVERSATION[:1], "tools": [tool]})["tokens"]
    template = tool_format(tokenizer.chat_template).template()
    truth = tokenizer.apply_chat_template(
        CONVERSATION[:1],
        tools=[tool],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert shown == tokenizer.encode(truth, add_special_tokens=False)
    assert '"name": "f"' in truth
    refused(live, "/tokenize", {"prompt": "x", "tools": [tool]}, "tools", "messages")


def test_tokenizer_info_and_load_are_served_only_when_asked(live, flagged, model_dir):
    assert httpx.get(live.url + "/tokenizer_info").status_code == 404
    assert httpx.get(live.url + "/load").status_code == 404
    info = httpx.get(flagged.url + "/tokenizer_info").json()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] and info["chat_template"] == TEMPLATE
    assert (info["bos_token"], info["eos_token"]) == (config["bos_token"], config["eos_token"])
    for token_id, token in info["added_tokens_decoder"].items():
        assert live.llm.tokenizer.convert_ids_to_tokens(int(token_id)) == token["content"]
        assert isinstance(token["special"], bool)
    assert str(model_dir) not in json.dumps(info)  # no path of this machine
    assert httpx.get(flagged.url + "/load").json() == {"server_load": 0}
    seen: list[int] = []
    body = {"prompt": "the", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", flagged.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(lines)  # the stream runs
        seen.append(httpx.get(flagged.url + "/load").json()["server_load"])
        for _ in lines:
            pass
    assert seen == [1]
    assert httpx.get(flagged.url + "/load").json() == {"server_load": 0}


def test_invocations_answer_as_the_route_of_their_body(live):
    chat = {"messages": CONVERSATION[:1], "max_tokens": 5, "temperature": 0}
    completion = {"prompt": "the quick", "max_tokens": 5, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        via = ok(live, "/invocations", body)
        direct = ok(live, path, body)
        assert via["object"] == direct["object"] and via["choices"] == direct["choices"]
    streamed = sse_chunks(live, "/invocations", completion | {"stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed) == direct["choices"][0]["text"]
    refused(live, "/invocations", {"text": "hello"}, "messages", "input")
    r = post(live, "/invocations", {"input": "hello"})  # embeddings: this model does not embed
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
    r = post(live, "/invocations", {"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = httpx.post(
        live.url + "/invocations", content=b"{", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400


def test_llm_chat_renders_as_the_server_does(live):
    """vLLM's LLM.chat: one conversation or several, with the chat-template options."""
    llm = live.llm
    params = SamplingParams(temperature=0, max_tokens=4)
    for options, body in (
        ({}, {}),
        ({"add_generation_prompt": False, "continue_final_message": True}, CONTINUE),
        (
            {"chat_template_kwargs": {"greeting": "hello"}},
            {"chat_template_kwargs": {"greeting": "hello"}},
        ),
    ):
        prompt = ok(live, "/tokenize", {"messages": CONVERSATION} | body)["tokens"]
        expected = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert llm.chat(CONVERSATION, params, **options)[0].outputs[0].token_ids == expected
    both = llm.chat([CONVERSATION, CONVERSATION[:1]], params)
    assert [o.prompt_token_ids for o in both] == [
        rendered(live, CONVERSATION, add_generation_prompt=True),
        rendered(live, CONVERSATION[:1], add_generation_prompt=True),
    ]


def test_chat_template_flag_takes_a_file_or_the_template(model_dir, tmp_path):
    """vLLM's --chat-template: the template replaces the tokenizer's for every renderer."""
    shouted = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    file = tmp_path / "shout.jinja"
    file.write_text(shouted)
    for value in (str(file), shouted):
        llm = tiny_llm(model_dir, chat_template=value)
        ids = llm.chat_prompt(CONVERSATION[:1])
        assert llm.tokenizer.decode(ids) == "[USER] tell me a saying\n"
        with serving(llm) as server:
            assert ok(server, "/tokenize", {"messages": CONVERSATION[:1]})["tokens"] == ids
    with pytest.raises(PyptoError, match="neither a file nor a Jinja template"):
        tiny_llm(model_dir, chat_template=str(tmp_path / "missing.jinja"))


def test_generation_config_gives_the_defaults_requests_leave_out(model_dir, tmp_path):
    """vLLM's --generation-config: auto reads the model's generation_config.json, a directory
    names another, vllm applies none; a request's own values win."""
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3, "top_k": 5, "do_sample": True})
    )
    llm = tiny_llm(model_dir, generation_config=str(folder))
    assert llm.generation_defaults == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    assert llm.get_default_sampling_params().max_tokens == 3
    assert tiny_llm(model_dir).generation_defaults == {}  # auto: the tiny model sets none
    assert tiny_llm(model_dir, generation_config="vllm").generation_defaults == {}
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with serving(llm) as server:
        body = {"prompt": [5, 6, 7], "ignore_eos": True, "seed": 1}
        left_out = ok(server, "/v1/completions", body)["choices"][0]
        assert left_out["text"] == greedy[0].outputs[0].text  # greedy, 3 tokens
        own = ok(server, "/v1/completions", body | {"max_tokens": 5, "temperature": 1.0})
        assert own["usage"]["completion_tokens"] == 5
        chat = ok(
            server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "ignore_eos": True}
        )
        assert chat["usage"]["completion_tokens"] == 3
    (folder / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(PyptoError, match=r"generation_config\.json: invalid temperature"):
        tiny_llm(model_dir, generation_config=str(folder))
    with pytest.raises(PyptoError, match=r"holds no generation_config\.json"):
        tiny_llm(model_dir, generation_config=str(tmp_path))


def test_stop_strings_kept_special_tokens_shown_and_prompts_truncated(live):
    base = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 12, "seed": 7, "ignore_eos": True}
    plain = ok(live, "/v1/completions", base)["choices"][0]["text"]
    stop = next(  # two characters first seen after the text's start
        plain[i : i + 2] for i in range(1, len(plain) - 1) if plain.index(plain[i : i + 2]) == i
    )
    cut = ok(live, "/v1/completions", base | {"stop": [stop]})["choices"][0]["text"]
    kept = ok(live, "/v1/completions", base | {"stop": [stop], "include_stop_str_in_output": True})
    assert cut == plain[: plain.index(stop)]
    assert kept["choices"][0]["text"] == cut + stop
    # special tokens: left out by default, kept when asked (the model "writes" EOS here)
    eos = live.llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = base | {"max_tokens": 2, "allowed_token_ids": [eos]}
    assert ok(live, "/v1/completions", forced)["choices"][0]["text"] == ""
    shown = ok(live, "/v1/completions", forced | {"skip_special_tokens": False})
    assert shown["choices"][0]["text"] == "<|im_end|><|im_end|>"
    # truncate_prompt_tokens: the prompt's last k tokens, and only they
    last3 = ok(live, "/v1/completions", base | {"prompt": [8, 9, 10]})
    truncated = ok(live, "/v1/completions", base | {"truncate_prompt_tokens": 3, "echo": True})
    assert truncated["usage"]["prompt_tokens"] == 3
    echo = live.llm.tokenizer.decode([8, 9, 10])
    assert truncated["choices"][0]["text"] == echo + last3["choices"][0]["text"]
    chat = {"messages": CONVERSATION, "max_tokens": 2, "truncate_prompt_tokens": 5}
    assert ok(live, "/v1/chat/completions", chat)["usage"]["prompt_tokens"] == 5
    # truncation_side right: the first k instead
    ids = list(range(8, 16))
    cut = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True}
    for side, kept_ids in (("right", ids[:4]), ("left", ids[-4:])):
        choice = ok(live, "/v1/completions", cut | {"truncation_side": side})["choices"][0]
        assert choice["prompt_token_ids"] == kept_ids, side
    refused(
        live,
        "/v1/completions",
        base | {"truncate_prompt_tokens": 0},
        "truncate_prompt_tokens",
        "at least 1",
    )


def test_priority_orders_the_waiting_requests(model_dir):
    """One sequence at a time: behind a long request, a later request of lower priority value
    runs before an earlier one of higher value. Each waiting request decodes 24 tokens, so the
    second finishes 24 steps after the first: its client's clock cannot see them swapped (with
    2 tokens each, a loaded machine's threads once noted the two 0.3 ms out of order)."""
    with serving(tiny_llm(model_dir, max_num_seqs=1)) as server:
        finished: dict[str, float] = {}

        def run(name: str, priority: int) -> None:
            body = {"prompt": [5, 6], "max_tokens": 24, "ignore_eos": True, "priority": priority}
            ok(server, "/v1/completions", body)
            finished[name] = time.monotonic()

        long = {"prompt": [5], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=300) as r:
            lines = r.iter_lines()
            next(lines)  # the long request runs
            late = threading.Thread(target=run, args=("late", 5))
            late.start()
            waiting(server, 1)
            early = threading.Thread(target=run, args=("early", -1))
            early.start()
            waiting(server, 2)  # both wait behind the long one
            for _ in lines:
                pass
        late.join()
        early.join()
        assert finished["early"] < finished["late"]


def waiting(server: Live, n: int) -> None:
    """Until the server has n requests waiting."""
    deadline = time.monotonic() + patience(60)
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("pypto_num_requests_waiting{"))
        if float(line.split()[-1]) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{n} requests never waited")


def test_bad_words_are_never_generated(live):
    """Greedy output, then the same with its words banned: none of them comes back, and the
    tokens that would complete them are what the sampler refused (offline, the same)."""
    base = {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    plain = ok(live, "/v1/completions", base | {"logprobs": 0})["choices"][0]
    first = live.llm.tokenizer.decode(
        live.llm.tokenizer.convert_tokens_to_ids(plain["logprobs"]["tokens"][:1])
    )
    banned = ok(live, "/v1/completions", base | {"bad_words": [first]})["choices"][0]["text"]
    assert not banned.startswith(first)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=[first])
    out = live.llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.text == banned
    for word in live.llm.word_tokens([first]):  # no token sequence of the word was written
        n = len(word)
        assert all(out.token_ids[i : i + n] != word for i in range(len(out.token_ids)))
    from pypto_serving.ops.sampler import banned_by_words

    words = [[9], [3, 4, 5]]
    assert banned_by_words(words, [1, 3, 4]) == [9, 5]  # 3 4 then 5 would complete a word
    assert banned_by_words(words, [3, 4, 1]) == [9]
    refused(live, "/v1/completions", base | {"bad_words": [" "]}, "bad_words", "non-empty")


def test_request_ids_name_the_responses(live, model_dir):
    """vLLM's request_id (or the X-Request-Id header) makes the response's id; two requests
    of one id both run; --enable-request-id-headers echoes the header (or makes one)."""
    body = {"prompt": "the", "max_tokens": 2, "request_id": "job-7"}
    assert ok(live, "/v1/completions", body)["id"] == "cmpl-job-7"
    chat = {"messages": CONVERSATION[:1], "max_tokens": 2}
    r = httpx.post(live.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"})
    assert r.json()["id"] == "chatcmpl-abc" and "x-request-id" not in r.headers
    codes: list[int] = []  # one id, three requests at once: all answered

    def send() -> None:
        codes.append(post(live, "/v1/completions", body | {"max_tokens": 8}).status_code)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200, 200, 200]
    with serving(tiny_llm(model_dir), enable_request_id_headers=True) as server:
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "x1"})
        assert r.headers["x-request-id"] == "x1"
        made = httpx.get(server.url + "/health").headers["x-request-id"]
        assert len(made) == 32 and made != "x1"


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_give_the_prompt_and_each_choices_tokens(live, stream):
    tokenizer = live.llm.tokenizer
    prompt_ids = tokenizer.encode("the quick brown")
    body = {"prompt": "the quick brown", "max_tokens": 5, "temperature": 1, "seed": 3, "n": 2}
    body |= {"ignore_eos": True, "stream": stream}
    if stream:
        chunks = sse_chunks(live, "/v1/completions", body | {"return_token_ids": True})
        got: dict[int, dict[str, Any]] = {}
        for c in chunks:
            (one,) = c["choices"]
            mine = got.setdefault(one["index"], {"text": "", "ids": [], "prompts": []})
            mine["text"] += one["text"]
            mine["ids"] += one["token_ids"]
            mine["prompts"].append(one["prompt_token_ids"])
        assert sorted(got) == [0, 1]
        for mine in got.values():  # the prompt's ids in the choice's first chunk only
            assert mine["prompts"][0] == prompt_ids and not any(mine["prompts"][1:])
            assert len(mine["ids"]) == 5  # text is held back mid-character, never invented
            assert tokenizer.decode(mine["ids"], skip_special_tokens=True).startswith(mine["text"])
        plain = sse_chunks(live, "/v1/completions", body)
        assert all("token_ids" not in c["choices"][0] for c in plain)
        scored = body | {"return_token_ids": True, "prompt_logprobs": 1}  # scored first
        firsts: dict[int, list[Any]] = {}
        for c in sse_chunks(live, "/v1/completions", scored):
            (one,) = c["choices"]
            firsts.setdefault(one["index"], []).append(one["prompt_token_ids"])
        for ids in firsts.values():  # once a choice, in its first chunk
            assert ids[0] == prompt_ids and not any(ids[1:])
    else:
        choices = ok(live, "/v1/completions", body | {"return_token_ids": True})["choices"]
        for c in choices:
            assert c["prompt_token_ids"] == prompt_ids and len(c["token_ids"]) == 5
            assert tokenizer.decode(c["token_ids"], skip_special_tokens=True).startswith(c["text"])
        for c in ok(live, "/v1/completions", body)["choices"]:  # null when not asked for
            assert c["prompt_token_ids"] is None and c["token_ids"] is None
    chat = {"messages": CONVERSATION[:1], "max_tokens": 4, "ignore_eos": True, "stream": stream}
    rendered_ids = rendered(live, CONVERSATION[:1], add_generation_prompt=True)
    if stream:
        chunks = sse_chunks(live, "/v1/chat/completions", chat | {"return_token_ids": True})
        assert chunks[0]["prompt_token_ids"] == rendered_ids
        ids = [t for c in chunks for one in c["choices"] for t in one.get("token_ids", [])]
        text = "".join(one["delta"].get("content") or "" for c in chunks for one in c["choices"])
        assert len(ids) == 4 and tokenizer.decode(ids, skip_special_tokens=True).startswith(text)
    else:
        reply = ok(live, "/v1/chat/completions", chat | {"return_token_ids": True})
        assert reply["prompt_token_ids"] == rendered_ids
        choice = reply["choices"][0]
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True).startswith(
            choice["message"]["content"]
        )
        plain = ok(live, "/v1/chat/completions", chat)
        assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


def test_forced_usage_and_a_root_path(live, flagged):
    """--enable-force-include-usage: every stream ends with its usage; --root-path /llm: the
    API answers under the proxy's prefix as well as at its own paths."""
    body = {"prompt": "the", "max_tokens": 3, "ignore_eos": True, "stream": True}
    chat = {"messages": CONVERSATION[:1], "max_tokens": 3, "ignore_eos": True, "stream": True}
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        *running, last = sse_chunks(flagged, path, request)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        counts = [c["usage"]["completion_tokens"] for c in running]  # each chunk's so far
        assert counts == sorted(counts) and 0 < counts[-1] == 3
    assert all(c.get("usage") is None for c in sse_chunks(live, "/v1/completions", body))
    for path in ("/v1/models", "/llm/v1/models"):
        r = httpx.get(flagged.url + path)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", (path, r.text)
    assert httpx.get(live.url + "/llm/v1/models").status_code == 404


def test_the_engine_seed_makes_unseeded_sampling_repeat(model_dir):
    """vLLM's --seed: two engines started with one seed sample the same tokens for requests
    that bring no seed; another seed, other tokens."""
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def sampled(seed: int) -> list[list[int]]:
        llm = tiny_llm(model_dir, seed=seed)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(["the", "a b"], params)]
        finally:
            llm.close()

    first = sampled(5)
    assert sampled(5) == first
    assert sampled(6) != first


THINKING = {"regex": "<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n\n[a-z]{2,6}( [a-z]{2,6}){0,2}"}
"""A reply that thinks, then answers (a grammar makes the tiny model write one)."""


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_parser_splits_the_thinking_from_the_reply(live, flagged, stream):
    """--reasoning-parser qwen3: the thinking is the message's `reasoning`, the rest its
    content; the same split streamed or whole; include_reasoning false drops it; a server
    without the parser leaves the reply as written."""
    body = {"messages": CONVERSATION[:1], "max_tokens": 120, "temperature": 1, "seed": 4}
    body |= {"structured_outputs": THINKING, "stream": stream}

    def reply(server: Live, extra: dict[str, Any]) -> dict[str, Any]:
        if not stream:
            return ok(server, "/v1/chat/completions", body | extra)["choices"][0]["message"]
        whole: dict[str, Any] = {}
        for c in sse_chunks(server, "/v1/chat/completions", body | extra):
            for key, value in (c["choices"][0]["delta"] if c["choices"] else {}).items():
                if key in ("content", "reasoning") and value:
                    whole[key] = whole.get(key, "") + value
        return whole

    plain = reply(live, {})
    text = plain["content"]
    assert "reasoning" not in plain and text.startswith("<think>")
    thought, answer = text.removeprefix("<think>").split("</think>\n\n")
    split = reply(flagged, {})
    assert (split["reasoning"], split["content"]) == (thought, answer)
    left_out = reply(flagged, {"include_reasoning": False})
    assert left_out.get("reasoning") is None and left_out["content"] == answer
    no_thinking = {"structured_outputs": {"regex": "[a-z]{2,6}( [a-z]{2,6}){1,3}"}}
    answered = reply(flagged, no_thinking)
    assert answered.get("reasoning") is None and answered["content"]


def test_max_logprobs_bounds_requests_and_minus_one_is_the_whole_vocabulary(live, flagged):
    vocab = live.llm.engine.model_config.vocab_size
    body = {"prompt": "the quick", "max_tokens": 1, "temperature": 0}
    refused(live, "/v1/completions", body | {"logprobs": 21}, "logprobs", "must be in [0, 20]")
    refused(live, "/v1/completions", body | {"logprobs": -1}, "logprobs", "must be in [0, 20]")
    chat = {"messages": CONVERSATION[:1], "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    refused(live, "/v1/chat/completions", chat, "top_logprobs", "--max-logprobs")
    top = ok(flagged, "/v1/completions", body | {"logprobs": -1})["choices"][0]["logprobs"]
    assert len(top["top_logprobs"][0]) >= vocab - 1  # every token (decoding may merge a few)
    content = ok(flagged, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    assert len(content[0]["top_logprobs"]) == vocab
    scored = ok(flagged, "/v1/completions", body | {"prompt_logprobs": -1})["choices"][0]
    assert all(len(p) >= vocab - 1 for p in scored["prompt_logprobs"][1:])


def test_a_batch_of_conversations_answers_each_as_its_own_request(model_dir):
    """vLLM's /v1/chat/completions/batch: choice i is what conversation i alone gets (greedy,
    batch-invariant: the same tokens in any company), the usage their sum; streams, tools and
    n are refused."""
    with serving(tiny_llm(model_dir, batch_invariant=True)) as live:
        batch_of_conversations(live)


def batch_of_conversations(live: Live) -> None:
    conversations = [CONVERSATION[:1], [{"role": "user", "content": "a b c"}], CONVERSATION]
    common = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True}
    batch = ok(live, "/v1/chat/completions/batch", common | {"messages": conversations})
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    prompt_tokens = 0
    for conversation, choice in zip(conversations, batch["choices"], strict=True):
        alone = ok(live, "/v1/chat/completions", common | {"messages": conversation})
        assert choice["message"] == alone["choices"][0]["message"]
        mine, its = choice["logprobs"]["content"], alone["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in mine] == [t["token"] for t in its]
        # the tokens are the same bits; their logprobs' softmax runs over the step's rows
        assert [t["logprob"] for t in mine] == pytest.approx([t["logprob"] for t in its])
        prompt_tokens += alone["usage"]["prompt_tokens"]
    usage = batch["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, 15)
    assert usage["total_tokens"] == prompt_tokens + 15
    path = "/v1/chat/completions/batch"
    for extra, param in [({"stream": True}, "stream"), ({"n": 2}, "n")]:
        refused(live, path, {"messages": conversations} | extra, param, "batch")
    refused(live, path, {"messages": []}, "messages", "")
    refused(live, path, {"messages": [[]]}, "messages.0", "at least 1 item")


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_token_ids_give_those_tokens_logprobs(live, stream):
    """vLLM's logprob_token_ids: each position's top_logprobs are the named tokens' and the
    sampled one's, their values the model's own (as the plain top_logprobs have them)."""
    named = [5, 17, 40]
    body = {"messages": CONVERSATION[:1], "max_tokens": 3, "temperature": 0, "logprobs": True}
    body |= {"return_tokens_as_token_ids": True, "ignore_eos": True, "stream": stream}

    def positions(extra: dict[str, Any]) -> list[dict[str, Any]]:
        if not stream:
            reply = ok(live, "/v1/chat/completions", body | extra)
            return reply["choices"][0]["logprobs"]["content"]
        chunks = sse_chunks(live, "/v1/chat/completions", body | extra)
        pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        return [p for piece in pieces for p in (piece or {}).get("content") or []]

    def token_id(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    got = positions({"logprob_token_ids": named})
    vocab = live.llm.engine.model_config.vocab_size
    everything = positions({"top_logprobs": 20, "max_tokens": 3})
    assert len(got) == 3
    for p, full in zip(got, everything, strict=True):
        sampled = token_id(p["token"])
        tops = {token_id(t["token"]): t["logprob"] for t in p["top_logprobs"]}
        assert set(tops) == {sampled, *named} and len(p["top_logprobs"]) == len(tops)
        assert tops[sampled] == pytest.approx(p["logprob"])
        for t in full["top_logprobs"]:  # where a named token is among the 20 most likely
            if token_id(t["token"]) in tops:
                assert tops[token_id(t["token"])] == pytest.approx(t["logprob"], abs=1e-4)
    assert vocab > max(named)
    refused(
        live,
        "/v1/chat/completions",
        body | {"logprobs": False, "logprob_token_ids": named},
        "logprob_token_ids",
        "needs logprobs",
    )
    refused(
        live,
        "/v1/chat/completions",
        body | {"logprob_token_ids": [vocab]},
        "logprob_token_ids",
        f"must be in [0, {vocab})",
    )


def test_reasoning_effort_reaches_the_template_and_responses_take_vllms_extras(live):
    """Chat's reasoning_effort (and the Responses API's reasoning.effort) is the template's
    `reasoning_effort`, as vLLM gives it; the Responses API takes top_k."""
    chat = {"messages": CONVERSATION[:1], "max_tokens": 2, "return_token_ids": True}
    reply = ok(live, "/v1/chat/completions", chat | {"reasoning_effort": "low"})
    expected = rendered(live, CONVERSATION[:1], add_generation_prompt=True, reasoning_effort="low")
    assert reply["prompt_token_ids"] == expected
    assert expected != rendered(live, CONVERSATION[:1], add_generation_prompt=True)
    body = {"input": "the quick", "max_output_tokens": 6, "reasoning": {"effort": "low"}}
    top1 = ok(live, "/v1/responses", body | {"top_k": 1, "temperature": 1.0})
    greedy = ok(live, "/v1/responses", body | {"temperature": 0})
    assert top1["output"][0]["content"][0]["text"] == greedy["output"][0]["content"][0]["text"]


def test_a_requests_own_chat_template_only_where_the_server_trusts_it(live, flagged):
    """vLLM's chat_template field: the conversation rendered in the request's template (chat
    and /tokenize), where the server was started with --trust-request-chat-template; else a
    400 naming the flag."""
    template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    body = {"messages": CONVERSATION[:1], "max_tokens": 2, "return_token_ids": True}
    expected = live.llm.tokenizer.encode("[user: tell me a saying]", add_special_tokens=False)
    reply = ok(flagged, "/v1/chat/completions", body | {"chat_template": template})
    assert reply["prompt_token_ids"] == expected
    tokens = ok(flagged, "/tokenize", {"messages": CONVERSATION[:1], "chat_template": template})
    assert tokens["tokens"] == expected
    asked = {"messages": CONVERSATION[:1]}
    for path, request in (("/v1/chat/completions", body), ("/tokenize", asked)):
        refused(
            live,
            path,
            request | {"chat_template": template},
            "chat_template",
            "--trust-request-chat-template",
        )
