"""Schemathesis against the live server's /openapi.json: no generated request gets a 5xx.

Every operation is fuzzed with MAX_EXAMPLES generated requests (schema-valid and invalid
ones, plus schemathesis's coverage cases); an operation without inputs has one possible
request, which is sent. Half the generated bodies are steered toward what the engine takes
(the served model's name, token ids inside the vocabulary), so the fuzz reaches generation
and not only validation. The engine is a tiny random model with a short context, so any
max_tokens stays cheap, and one torch thread (on a busy 2-core machine, a thread per core
made some steps 10-20x slower).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from live_server import Live, serving, tiny_llm
from patience import patience
from schemathesis import BaseSchema
from schemathesis.checks import not_a_server_error

MODEL = "llama-gqa4-tied"
MAX_EXAMPLES = 100
MAX_MODEL_LEN = 32
API_KEY = "fuzz-key"
OPERATIONS = {
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /metrics",
    "GET /version",
    "GET /stats",
}
TOKEN_FIELDS = ("prompt", "tokens", "stop_token_ids")
CALLS: Counter[tuple[str, str]] = Counter()
"""Requests sent per (operation, schemathesis phase) in this session."""


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
    loaded = schemathesis.openapi.from_url(f"{live.url}/openapi.json", headers=dict(auth_headers))
    vocab = live.llm.engine.model_config.vocab_size

    @loaded.hook
    def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
        return st.sampled_from([body, steer(body, live.model, vocab)])

    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case: schemathesis.Case, auth_headers: dict[str, str]) -> None:
    CALLS[case.operation.label, case.meta.phase.name.value] += 1
    case.call_and_validate(headers=auth_headers, checks=[not_a_server_error], timeout=patience(60))


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
        fuzzed = CALLS[operation.label, "fuzzing"]
        assert fuzzed >= (MAX_EXAMPLES if operation.body else 1), (operation.label, fuzzed)
