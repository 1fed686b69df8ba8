"""Structured outputs (issue 27): a JSON schema, any JSON object, a regex, a choice or a grammar
constrains what is sampled (grammar.py, llguidance), offline and through the OpenAI API.

Ground truth: every output parses and validates (`jsonschema`, `re.fullmatch`); a constrained
request gives the same tokens alone, in a batch beside free requests, after a prefix hit and
through preemption; free requests are unchanged by constrained ones beside them."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from checkpoints import build_hermes_model, token_ids
from live_server import serving, tiny_llm

from pypto_serving import grammar
from pypto_serving.errors import PyptoError
from pypto_serving.ops.sampler import SamplingRow, mask_disallowed
from pypto_serving.sampling import SamplingParams, StructuredOutputsParams

MODEL = "llama-gqa4-tied"
SMALL = {  # what a tiny random model finishes within a few dozen tokens
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 40},
        "kind": {"enum": ["fox", "dog", 3]},
        "tag": {"type": "string", "maxLength": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "kind", "tag"],
    "additionalProperties": False,
}
REGEX = r"(the|a) (quick|lazy) [a-z]{2,6}!"
TOO_BIG = (  # 5,000 rules of 10 symbols, under the 200,000 characters a spec may have
    "start: "
    + " | ".join(f"r{i}" for i in range(5000))
    + "".join(f"\nr{i}: A A A A A A A A A A" for i in range(5000))
    + '\nA: "a"\n'
)


def test_exactly_one_constraint_and_clear_refusals():
    with pytest.raises(PyptoError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(PyptoError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(PyptoError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(PyptoError, match=r"invalid structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})  # type: ignore[arg-type]
    refusals = {
        '"uniqueItems"': {"type": "array", "uniqueItems": True},
        '"if", "then"': {"type": "object", "if": {}, "then": {}},
        "Invalid type: strin": {"type": "strin"},
    }
    for said, schema in refusals.items():
        with pytest.raises(PyptoError, match=f"cannot be enforced: .*{re.escape(said)}") as e:
            grammar.check(StructuredOutputsParams(json=schema))
        assert e.value.param == "structured_outputs"
    with pytest.raises(PyptoError, match="unclosed group"):
        grammar.check(StructuredOutputsParams(regex="(ab"))
    with pytest.raises(PyptoError, match="cannot be enforced"):
        grammar.check(StructuredOutputsParams(grammar="start: undefined_rule"))


def test_the_mask_leaves_only_allowed_tokens():
    logits = torch.arange(70, dtype=torch.float32).repeat(2, 1)
    words = torch.zeros(3, dtype=torch.int32)
    words[0], words[2] = 1 << 3, 1 << 1  # tokens 3 and 65
    rows = [
        SamplingRow(SamplingParams(), [1], [], None, (), words),
        SamplingRow(SamplingParams(), [1], [], None),
    ]
    out = mask_disallowed(logits, rows)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 65]
    assert torch.equal(out[1], logits[1]) and torch.equal(logits[0], torch.arange(70.0))


@pytest.fixture(scope="module")
def llm(tiny_model):
    with tiny_llm(tiny_model(MODEL)) as llm:
        yield llm


def _texts(llm, prompts, params):
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_every_kind_of_constraint_holds_offline(llm):
    prompts = ["the quick brown", "hello world", "paris is"]
    kinds = {
        "json": StructuredOutputsParams(json=SMALL, whitespace=False),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=["paris", "the lazy dog", "?"]),
        "grammar": StructuredOutputsParams(grammar='start: "say " ("yes" | "no") "."'),
    }
    for kind, spec in kinds.items():
        for temperature, n in ((0, 1), (1.0, 3)):
            params = SamplingParams(
                temperature=temperature, n=n, seed=5, max_tokens=80, structured_outputs=spec
            )
            for out in llm.generate(prompts, params, use_tqdm=False):
                for sample in out.outputs:
                    assert sample.finish_reason == "stop", (kind, sample.text)
                    text = sample.text
                    if kind == "json":
                        jsonschema.validate(json.loads(text), SMALL)
                    elif kind == "regex":
                        assert re.fullmatch(REGEX, text), text
                    elif kind == "choice":
                        assert text in spec.choice, text  # type: ignore[operator]
                    else:
                        assert text in ("say yes.", "say no."), text


def test_constrained_requests_are_as_alone_in_a_batch_after_a_hit_and_preempted(tiny_model):
    """Greedy: each request's tokens alone = in a batch mixing constrained and free requests,
    = after its prompt's prefix was cached, = through preemption (a pool too small for all)."""
    system = [(11 * j) % 300 + 3 for j in range(37)]
    prompts = [[*system, 5 + i] for i in range(6)]
    specs = [
        StructuredOutputsParams(regex=REGEX),
        None,
        StructuredOutputsParams(json=SMALL, whitespace=False),
        None,
        StructuredOutputsParams(choice=["fox", "the lazy dog"]),
        StructuredOutputsParams(regex="[a-z ]{10,30}"),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, structured_outputs=s)
        for s in specs
    ]
    with tiny_llm(tiny_model(MODEL), num_kv_pages=64) as llm:
        alone = [
            token_ids(llm.generate([p], q, use_tqdm=False))[0]
            for p, q in zip(prompts, params, strict=False)
        ]
        again = [
            token_ids(llm.generate([p], q, use_tqdm=False))[0]
            for p, q in zip(prompts, params, strict=False)
        ]
        assert llm.engine.stats().prefix_hits > 0
    assert again == alone
    with tiny_llm(tiny_model(MODEL), num_kv_pages=14) as llm:
        families = [llm.add(p, q) for p, q in zip(prompts, params, strict=False)]
        while any(not f.finished for f in families):
            llm.step()
        together = [f.output().outputs[0].token_ids for f in families]
        assert llm.engine.stats().num_preemptions > 0
    assert together == alone
    assert alone[1] != alone[0][: len(alone[1])]  # the constraint changed what was sampled


@pytest.fixture(scope="module")
def client(llm):
    with serving(llm) as live:
        yield live, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_the_api_takes_response_format_structured_outputs_and_guided_fields(client):
    _live, api = client
    messages = [{"role": "user", "content": "the quick brown"}]
    # a random model fills JSON's whitespace as far as it may: compact JSON here (the default
    # model's response_format test, below, has whitespace as the model likes)
    compact = {"structured_outputs": {"json": SMALL, "disable_any_whitespace": True}}
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=messages, max_tokens=100, temperature=1.0, seed=4)
        if stream:
            chunks = api.chat.completions.create(**kwargs, stream=True, extra_body=compact, n=2)
            texts = ["", ""]
            for c in chunks:
                for choice in c.choices:
                    texts[choice.index] += choice.delta.content or ""
        else:
            out = api.chat.completions.create(**kwargs, extra_body=compact, n=2)
            texts = [c.message.content or "" for c in out.choices]
        for text in texts:
            jsonschema.validate(json.loads(text), SMALL)
    obj = api.completions.create(
        model="tiny",
        prompt="a b",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert obj.choices[0].finish_reason in ("stop", "length")
    for extra, check in (
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_choice": ["fox", "dog"]}, lambda t: t in ("fox", "dog")),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ):
        out = api.completions.create(
            model="tiny", prompt="a b", max_tokens=40, temperature=0, extra_body=extra
        )
        assert check(out.choices[0].text), (extra, out.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
        ({"guided_grammar": "start: nothing"}, "guided_grammar", "cannot be enforced"),
        (  # over the work limits (50,000 symbols): refused before any step runs it
            {"structured_outputs": {"grammar": TOO_BIG}},
            "structured_outputs",
            "grammar size (number of symbols) too big",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
            "structured_outputs",
            "give one of",
        ),
    ],
)
def test_a_grammar_that_cannot_be_enforced_is_a_400_naming_it(client, extra, param, said):
    live, api = client
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 4} | extra
    r = httpx.post(live.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and said in error["message"], error
    ok = api.completions.create(  # still serving (a random model may sample EOS: ignored)
        model="tiny", prompt="a b", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 3


def _obj(required: bool = True, **props: object) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required else [],
        "additionalProperties": False,
    }


TEXT = {"type": "string", "maxLength": 40}
SCHEMAS = [  # of increasing difficulty; strings bounded so that every answer ends
    _obj(answer=TEXT),
    _obj(year={"type": "integer", "minimum": 1000, "maximum": 2100}),
    _obj(celsius={"type": "number", "minimum": -50, "maximum": 60}),
    _obj(capital={"type": "boolean"}, continent={"enum": ["Europe", "Asia", "Africa"]}),
    _obj(cities={"type": "array", "items": TEXT, "minItems": 2, "maxItems": 4}),
    _obj(code={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    {**_obj(name=TEXT, nickname=TEXT), "required": ["name"]},  # an optional field
    _obj(person=_obj(name=TEXT, age={"type": "integer", "minimum": 0, "maximum": 120})),
    _obj(value={"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}),
    _obj(
        items={
            "type": "array",
            "items": _obj(name=TEXT, qty={"type": "integer", "minimum": 1, "maximum": 9}),
            "minItems": 1,
            "maxItems": 3,
        }
    ),
    _obj(word={"type": "string", "minLength": 3, "maxLength": 8}, count={"type": "integer"}),
    {
        "$defs": {"point": _obj(x={"type": "integer"}, y={"type": "integer"})},
        **_obj(start={"$ref": "#/$defs/point"}, end={"$ref": "#/$defs/point"}),
    },
    _obj(
        grid={
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
            "minItems": 2,
            "maxItems": 2,
        }
    ),
    _obj(status={"const": "ok"}, note={"type": ["string", "null"], "maxLength": 30}),
    _obj(
        city=TEXT,
        country=_obj(name=TEXT, code={"type": "string", "pattern": "^[A-Z]{2}$"}),
        sights={"type": "array", "items": TEXT, "maxItems": 3},
        population={"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
    ),
]


def bounded(schema: object) -> object:
    """A copy of schema whose numbers without a maximum take -999..999: a random model never
    ends a number that may have any number of digits."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    if out.get("type") in ("integer", "number") and "maximum" not in out:
        out |= {"minimum": -999, "maximum": 999}
    return out


def answer_every_schema(url: str, model: str, schemas: list, max_tokens: int) -> None:
    """Each schema once through the openai client, the runs spread over streaming or not, n 1
    or 3, temperature 0 or 1 (all sent at once: one batch): every answer parses and validates."""
    from concurrent.futures import ThreadPoolExecutor

    assert len(schemas) >= 15
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def ask(i: int) -> list[str]:
        kwargs: dict = dict(
            model=model,
            messages=[{"role": "user", "content": "Tell me about Paris, as JSON."}],
            max_tokens=max_tokens,
            temperature=float(i % 2),
            seed=i,
            n=1 if i % 4 < 2 else 3,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True},
            },
        )
        if i % 8 < 4:
            out = api.chat.completions.create(**kwargs)
            return [c.message.content or "" for c in out.choices]
        texts = [""] * kwargs["n"]
        for chunk in api.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        return texts

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    for schema, texts in zip(schemas, answers, strict=True):
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_a_tiny_qwen3_answers_fifteen_schemas_through_the_openai_client(tmp_path):
    """Another architecture and tokenizer (Qwen's, with added tokens); its random weights
    fill every whitespace gap, hence the room (1,500 tokens) and the bounded numbers."""
    out = build_hermes_model(tmp_path)
    with tiny_llm(out, num_kv_pages=2048) as llm, serving(llm, "tiny") as live:
        answer_every_schema(live.url, "tiny", [bounded(s) for s in SCHEMAS], 1500)


@pytest.mark.slow
def test_the_default_model_answers_fifteen_schemas_through_the_openai_client():
    from pypto_serving import LLM

    with LLM("default", enforce_eager=True) as llm, serving(llm, "SmolLM2") as live:
        answer_every_schema(live.url, "SmolLM2", SCHEMAS, 300)
