"""The reference executor: plain PyTorch, one request at a time, a dense KV per request.

It is the project's correctness oracle: no paging, no batching tricks, nothing to get wrong.
Its KV store has unbounded capacity and no prefix cache.
"""

from __future__ import annotations

import torch

from pypto_serving.executor.prompt_logprobs import prompt_scoring, score_prompts
from pypto_serving.grammar import Grammars
from pypto_serving.models.llama import CausalLM
from pypto_serving.ops.attention import DenseKV
from pypto_serving.ops.sampler import Sampled, SamplingRow, sample
from pypto_serving.request import Request
from pypto_serving.scheduler import SchedulerOutput


class DenseKVStore:
    """One growing DenseKV per request; answers the scheduler's capacity questions."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.caches: dict[str, DenseKV] = {}

    def num_cached_tokens(self, request: Request, limit: int | None = None) -> int:
        return 0

    def cached_tokens_by_tier(self, request: Request) -> dict[str, int]:
        return {}

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        self.caches.setdefault(request.request_id, DenseKV(self.num_layers))
        return True

    def free(self, request: Request) -> None:
        self.caches.pop(request.request_id, None)

    def preempt(self, request: Request) -> bool:
        """Drops the request's KV: it recomputes when it resumes."""
        self.free(request)
        return False

    def usage(self) -> float:
        """Always 0: the dense store grows with its requests and has no fixed capacity."""
        return 0.0


class ReferenceExecutor:
    num_recompilations = 0
    """It never compiles."""
    grammars: Grammars | None = None
    """The engine's structured-output matchers (set by the engine)."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.kv = DenseKVStore(model.cfg.num_layers)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[Sampled]]:
        """Run each scheduled request's new tokens; sample for those that caught up (one
        token each: no speculative drafts here)."""
        hidden, rows, ids = [], [], []
        for s in out.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            tokens = torch.tensor(req.tokens(start, end), device=self.device)
            positions = torch.arange(start, end, device=self.device)
            h = self.model(tokens, positions, self.kv.caches[req.request_id])
            for _, lo, hi in prompt_scoring([req], [start], [s.num_new_tokens]):
                score_prompts(self.model.logits(h[lo - start : hi - start]), [req], [(0, lo, hi)])
            if end == req.num_tokens:
                hidden.append(h[-1])
                allowed = (
                    self.grammars.fill_masks([req.matcher])[0]
                    if req.matcher is not None and self.grammars is not None
                    else None
                )
                rows.append(
                    SamplingRow(
                        req.params,
                        req.prompt_token_ids,
                        req.output_token_ids,
                        req.generator,
                        req.eos_token_ids,
                        allowed,
                    )
                )
                ids.append(req.request_id)
        if not rows:
            return {}
        logits = self.model.logits(torch.stack(hidden))
        return {i: [token] for i, token in zip(ids, sample(logits, rows), strict=True)}
