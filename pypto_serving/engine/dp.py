"""DPEngine: data parallelism as N replica processes behind one engine interface.

To `LLM` and `AsyncLLM` it looks like `EngineCore` (add_request, abort, step, stats, ...).
Each replica (engine/replica.py) is a process with its own scheduler, KV store with its
tiers, and executor; this side keeps a mirror `Request` per request, routes new requests
(engine/router.py), forwards aborts, and applies the tokens the replicas report. `step()`
waits for the next replica step results (one per replica at most, so a request gains at
most one token per call, as with EngineCore).

A replica that dies (its pipe closes, a step fails) or hangs (no step result and no
heartbeat, which it sends while a long step makes progress, for `step_timeout_s` while it
has requests, plus the heartbeat's own interval: progress is told up to that late) is lost
alone: it is killed, its requests fail (`Request.fail`, reported by the next `step()`), the
router stops sending it requests, and
the others keep serving. `degraded` says so (the server's /health turns 503). A thread
polls the replica processes, so one that exits is noticed within REPLICA_CHECK_S even while
the engine is idle (no step reads its pipe). Only when the last replica is lost does `step()`
raise.

Under DP attention + EP (`enable_expert_parallel` with data_parallel_size > 1) the replicas'
MoE layers form one expert-parallel group over torch.distributed (they meet through a file in
a private directory made here) and step together (engine/replica.py); requests are still
routed to one replica each. One lost replica breaks the group: every replica is lost with it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

from pypto_serving.config import EngineConfig
from pypto_serving.device import plan_devices
from pypto_serving.engine.core import EngineStats, check_request, check_step_time, combine_stats
from pypto_serving.engine.nodes import (
    NodeListener,
    connect_to_front,
    model_fingerprint,
    node_secret,
    relay,
)
from pypto_serving.engine.process import StartupDeadline
from pypto_serving.engine.replica import (
    Abort,
    NewRequest,
    Replica,
    ReplicaHandle,
    ReplicaSpec,
    StepFailed,
    StepResult,
    TokenDelta,
    heartbeat_interval,
    wait_ready,
)
from pypto_serving.engine.router import Router
from pypto_serving.errors import EngineDeadError, PyptoError
from pypto_serving.models.config import load_model_config, read_model_config
from pypto_serving.pooling import PoolingParams
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.01
"""Longest a step() waits for replica results (new requests are sent between steps)."""
REPLICA_CHECK_S = 0.5
"""How often the monitor thread looks for replica processes that have exited."""


class ReplicaDiedError(EngineDeadError):
    """Every replica process failed, exited or hung while serving."""


def local_replicas(config: EngineConfig) -> range:
    """The replicas this node hosts: its block of data_parallel_size / nnodes."""
    p = config.parallel
    per_node = p.data_parallel_size // p.nnodes
    return range(p.node_rank * per_node, (p.node_rank + 1) * per_node)


def replica_specs(
    config: EngineConfig, model_dir: Path, rendezvous: str | None = None
) -> list[ReplicaSpec]:
    """This node's replicas' own engine configs: device(s), share of the cores, SSD dir.
    With tensor or pipeline parallelism a replica gets the devices and cores of its ranks
    (all on its node); under DP attention + EP it keeps data_parallel_size (its MoE layers
    span the replicas, which meet at `rendezvous`)."""
    p = config.parallel
    n, tp = p.data_parallel_size, p.ranks_per_engine
    mine = local_replicas(config)
    plan = plan_devices(len(mine) * tp, p.device_list(), config.device)
    if len(plan) != len(mine) * tp:
        raise PyptoError(
            f"devices names {len(plan)} device(s) for {len(mine) * tp} process(es) on this "
            f"machine ({len(mine)} replica(s) x {tp} rank(s)); give one per process"
        )
    level = logging.getLogger().getEffectiveLevel()
    read = read_model_config(model_dir)  # handed to every replica: none reads it again
    specs = []
    for local, i in enumerate(mine):
        ranks = plan[local * tp : (local + 1) * tp]
        cpus = sorted(c for _, share in ranks for c in share or []) or None
        cache = config.cache
        if cache.kv_ssd_dir is not None:  # a directory per replica: each owns its files
            cache = replace(cache, kv_ssd_dir=str(Path(cache.kv_ssd_dir) / f"dp{i}"))
        threads = config.num_threads or (len(cpus) if cpus and tp == 1 else None)
        devices = ",".join(d for d, _ in ranks) if tp > 1 else None
        size = n if p.expert_parallel_over_dp else 1
        parallel = replace(  # its ranks are all on this node
            p, data_parallel_size=size, devices=devices, nnodes=1, node_rank=0, headless=False
        )
        own = replace(
            config, device=ranks[0][0], num_threads=threads, cache=cache, parallel=parallel
        )
        specs.append(ReplicaSpec(i, own, model_dir, cpus, level, n, rendezvous, p.nnodes, read))
    return specs


def expert_rendezvous(config: EngineConfig) -> str:
    """Where the replicas of a multi-node DP attention + EP engine meet: node 0's
    master_port + 1 (master_port itself takes the replicas' channels)."""
    p = config.parallel
    return f"tcp://{p.master_addr}:{(p.master_port or 0) + 1}"


class DPEngine:
    """N engine replicas in their own processes, started together, stopped together."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        config.validate()
        if config.parallel.node_rank > 0:
            raise PyptoError("node_rank > 0 only hosts data-parallel replicas: run `pypto serve`")
        self.config, self.model_dir = config, model_dir
        self.model_config = load_model_config(model_dir)
        self.lockstep = config.parallel.expert_parallel_over_dp
        """DP attention + EP: the replicas step together; losing one loses them all."""
        p = config.parallel
        deadline = StartupDeadline.after(p.startup_timeout_s)
        self._rendezvous: Path | None = None
        store: str | None = None
        self.model_config.parallel_shard(  # errors before any process starts
            p.tensor_parallel_size, p.pipeline_parallel_size, p.enable_expert_parallel
        )
        if self.lockstep:
            if p.nnodes > 1:
                store = expert_rendezvous(config)
            else:
                self._rendezvous = Path(tempfile.mkdtemp(prefix="pypto-rendezvous-"))
                store = str(self._rendezvous / "store")
        self._closed = False
        self.replicas: list[ReplicaHandle] = []
        listener = NodeListener(config, model_dir) if p.nnodes > 1 else None  # busy port: here
        try:
            for spec in replica_specs(config, model_dir, store):  # all start loading at once
                self.replicas.append(Replica(spec))
            if listener is not None:  # the other nodes' replicas, indices after this node's
                others = list(range(len(self.replicas), p.data_parallel_size))
                self.replicas += listener.accept(others, deadline)
            wait_ready(self.replicas, deadline)
        except BaseException:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()
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
            config.parallel.load_balance_policy,
            pool_pages=sum(i.pool_pages for i in infos),
        )
        self._stats = [i.stats for i in infos]
        self._by_conn = {r.conn: r for r in self.replicas}
        self._requests: dict[str, Request] = {}
        self.lost: dict[int, str] = {}
        """Replicas lost while serving, and why."""
        self._changed: list[Request] = []
        """Requests that got a token, finished or failed (those of a lost replica, found
        outside step() too), reported by the next step()."""
        self._heard = [time.monotonic()] * len(self.replicas)
        """When each replica last reported (or got work while it had none)."""
        self._messages = 0
        self._exited: dict[int, str] = {}
        """Replicas the monitor thread found gone, and why; the engine thread loses them
        (`_lose_exited`) at its next add_request or step."""
        self._stop_monitor = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch_processes, name="pypto-dp-monitor", daemon=True
        )
        self._monitor.start()
        log.info(
            "%d data-parallel replicas ready: %s",
            len(infos),
            ", ".join(
                f"dp{r.index} {r.where} on {i.device} ({i.num_threads} threads"
                + (f", experts {i.experts}" if self.lockstep else "")
                + ")"
                for r, i in zip(self.replicas, infos, strict=True)
            ),
        )

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        check_request(prompt_token_ids, params, vocab, self.max_model_len, self.config.max_logprobs)
        check_step_time(len(prompt_token_ids), self.config, self.layer_costs)

    @property
    def layer_costs(self) -> tuple[float, float]:
        """What a layer costs on the slowest replica, as their last step results said."""
        return self.stats().layer_costs

    @property
    def progress(self) -> int:
        """Messages heard from the replicas (step() itself never waits long)."""
        return self._messages

    @property
    def degraded(self) -> str | None:
        """Why the engine serves with fewer replicas than it started with (None: it does not)."""
        why = self._exited | self.lost
        lost = [f"data-parallel replica {i} stopped: {w}" for i, w in sorted(why.items())]
        return "; ".join(lost) or None

    def _watch_processes(self) -> None:
        """The monitor thread: note replica processes that exit (only note: the engine
        thread alone changes the engine's state)."""
        while not self._stop_monitor.wait(REPLICA_CHECK_S):
            for r in self.replicas:
                if r.index in self.lost or r.index in self._exited:
                    continue
                if r.poll() is not None:
                    why = r.why_gone()
                    log.error("data-parallel replica %d (%s): %s", r.index, r.where, why)
                    self._exited[r.index] = why

    def _lose_exited(self) -> None:
        for i, why in list(self._exited.items()):
            if i not in self.lost:
                self._lose(self.replicas[i], why)

    def add_request(self, request: Request) -> None:
        """Check, route and send a request to its replica."""
        self.check(request.prompt_token_ids, request.params)
        self._lose_exited()
        request.max_model_len = self.max_model_len
        message = NewRequest(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.eos_token_ids,
            request.priority,
            request.arrival,
            request.arrival_time,
            request.cache_salt,
        )
        while True:  # a replica found dead on sending is lost, and the next one is tried
            if not self.router.live:
                raise ReplicaDiedError("every data-parallel replica has stopped")
            index = self.router.route(request)
            replica = self.replicas[index]
            if self.router.num_routed[index] == 1:
                self._heard[index] = time.monotonic()  # it was idle: the watchdog starts now
            try:
                replica.send(message)
                break
            except OSError:
                self.router.finish(request.request_id)
                self._lose(replica, replica.why_gone())
        self._requests[request.request_id] = request

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        aborted: list[Request] = []
        by_replica: dict[int, list[str]] = {}
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
            with contextlib.suppress(OSError):  # a dead replica is found by step()
                self.replicas[replica].send(Abort(ids, reason))
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._changed)

    def embed(self, prompt_token_ids: list[int], params: PoolingParams) -> list[float]:
        raise PyptoError(
            "embeddings run on one engine: start the embedding model without data parallelism",
            "runner",
        )

    def tokens_computed(self) -> int:
        """Prompt and generated tokens the replicas computed, as they last reported."""
        return sum(s.prompt_tokens + s.generation_tokens for s in self._stats)

    def stats(self) -> EngineStats:
        return combine_stats([s for i, s in enumerate(self._stats) if i not in self.lost])

    def step(self) -> list[Request]:
        """Apply the next step result of each replica that has one (waiting briefly for
        one); returns the requests that got a token, finished or failed."""
        self._lose_exited()
        for conn in wait(list(self._by_conn), timeout=STEP_WAIT_S):
            replica = self._by_conn.get(conn)  # type: ignore[call-overload]
            if replica is None:  # lost while this loop ran (with its expert group)
                continue
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                self._lose(replica, replica.why_gone())
                continue
            self._heard[replica.index] = time.monotonic()  # a Heartbeat says no more
            self._messages += 1
            if isinstance(message, StepFailed):
                if self.lockstep:  # a member gone fails the others' collectives: it goes first
                    for other in list(self._by_conn.values()):
                        if other is not replica and other.poll() is not None:
                            self._lose(other, other.why_gone())
                if replica.conn in self._by_conn:  # (not lost with its group just now)
                    self._lose(replica, f"a step failed: {message.message}")
            elif isinstance(message, StepResult):
                self._stats[replica.index] = message.stats
                self.router.observe(replica.index, message.pages)
                self._changed += [r for d in message.deltas if (r := self._apply(d)) is not None]
        self._watch_for_hangs()
        changed, self._changed = self._changed, []
        if not self._by_conn:
            raise ReplicaDiedError(f"every data-parallel replica has stopped: {self.degraded}")
        return changed

    def _watch_for_hangs(self) -> None:
        now, limit = time.monotonic(), self.config.step_timeout_s
        limit += heartbeat_interval(limit)  # progress made now is heard up to this late
        for replica in list(self._by_conn.values()):
            i = replica.index
            if replica.conn not in self._by_conn:  # lost with another (its expert group)
                continue
            if self.router.num_routed[i] and now - self._heard[i] > limit:
                why = f"no step result or progress for {now - self._heard[i]:.0f} s (hung)"
                self._lose(replica, why)

    def _lose(self, replica: ReplicaHandle, why: str) -> None:
        """Kill a dead or hung replica and fail its requests; the others keep serving."""
        log.error("data-parallel replica %d (%s) stopped: %s", replica.index, replica.where, why)
        self.lost[replica.index] = why
        self._by_conn.pop(replica.conn, None)
        replica.kill(grace=0)
        message = f"data-parallel replica {replica.index} stopped: {why}"
        for rid in self.router.remove(replica.index):
            request = self._requests.pop(rid)
            request.fail(message)
            self._changed.append(request)
        if self.lockstep:  # the others' MoE layers cannot go on without its experts
            for other in list(self._by_conn.values()):
                self._lose(other, f"replica {replica.index} of its expert-parallel group stopped")

    def _apply(self, delta: TokenDelta) -> Request | None:
        request = self._requests.get(delta.request_id)
        if request is None:
            return None  # aborted while the replica computed its step
        failed = next((t for t in delta.tokens if t.error is not None), None)
        if failed is not None:  # the replica's sampler found its logits unusable
            request.fail(failed.error or "", failed.rejected)
            del self._requests[delta.request_id]
            self.router.finish(delta.request_id)
            return request
        request.output_token_ids += [t.token_id for t in delta.tokens]
        if request.params.logprobs is not None:
            request.output_logprobs += delta.tokens
        request.num_cached_tokens = delta.num_cached_tokens
        request.scheduled_time = delta.scheduled_time
        if delta.prompt_logprobs is not None:
            request.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is None:
            self.router.progress(delta.request_id, len(request.output_token_ids))
        else:
            request.cached_tokens_by_tier = delta.cached_tokens_by_tier
            request.finish(delta.finish_reason)
            del self._requests[delta.request_id]
            self.router.finish(delta.request_id)
        return request

    def close(self) -> None:
        """Stop every replica (each finishes its SSD writes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_monitor"):
            self._stop_monitor.set()
            self._monitor.join()
        for r in self.replicas:  # all finish at once
            r.request_stop()
        for r in self.replicas:
            r.stop()
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
        atexit.unregister(self.close)


def serve_replicas(config: EngineConfig, model_dir: Path) -> int:
    """A node other than 0 under data parallelism: host this node's replicas and relay each
    to node 0's engine (engine/nodes.py) until node 0 stops them (exit 0), goes away or
    loses one (exit 1); Ctrl-C stops them (exit 130)."""
    config.validate()
    p = config.parallel
    deadline = StartupDeadline.after(p.startup_timeout_s)
    node_secret()  # before any process starts
    store = None
    load_model_config(model_dir).parallel_shard(  # errors before any process starts
        p.tensor_parallel_size, p.pipeline_parallel_size, p.enable_expert_parallel
    )
    if p.expert_parallel_over_dp:
        store = expert_rendezvous(config)
    serves = model_fingerprint(config, model_dir)
    replicas = [Replica(spec) for spec in replica_specs(config, model_dir, store)]
    channels: list[tuple[Replica, Connection, float]] = []
    try:  # the channels open while the replicas load: node 0 hears of a failed start
        for r in replicas:
            front, offset = connect_to_front(config, serves, r.index, r.pid, deadline)
            channels.append((r, front, offset))
    except BaseException:
        for r in replicas:
            r.kill()
        for _, front, _ in channels:
            front.close()
        raise
    log.info(
        "node %d of %d: data-parallel replicas %s relayed to node 0 at %s:%s",
        p.node_rank,
        p.nnodes,
        ", ".join(f"{r.index} (pid {r.pid})" for r in replicas),
        p.master_addr,
        p.master_port,
    )
    clean = [False] * len(channels)

    def run(k: int) -> None:
        clean[k] = relay(*channels[k])

    threads = [
        threading.Thread(target=run, args=(k,), name=f"pypto-relay-{r.index}", daemon=True)
        for k, r in enumerate(replicas)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        for r in replicas:  # each relay sees its replica exit, and closes its channel
            r.stop()
        for t in threads:
            t.join()
        return 130
    if not all(clean):
        log.error("node %d: node 0 went away or lost a replica: stopping", p.node_rank)
        return 1
    log.info("node %d: node 0 stopped its replicas", p.node_rank)
    return 0
