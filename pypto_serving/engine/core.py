"""EngineCore: the step loop. schedule -> execute -> update, nothing more."""

from __future__ import annotations

import logging
from pathlib import Path

from pypto_serving.config import EngineConfig
from pypto_serving.device import resolve_device, resolve_dtype, set_num_threads
from pypto_serving.errors import PyptoError
from pypto_serving.executor.paged import PagedExecutor
from pypto_serving.executor.reference import ReferenceExecutor
from pypto_serving.models.loader import load_model
from pypto_serving.request import Request
from pypto_serving.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor for one model on one device."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        config.validate()
        self.config = config
        set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = load_model(model_dir, self.dtype, self.device)
        cfg = self.model.cfg
        limits = [cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings]
        self.executor = self._make_executor(min(limits))
        if isinstance(self.executor, PagedExecutor):  # a request must fit the whole pool
            limits.append(self.executor.kv.capacity_tokens)
        self.max_model_len = min(limits)
        self.scheduler = Scheduler(config.scheduler, self.executor.kv)
        log.info(
            "engine ready: %s (%s layers, %s) on %s, %s executor",
            cfg.architecture,
            cfg.num_layers,
            str(self.dtype).removeprefix("torch."),
            self.device,
            config.executor,
        )

    def _make_executor(self, max_len: int) -> ReferenceExecutor | PagedExecutor:
        if self.config.executor == "reference":
            return ReferenceExecutor(self.model, self.device)
        c = self.config
        max_tokens = c.scheduler.max_num_seqs * max_len
        executor = PagedExecutor(
            self.model, self.device, self.dtype, c.cache, max_tokens, c.enforce_eager
        )
        executor.warmup()
        return executor

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it fits the model."""
        n = len(request.prompt_token_ids)
        if n == 0:
            raise PyptoError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise PyptoError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise PyptoError(
                f"the prompt has {n} tokens; this model's context is "
                f"{self.max_model_len} (prompt plus at least one new token)"
            )
        max_tokens = request.params.max_tokens
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise PyptoError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length {self.max_model_len}"
            )
        request.max_model_len = self.max_model_len
        self.scheduler.add(request)

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        return self.scheduler.abort(request_ids, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One engine step; returns the requests that got a new token or finished."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        sampled = self.executor.execute(out)
        self.scheduler.update(out, sampled)
        return [s.request for s in out.scheduled if s.request.request_id in sampled]
