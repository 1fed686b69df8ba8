"""Schemathesis against the live server's /openapi.json: no generated request gets a 5xx.

Every operation is fuzzed with MAX_EXAMPLES generated requests (schema-valid and invalid
ones, from schemathesis's strategies, run by hypothesis here); an operation without inputs
has one possible request, which is sent. Half the generated bodies are steered toward what
the engine takes (the served model's name, token ids inside the vocabulary), so the fuzz
reaches generation and not only validation. The engine is a tiny random model with a short
context, so any max_tokens stays cheap, and one torch thread (on a busy 2-core machine, a
thread per core made some steps 10-20x slower).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import Live, serving, tiny_llm
from patience import patience
from schemathesis import APIOperation, BaseSchema, Case, GenerationMode
from schemathesis.checks import not_a_server_error

MODEL = "llama-gqa4-tied"
MAX_EXAMPLES = 100
MAX_MODEL_LEN = 32
API_KEY = "fuzz-key"
OPERATIONS = {
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/chat/completions/batch",
    "POST /v1/responses",
    "POST /v1/embeddings",
    "POST /score",
    "POST /rerank",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /invocations",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /metrics",
    "GET /version",
    "GET /stats",
}
TOKEN_FIELDS = ("prompt", "tokens", "stop_token_ids")
CALLS: Counter[str] = Counter()
"""Requests sent per operation in this session."""


def fold(value: Any, vocab: int) -> Any:
    """`value` with every integer in it folded into [0, vocab)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value % vocab
    if isinstance(value, list):
        return [fold(v, vocab) for v in value]
    return value


def steer(body: Any, model: str, vocab: int) -> Any:
    """`body` with the served model's name and token ids the engine accepts."""
    if not isinstance(body, dict):
        return body
    out = {**body, **{k: fold(body[k], vocab) for k in TOKEN_FIELDS if k in body}}
    if "model" in out:
        out["model"] = model
    return out


@pytest.fixture(scope="module")
def live(tiny_model: Any) -> Iterator[Live]:
    llm = tiny_llm(tiny_model(MODEL), max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_threads=1)
    with serving(llm, api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def auth_headers() -> dict[str, str]:
    """Headers every request carries: the server needs its API key on every route but /health."""
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def api_schema(live: Live, auth_headers: dict[str, str]) -> BaseSchema:
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json", headers=dict(auth_headers))


def cases(operation: APIOperation, vocab: int, model: str) -> st.SearchStrategy[Case]:
    """Schema-valid and invalid requests for `operation` (invalid ones where it takes inputs),
    half of those with a body steered toward what the engine takes."""
    modes = [GenerationMode.POSITIVE]
    if operation.body or operation.path_parameters or operation.query:
        modes.append(GenerationMode.NEGATIVE)
    generated = st.one_of(*(operation.as_strategy(generation_mode=m) for m in modes))

    def steered(case: Case, steer_it: bool) -> Case:
        if steer_it and operation.body:
            case.body = steer(case.body, model, vocab)
        return case

    return st.builds(steered, generated, st.booleans())


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_server_errors(
    live: Live, api_schema: BaseSchema, auth_headers: dict[str, str], label: str
) -> None:
    """Schemathesis's generated requests through hypothesis, driven here (its pytest plugin
    reaches into pytest's internals, which change between releases)."""
    operations = {op.ok().label: op.ok() for op in api_schema.get_all_operations()}
    operation = operations[label]
    vocab = live.llm.engine.model_config.vocab_size
    takes_inputs = bool(operation.body or operation.path_parameters or operation.query)

    @given(case=cases(operation, vocab, live.model))
    @settings(
        max_examples=MAX_EXAMPLES if takes_inputs else 1,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Case) -> None:
        CALLS[label] += 1
        case.call_and_validate(
            headers=auth_headers, checks=[not_a_server_error], timeout=patience(60)
        )

    fuzz()


@pytest.mark.slow
def test_engine_alive_and_every_operation_fuzzed(live: Live, api_schema: BaseSchema) -> None:
    """After the fuzzing: the engine is alive and every operation got its examples."""
    labels = {op.ok().label for op in api_schema.get_all_operations()}
    assert labels == OPERATIONS, "a route was added or removed: update OPERATIONS"
    assert httpx.get(f"{live.url}/health").status_code == 200
    if not CALLS:
        pytest.skip("the fuzz test did not run in this session")
    for op in api_schema.get_all_operations():
        operation = op.ok()
        wanted = MAX_EXAMPLES // 2 if operation.body else 1  # hypothesis stops early on repeats
        assert CALLS[operation.label] >= wanted, (operation.label, CALLS[operation.label])
