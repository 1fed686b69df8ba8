"""A data-parallel replica: one process running its own `EngineCore`, fed over a local pipe.

The server (or offline `LLM`) process holds a `Replica` handle per process. Messages:

    parent ──NewRequest / Abort / None (stop)──▶ replica
    parent ◀──Ready | StartFailed, then one StepResult per engine step, or StepFailed──
    parent ◀──Heartbeat (while a step runs and makes progress)──

The channel and the process handling are engine/process.py's: a socketpair inherited by a
fresh interpreter, never a listening socket. A replica whose parent goes away (its pipe
closes) exits on its own: at its next message read or result write.

Under DP attention + EP (`EngineCore.lockstep`) the replicas' MoE layers exchange tokens, so
they step together (`_serve_lockstep`): before every step each says, in one MAX all-reduce,
whether it has work and whether it is stopping. While any has work all step, and a replica
with nothing scheduled joins each MoE layer's exchange with no tokens of its own; when none
has work none steps (each waits LOCKSTEP_IDLE_S for a message, then they agree again); a
replica told to stop stops them all at that agreement.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Protocol

import torch

from pypto_serving.config import EngineConfig
from pypto_serving.distributed import (
    Group,
    ParallelGroups,
    all_ranks_max,
    network_rendezvous,
    use_rendezvous,
)
from pypto_serving.engine.core import EngineCore, EngineStats
from pypto_serving.engine.process import ChildProcess, StartFailed, StartupDeadline, describe
from pypto_serving.errors import PyptoError
from pypto_serving.kv.events import PageChange, page_change
from pypto_serving.models.config import ModelConfig, remember_model_config
from pypto_serving.ops.sampler import Sampled
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Most time between a replica's heartbeats while its steps make progress (a quarter of
step_timeout_s where that is shorter: `heartbeat_interval`)."""
LOCKSTEP_IDLE_S = 0.005
"""DP attention + EP, no replica with work: how long each waits for a message before they
agree again (the added latency of a request that arrives then; the cost of idling is one
small all-reduce per period)."""


@dataclass(slots=True)
class ReplicaSpec:
    """What one replica process needs to start."""

    index: int
    config: EngineConfig
    """The replica's own engine config (its device, threads and SSD directory)."""
    model_dir: Path
    cpus: list[int] | None = None
    """Cores to pin the process to (CPU replicas), None: no pinning."""
    log_level: int = logging.INFO
    dp_size: int = 1
    """The number of replicas (`index` is this one's rank among them)."""
    rendezvous: str | None = None
    """DP attention + EP: where the replicas' torch.distributed group meets: a file (all on
    one machine), or tcp://ADDRESS:PORT on node 0 (replicas on several nodes)."""
    nodes: int = 1
    """The machines the replicas are spread over (as many on each)."""
    model_config: tuple[str, ModelConfig] | None = None
    """The parent's reading of the model's config.json (`read_model_config`)."""


@dataclass(slots=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    priority: int
    arrival: int
    arrival_time: float
    """time.monotonic() in the parent; the monotonic clock is shared by the machine's processes."""
    cache_salt: str | None


@dataclass(slots=True)
class Abort:
    request_ids: list[str]
    reason: str


@dataclass(slots=True)
class Ready:
    pid: int
    max_model_len: int
    capacity_pages: int
    """Pages the replica's KV tiers hold together (what its prefix cache can remember)."""
    page_size: int
    device: str
    dtype: str
    num_threads: int
    stats: EngineStats
    groups: ParallelGroups
    """Its place in each parallel group (dp: its index and the replica count)."""
    experts: list[list[int]]
    """The routed experts each of its ranks holds, in rank order ([[]] for a dense model)."""
    pool_pages: int = 0
    """Pages it lends to a KV pool shared by the replicas (kv_remote; 0: none)."""


@dataclass(slots=True)
class TokenDelta:
    """A request's new tokens (with their logprobs when asked for) after one replica step:
    one, or more where speculative decoding kept drafts."""

    request_id: str
    tokens: list[Sampled]
    finish_reason: str | None
    num_cached_tokens: int
    scheduled_time: float | None
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: list[Sampled] | None = None
    """With the request's first token, where it asked for prompt logprobs."""


@dataclass(slots=True)
class StepResult:
    deltas: list[TokenDelta]
    stats: EngineStats
    pages: list[PageChange] = field(default_factory=list)
    """The replica's KV events since its last result, for the router's prefix estimate."""


@dataclass(slots=True)
class StepFailed:
    message: str


@dataclass(slots=True)
class Heartbeat:
    """The replica's step is still running and has made progress since the last message."""


def replica_main(spec: ReplicaSpec, conn: Connection) -> None:
    """The replica process: start the engine, report, then step while there is work."""
    logging.basicConfig(
        level=spec.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s dp{spec.index} %(name)s: %(message)s",
    )
    # Ctrl-C reaches the whole process group: the parent alone decides when replicas stop
    # (it asks them to finish, so the SSD tier's writes complete); a parent that dies closes
    # the pipe instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if spec.model_config is not None:
            remember_model_config(spec.model_dir, spec.model_config)
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        if spec.rendezvous is not None and spec.rendezvous.startswith("tcp://"):
            address, _, port = spec.rendezvous.removeprefix("tcp://").rpartition(":")
            network_rendezvous(address, int(port), spec.dp_size // spec.nodes)
        elif spec.rendezvous is not None:
            use_rendezvous(spec.rendezvous)
        engine = EngineCore(spec.config, spec.model_dir, Group(spec.index, spec.dp_size))
    except BaseException as e:  # reported to the parent, which stops every replica
        conn.send(StartFailed(os.getpid(), describe(e)))
        sys.exit(1)
    try:
        tiers = engine.stats().tiers
        conn.send(
            Ready(
                os.getpid(),
                engine.max_model_len,
                sum(t.capacity for t in tiers if not t.shared),
                spec.config.cache.page_size,
                str(engine.device),
                str(engine.dtype),
                torch.get_num_threads(),
                engine.stats(),
                engine.model.groups,
                engine.experts_by_rank,
                sum(t.capacity for t in tiers if t.shared),
            )
        )
        serve(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent went away: nothing to report to
    finally:
        engine.close()


class _Heartbeat:
    """Beside `serve`: while a step runs, tells the parent every `interval` that it makes
    progress (the engine's `progress` moved on), so the parent's watchdog takes a long step
    for a working one; a hung step sends nothing. Messages to the parent go through `send`,
    one at a time."""

    def __init__(self, engine: EngineCore, conn: Connection, interval: float) -> None:
        self.engine, self.conn, self.interval = engine, conn, interval
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._beat, name="pypto-heartbeat", daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        with self._lock:
            self.conn.send(message)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        seen = self.engine.progress
        while not self._stop.wait(self.interval):
            if (progress := self.engine.progress) != seen:
                seen = progress
                try:
                    self.send(Heartbeat())
                except OSError:  # the parent went away; serve() finds out too
                    return


def heartbeat_interval(step_timeout_s: float) -> float:
    """How often a replica looks at its step's progress and says it moved: the parent hears
    of progress up to this late, so it waits this much beyond step_timeout_s."""
    return min(HEARTBEAT_S, step_timeout_s / 4)


def serve(engine: EngineCore, conn: Connection) -> None:
    """Apply the parent's messages between steps; block on the pipe only while idle."""
    beat = _Heartbeat(engine, conn, heartbeat_interval(engine.config.step_timeout_s))
    try:
        (_serve_lockstep if engine.lockstep else _serve)(engine, conn, beat.send)
    finally:
        beat.stop()


def _serve(engine: EngineCore, conn: Connection, send: Callable[[object], None]) -> None:
    while True:
        while not engine.has_unfinished() or conn.poll():
            message = conn.recv()
            if message is None:
                return
            _apply(engine, message)
        if not _step(engine, send):
            return


def _serve_lockstep(engine: EngineCore, conn: Connection, send: Callable[[object], None]) -> None:
    """DP attention + EP: step with the other replicas (see the module's docstring)."""
    stopping = False
    while True:
        wait = 0.0 if engine.has_unfinished() else LOCKSTEP_IDLE_S
        while not stopping and conn.poll(wait):
            message = conn.recv()
            stopping = message is None
            if message is not None:
                _apply(engine, message)
            wait = 0.0
        busy = engine.has_unfinished()
        try:
            any_busy, any_stopping = all_ranks_max([int(busy), int(stopping)])
        except RuntimeError as e:  # a replica of the group is gone
            send(StepFailed(describe(e)))
            return
        if any_stopping:
            return
        if any_busy and not _step(engine, send, report=busy):
            return


def _apply(engine: EngineCore, message: NewRequest | Abort) -> None:
    if isinstance(message, NewRequest):
        engine.add_request(
            Request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                message.eos_token_ids,
                message.priority,
                message.arrival,
                message.arrival_time,
                cache_salt=message.cache_salt,
            )
        )
    else:
        engine.abort(message.request_ids, message.reason)


def _told(request: Request) -> list[Sampled]:
    """The request's tokens the parent has not been told of yet (then counted as told)."""
    told, request.num_told = request.num_told, len(request.output_token_ids)
    if request.params.logprobs is not None:
        return request.output_logprobs[told:]
    return [Sampled(t, 0.0, None) for t in request.output_token_ids[told:]]


def _step(engine: EngineCore, send: Callable[[object], None], report: bool = True) -> bool:
    """One engine step and its result to the parent (unless `report` is off: a replica with
    no requests); False if it failed (reported)."""
    try:
        changed = engine.step()
    except Exception as e:
        log.exception("engine step failed")
        send(StepFailed(describe(e)))
        return False
    if not report:
        return True
    deltas = [
        TokenDelta(
            r.request_id,
            [Sampled(-1, 0.0, None, r.error, r.rejected)] if r.error is not None else _told(r),
            r.finish_reason if r.finished else None,
            r.num_cached_tokens,
            r.scheduled_time,
            dict(r.cached_tokens_by_tier) if r.finished else {},
            r.prompt_logprobs
            if r.params.prompt_logprobs is not None and len(r.output_token_ids) == 1
            else None,
        )
        for r in changed
    ]
    pages = [page_change(e) for e in engine.page_events]
    engine.page_events.clear()
    send(StepResult(deltas, engine.stats(), pages))
    return True


class ReplicaHandle(Protocol):
    """What the engine uses of a replica: a local `Replica`, or one on another node
    (engine/nodes.py's RemoteReplica)."""

    index: int
    conn: Connection
    info: Ready | None

    @property
    def where(self) -> str:
        """Where it runs, for messages: "pid 123", "node 1 pid 123"."""
        ...

    def why_gone(self) -> str:
        """Why it can no longer be reached (its channel closed)."""
        ...

    def send(self, message: NewRequest | Abort) -> None: ...

    def poll(self) -> int | None:
        """Not None once it is gone; reads nothing from the channel."""
        ...

    def request_stop(self) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...

    def kill(self, grace: float = ...) -> None: ...


class Replica(ChildProcess):
    """The parent's handle on one replica process."""

    def __init__(self, spec: ReplicaSpec) -> None:
        super().__init__(replica_main, spec)
        self.index = spec.index
        self.info: Ready | None = None

    @property
    def where(self) -> str:
        return f"pid {self.pid}"

    def why_gone(self) -> str:
        return f"it exited (code {self.exit_code()})"

    def send(self, message: NewRequest | Abort) -> None:
        self.conn.send(message)

    def poll(self) -> int | None:
        return self.process.poll()


def wait_ready(replicas: Sequence[ReplicaHandle], deadline: StartupDeadline) -> None:
    """Wait until every replica is ready. If one fails (or dies, or is not ready by the
    deadline) first, stop them all and raise PyptoError naming the one that failed."""
    pending = {r.conn: r for r in replicas}
    while pending:
        ready = wait(list(pending), timeout=deadline.left())
        if not ready:
            late = list(pending.values())
            for r in replicas:
                r.kill()
            missed = deadline.missed([f"data-parallel replica {r.index} ({r.where})" for r in late])
            rest = ", ".join(f"{r.index} ({r.where})" for r in replicas if r not in late)
            raise PyptoError(f"{missed}; stopped the other replicas: {rest or 'none'}")
        for conn in ready:
            r = pending[conn]  # type: ignore[index]
            try:
                message: Ready | StartFailed | None = r.conn.recv()
            except (EOFError, OSError):
                message = None
            if isinstance(message, Ready):
                r.info = message
                del pending[conn]  # type: ignore[arg-type]
                log.info("replica %d ready (pid %d)", r.index, message.pid)
                continue
            why = message.message if isinstance(message, StartFailed) else r.why_gone()
            others = [o for o in replicas if o is not r]
            for o in [r, *others]:
                o.kill()
            stopped = ", ".join(f"{o.index} ({o.where})" for o in others) or "none"
            raise PyptoError(
                f"data-parallel replica {r.index} ({r.where}) failed to start: {why}; "
                f"stopped the other replicas: {stopped}"
            )
