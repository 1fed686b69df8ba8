"""vLLM's /v1/chat/completions/batch: several conversations in one request, each answered as
a chat request of its own (in parallel, with the same parameters), their replies gathered
as one response's choices (choice i answers conversation i) and their usage summed."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pypto_serving.server.openai_serving import OpenAIServing
from pypto_serving.server.protocol import BatchChatCompletionRequest


def summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usages added up, field by field (their nested counts too)."""
    return {
        k: summed([u[k] for u in usages]) if isinstance(v, dict) else sum(u[k] for u in usages)
        for k, v in usages[0].items()
    }


async def batch_chat(
    serving: OpenAIServing, body: BatchChatCompletionRequest, raw: Request
) -> Response:
    singles = body.conversations()
    answers = await asyncio.gather(*(serving.chat(one, raw) for one in singles))
    replies = [json.loads(bytes(a.body)) for a in answers]
    choices = []
    for i, reply in enumerate(replies):
        (choice,) = reply["choices"]
        choices.append(choice | {"index": i})
    whole = {
        "id": f"chatcmpl-batch-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": replies[0]["model"],
        "choices": choices,
        "usage": summed([r["usage"] for r in replies]),
    }
    return Response(json.dumps(whole), media_type="application/json")
