"""/v1/embeddings (OpenAI's, with vLLM's extras): each input's embedding (pooling.py), for a
model that embeds (an embedding model by its files, or any model under --runner pooling); and
vLLM's /score and /rerank over the same vectors (a bi-encoder's scores: the cosine similarity
of two texts' embeddings).

Inputs are a string, a list of strings, token ids, or a list of token id lists; each is
embedded on the engine's thread between two generation steps. `encoding_format: base64`
gives each vector as its float32 little-endian bytes in base64 (what the openai SDK asks
for by default, and decodes).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Annotated, Any, Literal

import torch
from fastapi import Request
from fastapi.responses import Response
from pydantic import BeforeValidator, Field, StrictStr

from pypto_serving.errors import PyptoError
from pypto_serving.pooling import PoolingParams
from pypto_serving.server.errors import APIError
from pypto_serving.server.openai_serving import OpenAIServing, unless_disconnected
from pypto_serving.server.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    PromptInput,
    _Request,
    few_prompts,
    keep_last,
    prompt_list,
)
from pypto_serving.server.response_size import render_json


class EmbeddingRequest(_Request):
    model: str | None = None
    input: Annotated[PromptInput, BeforeValidator(few_prompts("input"))]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """The first this many values of each vector (a Matryoshka model's shorter vectors)."""
    user: StrictStr | None = None
    """Accepted for compatibility (an end-user id); it changes nothing."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """vLLM's: only each input's last k tokens (-1: as many as the context takes)."""
    normalize: bool = True
    """vLLM's: scale each vector to unit length (false: the pooled hidden state as it is)."""
    add_special_tokens: bool = True
    """vLLM's: the tokenizer's special tokens added around a text input."""

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


class ScoreRequest(_Request):
    """vLLM's /score: text_1 against each of text_2 (one to many), or pairwise (equal lists)."""

    model: str | None = None
    text_1: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    text_2: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], t) for t in second]
        if len(first) != len(second):
            raise PyptoError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or "
                "as many as text_2 (scored in pairs)",
                "text_2",
            )
        return list(zip(first, second, strict=True))


class RerankRequest(_Request):
    """vLLM's (Jina's and Cohere's) /rerank: the documents ordered by their score against the
    query."""

    model: str | None = None
    query: StrictStr
    documents: Annotated[list[StrictStr], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] = 0
    """The best this many (0: all)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


class EmbeddingsServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _params(self, given: PoolingParams) -> PoolingParams:
        """`given` as the model embeds; a 400 naming the model where it does not embed."""
        try:
            return self.serving.engine.llm.pooling_params(given)
        except PyptoError as e:
            if e.param != "runner":
                raise
            raise APIError(400, str(e), param="model", code="model_not_embedding") from None

    async def _token_ids(
        self, texts: list[str | list[int]], special: bool, truncate: int | None, param: str
    ) -> list[list[int]]:
        if len(texts) > MAX_SEQUENCES_PER_REQUEST:
            raise PyptoError(
                f"{len(texts)} inputs are over the limit of {MAX_SEQUENCES_PER_REQUEST}", param
            )
        ids = await self.serving.encode(texts, special, param)
        limit = self.serving.engine.engine.max_model_len
        return [keep_last(p, truncate, limit) for p in ids]

    async def _vectors(self, ids: list[list[int]], params: PoolingParams) -> list[list[float]]:
        return [await self.serving.engine.embed(p, params) for p in ids]

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        serving = self.serving
        name = serving.check_model(body.model)
        params = self._params(PoolingParams(normalize=body.normalize, dimensions=body.dimensions))
        texts = body.inputs()
        ids = await self._token_ids(
            texts, body.add_special_tokens, body.truncate_prompt_tokens, "input"
        )

        async def embed() -> Response:
            vectors = await self._vectors(ids, params)
            data = [
                {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ]
            tokens = sum(map(len, ids))
            whole: dict[str, Any] = {
                "object": "list",
                "data": data,
                "model": name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return Response(render_json(whole), media_type="application/json")

        return await unless_disconnected(raw, embed())

    async def _scores(
        self, pairs: list[tuple[str, str]], truncate: int | None, param: str
    ) -> tuple[list[float], int]:
        """Each pair's cosine similarity, and the tokens embedded (each distinct text once)."""
        params = self._params(PoolingParams(normalize=True))
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        ids = await self._token_ids(list(texts), True, truncate, param)
        row = {text: i for i, text in enumerate(texts)}
        matrix = torch.tensor(await self._vectors(ids, params), dtype=torch.float64)
        left = matrix[[row[a] for a, _ in pairs]]
        right = matrix[[row[b] for _, b in pairs]]
        return (left * right).sum(dim=-1).tolist(), sum(map(len, ids))

    async def score(self, body: ScoreRequest, raw: Request) -> Response:
        name = self.serving.check_model(body.model)
        pairs = body.pairs()

        async def run() -> Response:
            scores, tokens = await self._scores(pairs, body.truncate_prompt_tokens, "text_1")
            whole = {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return Response(render_json(whole), media_type="application/json")

        return await unless_disconnected(raw, run())

    async def rerank(self, body: RerankRequest, raw: Request) -> Response:
        name = self.serving.check_model(body.model)

        async def run() -> Response:
            pairs = [(body.query, d) for d in body.documents]
            scores, tokens = await self._scores(pairs, body.truncate_prompt_tokens, "documents")
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            if body.top_n:
                order = order[: body.top_n]
            results = [
                {
                    "index": i,
                    "document": {"text": body.documents[i]},
                    "relevance_score": scores[i],
                }
                for i in order
            ]
            whole = {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": name,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
            return Response(render_json(whole), media_type="application/json")

        return await unless_disconnected(raw, run())


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
