"""AsyncLLM: the engine behind the server, stepping without blocking the asyncio event loop.

One engine task owns the `LLM`. Handlers call `admit()` (queue limits) and `generate()`,
which checks the request at once (a bad request fails in the handler, before anything is
queued), puts it in flight and returns the iterator of its updates as the engine produces
them. Steps run on one dedicated engine thread; everything else (adding, aborting,
dispatching updates) runs on the event loop between steps, so the engine's state is never
touched by two threads at once. A consumer that stops iterating, or drops the iterator
unread (a client that went away), aborts its request, and its KV pages are freed at the next
step boundary. With data parallelism the engine behind `LLM` is a `DPEngine` whose replicas
are processes; this file does not change.

`AsyncLLM.build()` also loads and warms the model on the engine thread. That matters on CPU:
OpenMP keeps one worker team per thread that has run parallel code, and with two teams on a
2-core machine libgomp stops spin-waiting, which made every operator of a step ~2x slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from pypto_serving.engine.core import EngineCore, check_step_time
from pypto_serving.engine.kv_transfer import KVTransfer, TransferFailed
from pypto_serving.engine.llm import LLM, _Family, child_id
from pypto_serving.engine.metrics import (
    EngineMetrics,
    FinishedRequest,
    TransferCollector,
    cache_info,
)
from pypto_serving.engine.process import describe
from pypto_serving.errors import (
    EngineDeadError,
    PyptoError,
    RequestFailedError,
    RequestRejectedError,
)
from pypto_serving.kv.handoff import Handoff, KVLayout
from pypto_serving.ops.sampler import Sampled
from pypto_serving.outputs import CompletionDelta
from pypto_serving.pooling import PoolingParams
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

log = logging.getLogger(__name__)

WATCH_POLL_S = 0.25
"""How often the step watchdog looks at a running step's progress."""


class EngineThread(Executor):
    """One daemon thread running submitted calls in order (a stuck start-up or step never
    keeps the process from exiting, unlike ThreadPoolExecutor's joined workers)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._calls = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="pypto-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as e:
                    future.set_exception(e)


class OverloadedError(RuntimeError):
    """A queue limit would be passed: the request is refused before anything is queued."""


class DrainingError(RuntimeError):
    """The server is shutting down: it finishes the requests in flight and takes no new ones."""


@dataclass(slots=True, frozen=True)
class QueueLimits:
    """Admission limits (see ServerConfig): None is no limit."""

    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None


@dataclass(slots=True)
class GenerationUpdate:
    """What a request produced in one step: one delta per sample with news."""

    deltas: list[CompletionDelta]
    num_cached_tokens: int
    finished: bool
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: list[Sampled | None] | None = None
    """With prompt_logprobs asked for: in the first update after the prompt is computed."""
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill server's request, once finished: where a decode server reads its KV."""


_Update = GenerationUpdate | RequestFailedError | RequestRejectedError
"""A step's news for one request: what it produced, or the error that ended it."""


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[GenerationUpdate | BaseException]
    arrival: float
    num_seqs: int = 1
    prompt_tokens: int = 0
    family: _Family | None = None
    first_token: float | None = None
    last_token: float = 0.0


class RequestUpdates:
    """The updates of one request, in order, until it finishes. Closing it early, or dropping
    it without ever reading it (a client gone before its response started), aborts the
    request, so nothing in flight is ever left without a reader."""

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream) -> None:
        self.llm, self.request_id, self.stream, self.done = llm, request_id, stream, False

    def __aiter__(self) -> RequestUpdates:
        return self

    async def __anext__(self) -> GenerationUpdate:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await self.stream.queue.get()
        except BaseException:  # cancelled while waiting: the reader is gone
            self._abort()
            raise
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finished
        return item

    async def aclose(self) -> None:
        self._abort()

    def __del__(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self.done:
            self.done = True
            self.llm.abort(self.request_id)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    cache_salt: str | None = None
    priority: int = 0
    export_kv: bool = False
    handoff: Handoff | None = None


@dataclass(slots=True)
class _Throughput:
    """Totals at the previous periodic log line."""

    at: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0


class AsyncLLM:
    def __init__(
        self,
        llm: LLM,
        model_name: str,
        log_interval_s: float = 5.0,
        thread: EngineThread | None = None,
        limits: QueueLimits = QueueLimits(),
        transfer: KVTransfer | None = None,
    ) -> None:
        """transfer: this server's end of disaggregated serving (a prefill server's offers,
        a decode server's pulls), None where it serves colocated only."""
        self.llm = llm
        self.limits = limits
        self.transfer = transfer
        self._pulls: set[asyncio.Task[None]] = set()
        self._layout: KVLayout | None = None
        parallel = llm.engine.config.parallel
        self.running_capacity = llm.engine.config.scheduler.max_num_seqs * (
            parallel.data_parallel_size
        )
        self.engine = llm.engine
        config = llm.engine.config
        self.metrics = EngineMetrics(
            self.engine.stats,
            model_name,
            llm.engine.max_model_len,
            config.scheduler.max_num_batched_tokens,
            cache_info(config, self.engine.stats()),
        )
        if transfer is not None:
            self.metrics.registry.register(TransferCollector(lambda: transfer.stats, model_name))
        self._tokens_computed = self.engine.tokens_computed()
        """Tokens computed by the end of the last step (iteration_tokens: each step's)."""
        self.log_interval_s = log_interval_s
        self.error: EngineDeadError | None = None
        self.step_timeout_s = llm.engine.config.step_timeout_s
        self.hung = False
        """A step made no progress for step_timeout_s: the engine thread is stuck in it."""
        self.draining = False
        """Shutting down: requests in flight finish, new ones are refused."""
        self._streams: dict[str, _Stream] = {}
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._thread = thread or EngineThread()
        self._task: asyncio.Task[None] | None = None
        self._logged = _Throughput()

    # --- lifecycle ------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        knobs: dict[str, Any],
        model_name: str | None,
        log_interval_s: float,
        limits: QueueLimits = QueueLimits(),
        transfer: KVTransfer | None = None,
    ) -> AsyncLLM:
        """Load the model (and compile it) on the engine thread; the name defaults to the
        model directory's."""
        thread = EngineThread()
        try:
            llm = thread.submit(LLM, **knobs).result()
        except BaseException:
            thread.shutdown(wait=False)
            if transfer is not None:
                transfer.close()
            raise
        name = model_name or llm.model_dir.name
        return cls(llm, name, log_interval_s, thread, limits, transfer)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pypto-engine")

    async def stop(self) -> None:
        """Stop the loop; requests still in flight end with EngineDeadError."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self.hung:  # the stuck thread is a daemon; worker processes exit with this one
            log.warning("the engine thread is stuck in a step: not waiting for it")
            return
        self._thread.submit(self.engine.close).result()
        self._thread.shutdown(wait=True)
        if self.transfer is not None:
            self.transfer.close()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait up to `timeout_s` for those in flight to finish, then end
        the rest with EngineDeadError (a JSON error, or an SSE error event then [DONE])."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and self.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            log.warning(
                "shutting down: %d request(s) still in flight end with an error",
                len(self._streams),
            )
            for rid in list(self._streams):
                self.abort(rid)
            self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.error is None and self._task is not None and not self._task.done()

    def health_problem(self) -> str | None:
        """Why the server is not fully able to serve (None: it is): the engine is dead, it
        lost a worker (data-parallel replicas still serve), or it is shutting down."""
        if not self.alive:
            return str(self.error) if self.error else "the engine is not running"
        if self.draining:
            return "the server is shutting down"
        return self.engine.degraded

    # --- requests -------------------------------------------------------------------------

    def admit(self, prompts: list[list[int]], params: SamplingParams, count: str = "n") -> None:
        """Raise OverloadedError if these prompts would pass a queue limit. Counted here, on
        the event loop, from what is in flight (so a burst is counted before any step runs):
        queued sequences are those beyond the running capacity (max_num_seqs per replica);
        waiting tokens are the prompts of requests without an output token yet. A request
        that would pass the sequence limit on an idle server raises PyptoError instead: no
        amount of waiting (or retrying) admits it (`count`: the request's field that set
        params.n, which the error names)."""
        limits = self.limits
        if limits.max_queued_requests is not None:
            new = len(prompts) * params.n
            if new > self.running_capacity + limits.max_queued_requests:
                raise PyptoError(
                    f"{len(prompts)} prompt(s) x {count}={params.n} is {new} sequences, more "
                    f"than this server ever admits at once: {self.running_capacity} running "
                    f"(--max-num-seqs) and {limits.max_queued_requests} queued "
                    "(--max-queued-requests)",
                    count if params.n > 1 else "prompt",
                )
            in_flight = sum(s.num_seqs for s in self._streams.values())
            queued = in_flight + new - self.running_capacity
            if queued > limits.max_queued_requests:
                raise OverloadedError(
                    f"the server is at its limit of {self.running_capacity} running and "
                    f"{limits.max_queued_requests} queued sequences; retry later"
                )
        if limits.max_queued_tokens is not None:
            waiting = sum(s.prompt_tokens for s in self._streams.values() if s.first_token is None)
            new = sum(map(len, prompts))
            if waiting and waiting + new > limits.max_queued_tokens:
                raise OverloadedError(
                    f"the server is at its limit of {limits.max_queued_tokens} prompt tokens "
                    "waiting; retry later"
                )

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_transfer: dict[str, Any] | None = None,
    ) -> RequestUpdates:
        """Queue a request now and return the iterator of its updates until it finishes
        (`priority`: lower runs first when requests wait).

        Raises PyptoError for a request the model cannot take, EngineDeadError when the
        engine is not running, DrainingError while shutting down. The request counts as in
        flight from this call (admission limits see it at once); closing the iterator early
        aborts it. A request lost to a fault ends with RequestFailedError, one whose own
        constraints leave no token with RequestRejectedError.

        kv_transfer (vLLM's `kv_transfer_params`, disaggregated serving): `do_remote_decode`
        asks a prefill server to compute the prompt and the first token and hand them off
        (its last update carries the params a decode server reads them by);
        `do_remote_prefill` asks a decode server to go on from such a handoff (read first;
        if that fails it computes the prompt itself)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if self.draining:
            raise DrainingError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.engine.check(prompt_token_ids, params)
        check_step_time(len(prompt_token_ids), self.engine.config, self.engine.layer_costs)
        export, pull = self._transfer_asked(kv_transfer, params)
        stream = _Stream(asyncio.Queue(), time.monotonic(), params.n, len(prompt_token_ids))
        self._streams[request_id] = stream
        add = _Add(request_id, prompt_token_ids, params, stream, cache_salt, priority, export)
        if pull is not None:
            task = asyncio.get_running_loop().create_task(self._pull(add, pull))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)
        else:
            self._adds.append(add)
            self._wake.set()
        return RequestUpdates(self, request_id, stream)

    def _transfer_asked(
        self, kv_transfer: dict[str, Any] | None, params: SamplingParams
    ) -> tuple[bool, dict[str, Any] | None]:
        """(hand this request's KV off, the handoff to go on from) as `kv_transfer` asks;
        PyptoError where this server does not do what it asks."""
        if not kv_transfer:
            return False, None
        export = bool(kv_transfer.get("do_remote_decode"))
        pull = bool(kv_transfer.get("do_remote_prefill"))
        if not export and not pull:
            return False, None
        role = "prefill" if export else "decode"
        transfer = self.transfer
        if transfer is None or not (transfer.sends if export else transfer.receives):
            raise PyptoError(
                f"kv_transfer_params asks for a {role} server's work: start this server with "
                f"--disaggregation-mode {role}",
                "kv_transfer_params",
            )
        if params.n != 1:
            raise PyptoError("a request handed between prefill and decode servers takes n=1", "n")
        self._kv_layout()  # one engine with paged KV, or a PyptoError saying so
        if pull and params.prompt_logprobs is not None:  # they are computed with the prompt
            return False, None
        return export, kv_transfer if pull else None

    async def _pull(self, add: _Add, params: dict[str, Any]) -> None:
        """Read a decode request's handoff (on a worker thread, at most the transfer's
        timeout) into device pages reserved for it first where the pool has the room (else
        into host memory, the request then waiting for room as a swapped one does), then
        queue the request; if the read fails it computes its prompt here."""
        transfer = self.transfer
        assert transfer is not None
        layout = self._kv_layout()
        engine_id = child_id(add.request_id, 0)
        reserved = await self._reserve(engine_id, params)
        if not reserved:
            transfer.stats.no_room += 1
        work = asyncio.to_thread(transfer.pull, params, layout, add.prompt_token_ids)
        try:
            add.handoff = await asyncio.wait_for(work, transfer.timeout_s)
        except Exception as e:  # whatever failed, the request is not lost to it
            transfer.stats.failed += 1
            why = str(e) or f"{type(e).__name__}, after {transfer.timeout_s:g} s"
            log.warning(
                "request %s: the prompt's KV was not read (%s): computing it here",
                add.request_id,
                why,
            )
        queued = add.request_id in self._streams  # (not aborted meanwhile)
        if reserved and (add.handoff is None or not queued):
            await asyncio.get_running_loop().run_in_executor(
                self._thread, self._core().unreserve, engine_id
            )
        if queued:
            self._adds.append(add)
            self._wake.set()

    async def _reserve(self, engine_id: str, params: dict[str, Any]) -> bool:
        """Reserve device pages for the handoff `params` describe (each group's pages), on
        the engine thread between steps; whether the pool had the room."""
        try:
            pages = [int(g[3]) for g in params["groups"]]
        except (KeyError, TypeError, ValueError, IndexError):
            return False  # malformed: the read says so
        if len(pages) != len(self._kv_layout().geometry):
            return False
        loop = asyncio.get_running_loop()
        core = self._core()
        return await loop.run_in_executor(self._thread, core.reserve, engine_id, pages)

    async def embed(self, prompt_token_ids: list[int], params: PoolingParams) -> list[float]:
        """A prompt's embedding, computed on the engine's thread between two steps."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if self.draining:
            raise DrainingError("the server is shutting down")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.engine.embed, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        """Stop a request (takes effect at the next step boundary)."""
        if request_id in self._streams:
            self._aborts.append(request_id)
            self._wake.set()

    # --- the engine loop --------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_requests()
                self._maybe_log()
                if self.transfer is not None:  # handoffs read, or kept too long
                    self.transfer.sweep()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):  # wakes to log the last interval
                        await asyncio.wait_for(self._wake.wait(), self.log_interval_s)
                    continue
                step = loop.run_in_executor(self._thread, self._step)
                await self._watch(step)
                self._dispatch(step.result())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed step leaves the engine in an unknown state
            fault = isinstance(e, RequestFailedError)
            log.error("the engine is stopped: %s", describe(e), exc_info=not fault)
            why = str(e) if fault else f"a step failed ({type(e).__name__})"
            self.error = EngineDeadError(f"the engine stopped: {why}")
            self._fail_all(self.error)

    async def _watch(self, step: asyncio.Future[Any]) -> None:
        """Wait for a step, however long it runs while it makes progress (the engine's
        `progress` moves on as each layer attends). One that makes none for step_timeout_s is
        hung: the thread stays stuck in it, and nothing else may touch the engine."""
        seen, since = self.engine.progress, time.monotonic()
        poll = min(self.step_timeout_s, WATCH_POLL_S)
        while not (await asyncio.wait({step}, timeout=poll))[0]:
            now, progress = time.monotonic(), self.engine.progress
            if progress != seen:
                seen, since = progress, now
            elif now - since >= self.step_timeout_s:
                self.hung = True
                raise EngineDeadError(
                    f"a step made no progress for step_timeout_s ({self.step_timeout_s:g} s)"
                )

    def _apply_requests(self) -> None:
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            stream = self._streams.pop(rid, None)
            if stream is not None and stream.family is not None:
                self.llm.abort(stream.family)
                self.metrics.finished("abort", len(stream.family.children))
        self._adds = [a for a in self._adds if a.request_id in self._streams]
        adds, self._adds = self._adds, []
        for a in adds:
            try:
                a.stream.family = self.llm.add(
                    a.prompt_token_ids,
                    a.params,
                    a.priority,
                    request_id=a.request_id,
                    arrival_time=a.stream.arrival,
                    cache_salt=a.cache_salt,
                    export_kv=a.export_kv,
                    handoff=a.handoff,
                )
            except Exception as e:  # checked in generate(); a failure here is reported to it
                self._streams.pop(a.request_id, None)
                a.stream.queue.put_nowait(e)

    def _step(self) -> list[tuple[str, _Update]]:
        """On the engine thread: one step, then each changed request's deltas (or the error
        that ended a request lost to a fault)."""
        updates: list[tuple[str, _Update]] = []
        changed = self.llm.step()
        computed = self.engine.tokens_computed()
        if computed > self._tokens_computed:  # the step's tokens (under DP: the replicas')
            self.metrics.iteration_tokens.observe(computed - self._tokens_computed)
        self._tokens_computed = computed
        for f in changed:
            if f.error is not None:
                updates.append((f.request_id, f.failure()))
                continue
            first = f.children[0]
            update = GenerationUpdate(
                f.take_deltas(),
                first.num_cached_tokens,
                f.finished,
                dict(first.cached_tokens_by_tier) if f.finished else {},
                f.take_prompt_logprobs(),
                self._offer(first),
            )
            updates.append((f.request_id, update))
        return updates

    def _core(self) -> EngineCore:
        """The one engine of a disaggregated server (data parallelism is refused with it)."""
        engine = self.engine
        if not isinstance(engine, EngineCore):  # refused when the config is read
            raise PyptoError("disaggregated serving runs one engine (data_parallel_size 1)")
        return engine

    def _kv_layout(self) -> KVLayout:
        """The engine's KV layout, as handoffs check it (read once: it never changes)."""
        if self._layout is None:
            self._layout = self._core().kv_layout()
        return self._layout

    def _offer(self, request: Request) -> dict[str, Any] | None:
        """A prefill server's finished request: its handoff offered to decode servers (on
        the engine thread: packing copies its pages)."""
        handoff, request.handoff = request.handoff, None
        if handoff is None or self.transfer is None:
            return None
        layout = self._kv_layout().digest
        try:
            return self.transfer.offer(handoff, layout, request.prompt_token_ids)
        except TransferFailed as e:  # no handoff: the decode server computes the prompt
            log.warning("request %s: its KV is not offered (%s)", request.request_id, e)
            return None

    def _dispatch(self, updates: list[tuple[str, _Update]]) -> None:
        now = time.monotonic()
        for rid, update in updates:
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted while the step ran
            if not isinstance(update, GenerationUpdate):  # the request failed
                del self._streams[rid]
                self.metrics.finished("error", stream.num_seqs)
                stream.queue.put_nowait(update)
                continue
            if any(d.token_ids for d in update.deltas):
                if stream.first_token is None:
                    stream.first_token = now
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last_token)
                stream.last_token = now
            if update.finished:
                del self._streams[rid]
                self._observe_finished(stream, now)
            stream.queue.put_nowait(update)

    def _observe_finished(self, stream: _Stream, now: float) -> None:
        assert stream.family is not None
        self.metrics.e2e.observe(now - stream.arrival)
        children = stream.family.children
        scheduled = children[0].scheduled_time
        if scheduled is not None:
            self.metrics.queue.observe(max(scheduled - stream.arrival, 0.0))
        for child in children:
            self.metrics.finished(child.finish_reason or "abort", 1)
        prompt = len(children[0].prompt_token_ids)
        max_tokens = children[0].params.max_tokens
        done = FinishedRequest(
            prompt,
            [len(c.output_token_ids) for c in children],
            max_tokens if max_tokens is not None else self.engine.max_model_len - prompt,
            scheduled,
            stream.first_token,
            stream.last_token,
        )
        self.metrics.request_done(done)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self._adds = []
        for stream in streams.values():
            stream.queue.put_nowait(error)

    def _maybe_log(self) -> None:
        """Every log_interval_s while there was work: throughput, queues, KV, prefix hits."""
        now = time.monotonic()
        last = self._logged
        elapsed = now - last.at
        if elapsed < self.log_interval_s:
            return
        s = self.engine.stats()
        self._logged = _Throughput(now, s.prompt_tokens, s.generation_tokens)
        idle = (s.prompt_tokens, s.generation_tokens) == (
            last.prompt_tokens,
            last.generation_tokens,
        )
        if idle and not (s.num_running or s.num_waiting):
            return
        hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        log.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, "
            "KV usage %.1f%%, prefix cache hit rate %.1f%%",
            (s.prompt_tokens - last.prompt_tokens) / elapsed,
            (s.generation_tokens - last.generation_tokens) / elapsed,
            s.num_running,
            s.num_waiting,
            100 * s.kv_usage,
            100 * hit_rate,
        )
