"""DPEngine: data parallelism as N replica processes behind one engine interface.

To `LLM` and `AsyncLLM` it looks like `EngineCore` (add_request, abort, step, stats, ...).
Each replica (engine/replica.py) is a process with its own scheduler, KV store with its
tiers, and executor; this side keeps a mirror `Request` per request, routes new requests
(engine/router.py), forwards aborts, and applies the tokens the replicas report. `step()`
waits for the next replica step results (one per replica at most, so a request gains at
most one token per call, as with EngineCore).
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path

from pypto_serving.config import EngineConfig
from pypto_serving.device import plan_devices
from pypto_serving.engine.core import EngineStats, check_request, combine_stats
from pypto_serving.engine.replica import (
    Abort,
    NewRequest,
    Replica,
    ReplicaSpec,
    StepFailed,
    StepResult,
    TokenDelta,
    wait_ready,
)
from pypto_serving.engine.router import Router
from pypto_serving.models.config import load_model_config
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.01
"""Longest a step() waits for replica results (new requests are sent between steps)."""


class ReplicaDiedError(RuntimeError):
    """A replica process failed or exited while serving."""


def replica_specs(config: EngineConfig, model_dir: Path) -> list[ReplicaSpec]:
    """Each replica's own engine config: its device(s), its share of the cores, its SSD dir.
    With tensor or pipeline parallelism a replica gets the devices and cores of its ranks."""
    p = config.parallel
    n, tp = p.data_parallel_size, p.ranks_per_engine
    plan = plan_devices(n * tp, p.device_list(), config.device)
    level = logging.getLogger().getEffectiveLevel()
    specs = []
    for i in range(n):
        ranks = plan[i * tp : (i + 1) * tp]
        cpus = sorted(c for _, share in ranks for c in share or []) or None
        cache = config.cache
        if cache.kv_ssd_dir is not None:  # a directory per replica: each owns its files
            cache = replace(cache, kv_ssd_dir=str(Path(cache.kv_ssd_dir) / f"dp{i}"))
        threads = config.num_threads or (len(cpus) if cpus and tp == 1 else None)
        devices = ",".join(d for d, _ in ranks) if tp > 1 else None
        parallel = replace(p, data_parallel_size=1, devices=devices)
        own = replace(
            config, device=ranks[0][0], num_threads=threads, cache=cache, parallel=parallel
        )
        specs.append(ReplicaSpec(i, own, model_dir, cpus, level))
    return specs


class DPEngine:
    """N engine replicas in their own processes, started together, stopped together."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        config.validate()
        self.config, self.model_dir = config, model_dir
        self.model_config = load_model_config(model_dir)
        specs = replica_specs(config, model_dir)
        self._closed = False
        self.replicas: list[Replica] = []
        try:
            for spec in specs:  # all start loading at once
                self.replicas.append(Replica(spec))
            wait_ready(self.replicas)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        infos = [r.info for r in self.replicas if r.info is not None]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.device = ",".join(i.device for i in infos)
        self.dtype = infos[0].dtype
        self.num_threads = [i.num_threads for i in infos]
        self.router = Router(
            len(infos),
            infos[0].page_size,
            [i.capacity_pages for i in infos],
            config.parallel.data_parallel_load_balance,
        )
        self._stats = [i.stats for i in infos]
        self._by_conn = {r.conn: r for r in self.replicas}
        self._requests: dict[str, Request] = {}
        log.info(
            "%d data-parallel replicas ready: %s",
            len(infos),
            ", ".join(
                f"dp{r.index} pid {r.pid} on {i.device} ({i.num_threads} threads)"
                for r, i in zip(self.replicas, infos, strict=True)
            ),
        )

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request: Request) -> None:
        """Check, route and send a request to its replica."""
        self.check(request.prompt_token_ids, request.params)
        request.max_model_len = self.max_model_len
        replica = self.replicas[self.router.route(request)]
        self._requests[request.request_id] = request
        replica.send(
            NewRequest(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                request.eos_token_ids,
                request.priority,
                request.arrival,
                request.arrival_time,
                request.cache_salt,
            )
        )

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        aborted, by_replica = [], {}
        for rid in request_ids:
            request = self._requests.pop(rid, None)
            replica = self.router.replica_of(rid)
            if request is None or replica is None:
                continue
            request.finish(reason)
            self.router.finish(rid)
            by_replica.setdefault(replica, []).append(rid)
            aborted.append(request)
        for replica, ids in by_replica.items():
            self.replicas[replica].send(Abort(ids, reason))
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        return combine_stats(self._stats)

    def step(self) -> list[Request]:
        """Apply the next step result of each replica that has one (waiting briefly for
        one); returns the requests that got a token or finished."""
        changed: list[Request] = []
        for conn in wait(list(self._by_conn), timeout=STEP_WAIT_S):
            replica = self._by_conn[conn]  # type: ignore[index]
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                raise self._died(replica, f"it exited (code {replica.exit_code()})") from None
            if isinstance(message, StepFailed):
                raise self._died(replica, f"a step failed: {message.message}")
            if isinstance(message, StepResult):
                self._stats[replica.index] = message.stats
                changed += [r for d in message.deltas if (r := self._apply(d)) is not None]
        return changed

    def _apply(self, delta: TokenDelta) -> Request | None:
        request = self._requests.get(delta.request_id)
        if request is None:
            return None  # aborted while the replica computed its step
        request.output_token_ids.append(delta.token.token_id)
        if request.params.logprobs is not None:
            request.output_logprobs.append(delta.token)
        request.num_cached_tokens = delta.num_cached_tokens
        request.scheduled_time = delta.scheduled_time
        if delta.finish_reason is None:
            self.router.progress(delta.request_id, len(request.output_token_ids))
        else:
            request.cached_tokens_by_tier = delta.cached_tokens_by_tier
            request.finish(delta.finish_reason)
            del self._requests[delta.request_id]
            self.router.finish(delta.request_id)
        return request

    def _died(self, replica: Replica, why: str) -> ReplicaDiedError:
        log.error("data-parallel replica %d (pid %s) stopped: %s", replica.index, replica.pid, why)
        return ReplicaDiedError(f"data-parallel replica {replica.index} stopped: {why}")

    def close(self) -> None:
        """Stop every replica (each finishes its SSD writes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self.replicas:  # all finish at once
            r.request_stop()
        for r in self.replicas:
            r.stop()
        atexit.unregister(self.close)
