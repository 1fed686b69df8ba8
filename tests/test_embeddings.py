"""Embeddings (issue 45, item 5): `LLM.embed` and `/v1/embeddings` equal HF transformers'
pooled hidden states (fp32, within 1e-4) for a Qwen3-Embedding-style model (last-token
pooling, by its sentence-transformers config) and a mean-pooling one, and for any model under
`runner="pooling"`; `dimensions`, normalisation, token-id inputs, base64 vectors (the openai
SDK's default) and the refusals.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from checkpoints import build_embedding_model
from live_server import serving, tiny_llm

from pypto_serving import PoolingParams
from pypto_serving.errors import PyptoError

TEXTS = ["the quick brown fox", "hello world, what is the capital of france?"]


def hf_pooled(model_dir, text: str, pooling: str) -> torch.Tensor:
    """HF's final hidden states of the text, pooled (not normalised): the ground truth."""
    from transformers import AutoModel, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(ids).last_hidden_state[0]
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return build_embedding_model(tmp_path_factory.mktemp("embed"))


@pytest.mark.parametrize(("declared", "pooling"), [("lasttoken", "last"), ("mean_tokens", "mean")])
def test_an_embedding_models_vectors_equal_hfs(tmp_path, declared, pooling):
    path = build_embedding_model(tmp_path, declared)
    llm = tiny_llm(path)
    assert llm.pooling_rule == pooling
    for text, out in zip(TEXTS, llm.embed(TEXTS), strict=True):
        truth = torch.nn.functional.normalize(hf_pooled(path, text, pooling), dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), truth, atol=1e-4, rtol=0)
    raw = llm.embed(TEXTS[0], PoolingParams(normalize=False, dimensions=16))[0]
    truth = hf_pooled(path, TEXTS[0], pooling)[:16]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), truth, atol=1e-4, rtol=0)
    llm.close()


def test_runner_pooling_embeds_any_model_and_only_then(tiny_model):
    path = tiny_model("llama-gqa4-tied")
    with pytest.raises(PyptoError, match="runner 'pooling'") as e:
        tiny_llm(path).embed("hi")
    assert e.value.param == "runner"
    llm = tiny_llm(path, runner="pooling")
    out = llm.embed(TEXTS[1], PoolingParams(pooling_type="cls"))[0].outputs.embedding
    truth = torch.nn.functional.normalize(hf_pooled(path, TEXTS[1], "cls"), dim=0)
    torch.testing.assert_close(torch.tensor(out), truth, atol=1e-4, rtol=0)
    last = llm.embed(TEXTS[1])[0].outputs.embedding  # the runner's rule: the last token
    truth = torch.nn.functional.normalize(hf_pooled(path, TEXTS[1], "last"), dim=0)
    torch.testing.assert_close(torch.tensor(last), truth, atol=1e-4, rtol=0)
    assert llm.generate("hi")[0].outputs[0].token_ids  # it still generates
    llm.close()


def test_the_embeddings_endpoint(embedder, tiny_model):
    llm = tiny_llm(embedder)
    offline = [o.outputs.embedding for o in llm.embed(TEXTS)]
    with serving(llm, "embedder") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        sdk = client.embeddings.create(model="embedder", input=TEXTS)  # base64 on the wire
        got = [d.embedding for d in sdk.data]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(offline), atol=1e-6, rtol=0)
        prompt_tokens = sum(len(llm.encode(t)) for t in TEXTS)
        assert sdk.usage.prompt_tokens == sdk.usage.total_tokens == prompt_tokens
        body = {"model": "embedder", "input": TEXTS[0], "encoding_format": "float", "dimensions": 8}
        r = httpx.post(live.url + "/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 200, r.text
        short = r.json()["data"][0]["embedding"]
        expected = llm.embed(TEXTS[0], PoolingParams(dimensions=8))[0].outputs.embedding
        assert len(short) == 8 and short == pytest.approx(expected, abs=1e-6)
        ids = llm.encode(TEXTS[1])
        by_ids = httpx.post(live.url + "/v1/embeddings", json={"input": [ids]}, timeout=60).json()
        assert by_ids["data"][0]["embedding"] == pytest.approx(offline[1], abs=1e-6)
        for bad, param in (
            ({"input": []}, "input"),
            ({"input": "x", "dimensions": 10_000}, "dimensions"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ({"input": [[10**7]]}, "input"),
        ):
            r = httpx.post(live.url + "/v1/embeddings", json=bad, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert httpx.get(live.url + "/health").status_code == 200
    with serving(tiny_llm(tiny_model("llama-gqa4-tied"))) as live:
        r = httpx.post(live.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"


def test_score_and_rerank_are_the_embeddings_cosines(embedder, tiny_model):
    llm = tiny_llm(embedder)
    query, docs = "the capital of france", ["paris is", "the quick brown fox", "hello world"]
    vectors = {
        t: torch.tensor(o.outputs.embedding)
        for t, o in zip([query, *docs], llm.embed([query, *docs]), strict=True)
    }
    cosine = {d: float(vectors[query] @ vectors[d]) for d in docs}
    with serving(llm, "embedder") as live:
        r = httpx.post(live.url + "/score", json={"text_1": query, "text_2": docs}, timeout=60)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(
            [cosine[d] for d in docs], abs=1e-5
        )
        pairs = {"text_1": [query, docs[1]], "text_2": [docs[0], docs[2]]}
        r = httpx.post(live.url + "/v1/score", json=pairs, timeout=60).json()
        expected = [cosine[docs[0]], float(vectors[docs[1]] @ vectors[docs[2]])]
        assert [d["score"] for d in r["data"]] == pytest.approx(expected, abs=1e-5)
        ranked = httpx.post(
            live.url + "/rerank", json={"query": query, "documents": docs, "top_n": 2}, timeout=60
        ).json()["results"]
        best = sorted(docs, key=lambda d: -cosine[d])[:2]
        assert [x["document"]["text"] for x in ranked] == best
        assert [x["index"] for x in ranked] == [docs.index(d) for d in best]
        assert [x["relevance_score"] for x in ranked] == pytest.approx(
            [cosine[d] for d in best], abs=1e-5
        )
        bad = {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}
        r = httpx.post(live.url + "/score", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
    with serving(tiny_llm(tiny_model("llama-gqa4-tied"))) as live:
        r = httpx.post(live.url + "/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
