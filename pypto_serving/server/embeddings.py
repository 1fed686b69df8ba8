"""/v1/embeddings (OpenAI's, with vLLM's extras): each input's embedding (pooling.py), for a
model that embeds (an embedding model by its files, or any model under --runner pooling).

Inputs are a string, a list of strings, token ids, or a list of token id lists; each is
embedded on the engine's thread between two generation steps. `encoding_format: base64`
gives each vector as its float32 little-endian bytes in base64 (what the openai SDK asks
for by default, and decodes).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

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
    _few_prompts,
    _Request,
    keep_last,
    prompt_list,
)
from pypto_serving.server.response_size import render_json


class EmbeddingRequest(_Request):
    model: str | None = None
    input: Annotated[PromptInput, BeforeValidator(_few_prompts)]
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


class EmbeddingsServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        serving = self.serving
        name = serving.check_model(body.model)
        try:
            params = serving.engine.llm.pooling_params(
                PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
            )
        except PyptoError as e:
            if e.param != "runner":
                raise
            raise APIError(400, str(e), param="model", code="model_not_embedding") from None
        texts = body.inputs()
        if len(texts) > MAX_SEQUENCES_PER_REQUEST:
            raise PyptoError(
                f"{len(texts)} inputs are over the limit of {MAX_SEQUENCES_PER_REQUEST}", "input"
            )
        ids = await serving.encode(texts, body.add_special_tokens, "input")
        limit = serving.engine.engine.max_model_len
        ids = [keep_last(p, body.truncate_prompt_tokens, limit) for p in ids]

        async def embed() -> Response:
            vectors = [await serving.engine.embed(p, params) for p in ids]
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


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
