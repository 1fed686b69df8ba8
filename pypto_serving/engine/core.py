"""EngineCore: the step loop. schedule -> execute -> update, nothing more."""

from __future__ import annotations

import functools
import gc
import logging
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pypto_serving import grammar
from pypto_serving.config import EngineConfig
from pypto_serving.distributed import (
    COLLECTIVE_TIMEOUT_S,
    Group,
    engine_gather,
    set_collective_timeout,
    shutdown_distributed,
)
from pypto_serving.engine.kv_events import Curve, KVEventPublisher, endpoint_for
from pypto_serving.engine.plan import plan_run
from pypto_serving.engine.process import ChildProcess, StartupDeadline
from pypto_serving.engine.ranks import Loaded, backend_for, plan_ranks, start_workers, wait_ranks
from pypto_serving.engine.worker import join_group, load_draft_model, load_share
from pypto_serving.errors import EngineDeadError, PyptoError
from pypto_serving.executor.compiled import trust_cpu_vector_isa_soon
from pypto_serving.executor.draft_model import DraftModel
from pypto_serving.executor.kv_shares import gather_export, handoff_page_bytes, send_received
from pypto_serving.executor.native_decode import ROW_BLOCK
from pypto_serving.executor.paged import PagedExecutor
from pypto_serving.grammar import Grammars
from pypto_serving.kv.events import KVEvent, KVEventLog
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.handoff import Handoff, KVLayout, counts, packed
from pypto_serving.kv.paged_attention import StepProgress
from pypto_serving.kv.tier import TierStats, merge_tier_stats
from pypto_serving.models.config import load_model_config
from pypto_serving.ops.attention import DenseKV
from pypto_serving.ops.sampler import Sampled
from pypto_serving.pooling import PoolingParams, pool
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams
from pypto_serving.scheduler import RowBlocks, Scheduler, SchedulerOutput
from pypto_serving.speculative import SpecDecodeStats, Speculator

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and running totals (read by metrics and logs)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    """Fraction of KV pages held by requests."""
    prefix_queries: int
    """Prompt tokens of admitted requests."""
    prefix_hits: int
    """Of those, tokens found in the prefix cache."""
    num_preemptions: int
    num_swapped: int
    """Of those, preemptions whose KV was swapped out instead of dropped."""
    num_recompilations: int
    compiling: bool
    """Whether warm-up is still compiling in the background (steps partly eager)."""
    prompt_tokens: int
    """Prompt tokens computed (prefix-cache hits excluded, recomputation included)."""
    generation_tokens: int
    tiers: tuple[TierStats, ...] = ()
    """Per KV tier (device, cpu, ssd): occupancy, hits, misses, pages moved, load latency."""
    layer_costs: tuple[float, float] = (0.0, 0.0)
    """What a layer costs here (`StepProgress`: prefill attention seconds per query x context
    token, the rest per token), for refusing a prompt the step watchdog would kill."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's drafts and how many were kept (None: not speculating)."""


def combine_stats(parts: list[EngineStats]) -> EngineStats:
    """One snapshot of several engines (DP replicas): counts and totals add up, KV usage is
    the mean, tiers of the same name are merged."""
    tiers: dict[str, TierStats] = {}
    spec = [p.spec_decode for p in parts if p.spec_decode is not None]
    for t in (t for p in parts for t in p.tiers):
        tiers[t.name] = merge_tier_stats(tiers[t.name], t) if t.name in tiers else t
    return EngineStats(
        sum(p.num_running for p in parts),
        sum(p.num_waiting for p in parts),
        sum(p.kv_usage for p in parts) / max(len(parts), 1),
        sum(p.prefix_queries for p in parts),
        sum(p.prefix_hits for p in parts),
        sum(p.num_preemptions for p in parts),
        sum(p.num_swapped for p in parts),
        max((p.num_recompilations for p in parts), default=0),
        any(p.compiling for p in parts),
        sum(p.prompt_tokens for p in parts),
        sum(p.generation_tokens for p in parts),
        tuple(tiers.values()),
        layer_costs=(
            max((p.layer_costs[0] for p in parts), default=0.0),
            max((p.layer_costs[1] for p in parts), default=0.0),
        ),
        spec_decode=functools.reduce(operator.add, spec) if spec else None,
    )


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int = 20,
) -> None:
    """Raise PyptoError (naming the parameter) unless the request fits the model (and the
    engine's max_logprobs)."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs", "logprob_token_ids"):
        count = getattr(params, name)
        if (len(count) if isinstance(count, list) else count or 0) > limit:
            raise PyptoError(
                f"{name} must be in [0, {limit}] (the server's max_logprobs; -1 asks for the "
                "whole vocabulary where that is -1)",
                name,
            )
    n = len(prompt_token_ids)
    if n == 0:
        raise PyptoError("the prompt is empty", param="prompt")
    if n >= max_model_len:  # before the ids are read: a prompt may be millions of them
        raise PyptoError(
            f"the prompt has {n} tokens; this model's context is "
            f"{max_model_len} (prompt plus at least one new token)",
            param="prompt",
        )
    outside = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if outside:
        raise PyptoError(
            f"prompt token ids must be integers in [0, {vocab_size}): {outside[0]!r} is out "
            "of vocabulary",
            "prompt",
        )
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise PyptoError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    if any(t >= vocab_size for t in params.logit_bias):
        raise PyptoError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if any(t >= vocab_size for t in params.logprob_token_ids or ()):
        raise PyptoError(f"logprob_token_ids must be in [0, {vocab_size})", "logprob_token_ids")
    if any(t >= vocab_size for t in params.allowed_token_ids or ()):
        raise PyptoError(f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids")
    if params.structured_outputs is not None:
        grammar.check(params.structured_outputs)
    max_tokens = params.max_tokens
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise PyptoError(
            f"prompt ({n} token{'s' * (n != 1)}) + max_tokens ({max_tokens}) exceeds the "
            f"context length {max_model_len}",
            param="max_tokens",
        )


def check_step_time(n: int, config: EngineConfig, costs: tuple[float, float]) -> None:
    """Raise PyptoError (400) for a prompt of `n` tokens one layer of whose prefill would take
    longer here than step_timeout_s, by the layer `costs` measured so far (`StepProgress`):
    the watchdog would take that step for a hang, so waiting could never answer it. Its
    heaviest layer is that of its last chunk (the scheduler's per-request cap) at `n` tokens
    of context."""
    cap = config.scheduler.long_prefill_token_threshold or config.scheduler.max_num_batched_tokens
    chunk = min(n, cap, config.scheduler.max_num_batched_tokens)
    seconds = StepProgress(0, *costs).layer_seconds(chunk, n)
    if seconds > config.step_timeout_s:
        raise PyptoError(
            f"the prompt has {n} tokens: one layer of its prefill would take about "
            f"{seconds:.1f} s here, longer than step_timeout_s ({config.step_timeout_s:g} s), "
            "the longest a step may go without progress before the engine takes it for a "
            "hang; send a shorter prompt, or start the server with a larger --step-timeout-s",
            param="prompt",
        )


def describe_ranks(tp: int, pp: int) -> str:
    parts = [f"tensor parallel over {tp} ranks"] * (tp > 1)
    parts += [f"{pp} pipeline stages"] * (pp > 1)
    return "".join(", " + part for part in parts)


class EngineCore:
    """Owns the scheduler and the executor for one model on one device."""

    degraded: str | None = None
    """Serving with less than it started with (a DPEngine may lose replicas; this never)."""
    draft_model: DraftModel | None = None
    """Speculative decoding's draft model, where the config names one."""

    def __init__(self, config: EngineConfig, model_dir: Path, dp: Group | None = None) -> None:
        """dp: this engine's place among the data-parallel replicas (engine/replica.py)."""
        config.validate()
        self.config, self.model_dir, self.dp = config, model_dir, dp or Group()
        self._closed = False
        p = config.parallel
        if p.node_rank > 0:
            raise PyptoError("node_rank > 0 only hosts tensor-parallel ranks: run `pypto serve`")
        self.lockstep = p.expert_parallel_over_dp
        """DP attention + EP: this replica steps with the others (engine/replica.py), and
        joins their MoE layers' exchanges when it has no tokens."""
        if self.lockstep and self.dp.size != p.data_parallel_size:
            raise PyptoError(
                "DP attention + EP runs as data-parallel replicas (LLM with "
                "data_parallel_size > 1), not as one EngineCore"
            )
        self.workers: list[ChildProcess] = []
        self.finished_on_arrival: list[Request] = []
        """Requests a handoff's first token ended (returned by the next step)."""
        self._num_threads = torch.get_num_threads()  # restored by close
        self._deadline = StartupDeadline.after(p.startup_timeout_s)
        own = config
        if p.ranks_per_engine > 1:  # this process is rank 0; the others are child processes
            load_model_config(model_dir).parallel_shard(  # errors before any process starts
                p.tensor_parallel_size, p.pipeline_parallel_size, p.enable_expert_parallel
            )
            own = plan_ranks(config)[0]
            self.workers = start_workers(config, model_dir, self._deadline, self.dp)
        try:
            self._load(own)
        except BaseException as e:
            self._stop_workers()
            torch.set_num_threads(self._num_threads)
            if self.workers and isinstance(e, RuntimeError):  # a rank failed: say which
                raise PyptoError(f"start-up of the ranks failed: {e}; {self._ranks()}") from e
            raise

    def _load(self, own: EngineConfig) -> None:
        config, p = self.config, self.config.parallel
        self.plan = plan = plan_run(own, self.model_dir)
        torch.set_num_threads(plan.num_threads)
        if config.seed is not None:  # rank 0 samples; a replica is an engine of its own
            torch.manual_seed(config.seed)
        self.device, self.dtype = plan.device, plan.dtype
        if config.executor == "paged" and self.device.type == "cpu" and not config.enforce_eager:
            trust_cpu_vector_isa_soon()  # while the model loads; warm-up compiles for it
        backend = backend_for(config, own.device)
        groups = join_group(config, 0, backend, self._deadline.left(), self.dp)
        share = load_share(config, plan, self.model_dir, groups)  # as every rank does
        self.model, self.executor, self.attention = share.model, share.executor, share.attention
        if self.lockstep and not self.model.held_experts:  # its MoE blocks are not RoutedExperts
            raise PyptoError(
                f"{self.model.cfg.architecture} does not support DP attention + expert "
                "parallelism yet (enable_expert_parallel with data_parallel_size > 1)"
            )
        self.model_config = cfg = self.model.cfg
        limits = [cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings]
        self.experts_by_rank = [self.model.held_experts]
        """Each rank's routed experts, in engine rank order ([[]] for a dense model)."""
        self.handoff_page_bytes: list[list[int]] = []
        """Each rank's bytes of a page of each KV group in a handoff (`kv_layout`)."""
        if isinstance(self.executor, PagedExecutor):
            if self.workers:  # warm-up steps are collective: wait until every rank follows
                wait_ranks(self.workers, 1, Loaded, self._deadline)
            page_bytes = handoff_page_bytes(self.executor.kv, self.executor.groups)
            self.handoff_page_bytes = [page_bytes]
            if p.ranks_per_engine > 1:
                self.experts_by_rank = engine_gather(self.model.held_experts)
                self.handoff_page_bytes = engine_gather(page_bytes)
            # warm-up steps under DP attention + EP are collective: in the foreground
            self.executor.warmup(config.background_compile and not self.lockstep)
        if p.ranks_per_engine > 1 or self.lockstep:  # started: collectives get the serving limit
            set_collective_timeout(COLLECTIVE_TIMEOUT_S)
        if isinstance(self.executor, PagedExecutor):  # a request must fit the whole pool
            limits.append(self.executor.kv.capacity_tokens)
        self.max_model_len = min(limits)
        if config.max_model_len and self.max_model_len < config.max_model_len:
            log.warning(
                "max_model_len %d lowered to %d: the KV pages hold no longer a sequence "
                "(raise --kv-device-bytes or --num-kv-pages for more)",
                config.max_model_len,
                self.max_model_len,
            )
        self.speculator = self._speculator(own)
        decode_rows = row_blocks = None
        if isinstance(self.executor, PagedExecutor) and self.executor.native is not None:
            decode_rows = self.executor.native_rows
            row_blocks = RowBlocks(ROW_BLOCK, self.executor.native.wide_rows)
        self.scheduler = Scheduler(
            config.scheduler, self.executor.kv, self.speculator, decode_rows, row_blocks
        )
        self.grammars = self.executor.grammars = Grammars(self.model_dir, cfg.vocab_size)
        if self.draft_model is not None:  # it drafts a structured output under its grammar
            self.draft_model.executor.grammars = self.grammars
        self.page_events: list[KVEvent] = []
        """A data-parallel replica's KV events since the router last took them."""
        self.kv_events = self._kv_events()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # what start-up made (the model's modules and tensors, compiled graphs, the tokenizer)
        # lives as long as the engine: out of the collector's sight, its full collections no
        # longer walk it between steps (they took 2-3 % of a 1B model's decode, profiled);
        # `close` gives it back to the collector
        gc.collect()
        gc.freeze()
        log.info(
            "engine ready: %s (%s layers, %s) on %s, %s executor%s",
            cfg.architecture,
            cfg.num_layers,
            str(self.dtype).removeprefix("torch."),
            self.device,
            config.executor,
            describe_ranks(p.tensor_parallel_size, p.pipeline_parallel_size),
        )

    def _speculator(self, own: EngineConfig) -> Speculator | None:
        """Speculative decoding's drafter, where the config asks for it and the model's
        attention kind can take a step's rejected drafts back; a draft model loaded as this
        rank's config (`own`) plans it."""
        spec = self.config.speculation()
        if spec is None:
            return None
        kind, cost = self.model.attention_kind, self.attention.draft_row_cost
        if not kind.SPECULATES:
            raise PyptoError(
                f"speculative decoding: {self.model_config.architecture}'s attention "
                f"({kind.NAME}) keeps state built from each token it writes, which a "
                "rejected draft's could not be taken back from; serve it without "
                "--speculative-config",
                "speculative_config",
            )
        if spec.method == "mtp":
            assert isinstance(self.executor, PagedExecutor) and self.executor.mtp is not None
            return Speculator(spec, self.executor.mtp, cost)
        if spec.model is None:
            return Speculator(spec, row_cost=cost)
        self.draft_model = load_draft_model(own, self.model_config, self.max_model_len)
        return Speculator(spec, self.draft_model, cost)

    def _event_store(self) -> KVGroups | None:
        """The paged KV, whose first group's page events say which prompt pages this engine
        holds (DeepSeek-V4's compressed entries: a prefix hit needs every one of them, and
        only its window's rows, which are not told); None off the paged executor."""
        kv = getattr(self.executor, "kv", None)
        return kv if isinstance(kv, KVGroups) else None

    def _kv_events(self) -> KVEventPublisher | None:
        """The publisher of the KV store's events, where cache.kv_events_endpoint asks for one;
        a data-parallel replica also keeps them for the router (its `page_events`, which
        each step result carries and clears)."""
        c = self.config.cache
        kv = self._event_store()
        if self.dp.size > 1 and kv is not None:
            kv.pool.events = KVEventLog()
        if c.kv_events_endpoint is None:
            return None
        if kv is None:
            raise PyptoError(
                "kv_events_endpoint: KV events come from the paged KV store; this executor "
                "keeps its KV another way"
            )
        rank = self.dp.rank if self.dp.size > 1 else None
        endpoint = endpoint_for(c.kv_events_endpoint, rank or 0)
        replay = c.kv_events_replay_endpoint
        replay = endpoint_for(replay, rank or 0) if replay is not None else None
        topic, curve = c.kv_events_topic, Curve.of(c)
        publisher = KVEventPublisher(endpoint, topic, kv.page_size, rank, replay, curve)
        kv.pool.events = KVEventLog()
        return publisher

    def _ranks(self) -> str:
        return ", ".join(
            f"rank {i} (pid {w.pid}) exit code {w.exit_code(0)}"
            for i, w in enumerate(self.workers, start=1)
        )

    def _lost_ranks(self) -> str:
        """The local ranks that have exited, as 'rank 1 (pid 123, exit code -9)'."""
        return ", ".join(
            f"rank {i} (pid {w.pid}, exit code {code})"
            for i, w in enumerate(self.workers, start=1)
            if (code := w.exit_code(1.0)) is not None
        )

    def _stop_workers(self) -> None:
        for w in self.workers:
            w.stop(timeout=5.0)
        shutdown_distributed()

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise PyptoError (naming the parameter) unless the request fits the model."""
        vocab = self.model_config.vocab_size
        check_request(prompt_token_ids, params, vocab, self.max_model_len, self.config.max_logprobs)

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it fits the model."""
        self.check(request.prompt_token_ids, request.params)
        spec = request.params.structured_outputs
        if spec is not None and request.matcher is None:
            request.matcher = self.grammars.matcher(spec, request.params.min_tokens)
        request.max_model_len = self.max_model_len
        if request.handoff is not None:  # a prefill server computed its prompt
            self._receive(request, request.handoff)
            if request.finished:  # its first token ended it (a stop token, max_tokens 1)
                self.finished_on_arrival.append(request)
                return
        self.scheduler.add(request)

    def _paged_kv(self) -> KVGroups:
        """The paged executor's KV groups: what handoffs between servers move."""
        if not isinstance(self.executor, PagedExecutor):
            raise PyptoError("disaggregated serving needs the paged executor")
        return self.executor.kv

    def kv_layout(self) -> KVLayout:
        """What a handoff between servers must agree on (the KV's layout digest, with the
        TP and PP sizes), how each group's page reads, every rank's share of a page."""
        kv, p = self._paged_kv(), self.config.parallel
        digest = kv.layout_digest
        if p.ranks_per_engine > 1:
            digest += f"+tp{p.tensor_parallel_size}pp{p.pipeline_parallel_size}"
        return KVLayout(digest, kv.geometry(), self.handoff_page_bytes)

    def reserve(self, request_id: str, pages: list[int]) -> bool:
        """Take each KV group's `pages` device pages for a request whose KV a prefill server
        is about to send (it is admitted into them); False, taking none, when the pool has
        not the room now. Between steps, on the engine's thread."""
        return self._paged_kv().reserve(request_id, pages)

    def unreserve(self, request_id: str) -> None:
        """Give back what `reserve` took (the KV did not come, or the request went away)."""
        self._paged_kv().unreserve(request_id)

    def _receive(self, request: Request, handoff: Handoff) -> None:
        """Go on from where a prefill server stopped: its first token appended (the grammar
        and stop conditions see it as if sampled here), the sampler's state, and the prompt's
        KV held until the request is admitted (as a swapped request's)."""
        kv = self._paged_kv()
        if handoff.generator_state is not None and request.generator is not None:
            state = torch.frombuffer(bytearray(handoff.generator_state), dtype=torch.uint8)
            request.generator.set_state(state)
        request.append(handoff.first)
        if request.finished:  # nothing to decode: pages reserved for it go back
            kv.unreserve(request.request_id)
        else:
            keys = kv.receive(request, handoff.groups)
            if self.config.parallel.ranks_per_engine > 1:  # every rank holds its share
                assert isinstance(self.executor, PagedExecutor)
                shapes = counts(handoff.groups)
                send_received(keys, shapes, handoff.shares, self.executor.device)
        request.handoff = None  # its pages are the KV side's now

    def _export(self, out: SchedulerOutput, sampled: dict[str, list[Sampled]]) -> None:
        """A prefill server's requests whose first token was sampled in this step: their
        prompt's KV, that token and the sampler's state, handed off (`Request.handoff`)."""
        for s in out.scheduled:
            r, tokens = s.request, sampled.get(s.request.request_id)
            if not r.export_kv or not tokens or tokens[0].error is not None:
                continue
            first = tokens[0]
            kv = self._paged_kv()
            state = None if r.generator is None else bytes(r.generator.get_state().numpy())
            n = len(r.prompt_token_ids)
            groups = kv.export(r, n)  # (copied before it is freed)
            if self.config.parallel.ranks_per_engine > 1:  # every rank's share
                assert isinstance(self.executor, PagedExecutor)
                layout, device = self.kv_layout(), self.executor.device
                buffer, groups = gather_export(groups, kv.export_pages(r, n), layout, device)
            else:
                buffer, groups = packed(groups)
            r.handoff = Handoff(groups, first, state, buffer)

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        return self.scheduler.abort(request_ids, reason)

    def has_unfinished(self) -> bool:
        return bool(self.finished_on_arrival) or self.scheduler.has_unfinished()

    @torch.inference_mode()
    def embed(self, prompt_token_ids: list[int], params: PoolingParams) -> list[float]:
        """The prompt's embedding: one plain forward over it (a dense KV that is dropped, no
        page of the pool touched, no prefix cache), its final hidden states pooled. Between
        steps, on the engine's thread. One rank only."""
        if self.config.parallel.ranks_per_engine > 1:
            raise PyptoError(
                "embeddings run on one rank: start the embedding model without tensor or "
                "pipeline parallelism",
                "runner",
            )
        n = len(prompt_token_ids)
        if not 0 < n <= self.max_model_len:
            raise PyptoError(
                f"the input has {n} tokens; it must have 1 to {self.max_model_len} (the "
                "context length)",
                "input",
            )
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise PyptoError(f"token ids must be integers in [0, {vocab})", "input")
        model, device = self.executor.model, self.executor.device
        tokens = torch.tensor(prompt_token_ids, device=device)
        positions = torch.arange(n, device=device)
        progress = self.executor.progress if isinstance(self.executor, PagedExecutor) else None

        def layer_done(layer: Any, *args: Any) -> torch.Tensor:
            out = layer(*args)
            if progress is not None:  # the step watchdog sees a long embedding move on
                progress.layers += 1
            return out

        hidden = model(tokens, positions, DenseKV(model.cfg.num_layers), run_layer=layer_done)
        return pool(hidden, params)

    def tokens_computed(self) -> int:
        """Prompt and generated tokens computed so far (cheap: for per-step counts)."""
        return self.prompt_tokens + self.generation_tokens

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            len(s.running),
            len(s.waiting),
            self.executor.kv.usage(),
            s.prefix_queries,
            s.prefix_hits,
            s.num_preemptions,
            s.num_swapped,
            self.executor.num_recompilations,
            isinstance(self.executor, PagedExecutor) and self.executor.compiling,
            self.prompt_tokens,
            self.generation_tokens,
            tuple(kv.tier_stats()) if isinstance(kv := self.executor.kv, KVGroups) else (),
            layer_costs=self.layer_costs,
            spec_decode=self.speculator.stats() if self.speculator is not None else None,
        )

    @property
    def layer_costs(self) -> tuple[float, float]:
        """What a layer costs here, as `EngineStats.layer_costs` (zeros before a prefill
        step, and off the paged executor). None learnt under DP attention + EP: a step's time
        there includes waiting, at every MoE layer, for the other replicas' steps (as under TP,
        whose steps the executor does not time)."""
        if not isinstance(self.executor, PagedExecutor) or self.lockstep:
            return (0.0, 0.0)
        p = self.executor.progress
        return (p.attention_s_per_work, p.other_s_per_token)

    @property
    def progress(self) -> int:
        """Moves on while a step works (as each layer attends, on the paged executor, and as
        its constrained rows' masks are filled): the step watchdogs' sign of life."""
        layers = self.executor.progress.layers if isinstance(self.executor, PagedExecutor) else 0
        return layers + self.grammars.masks_filled

    def close(self) -> None:
        """Finish background work (the SSD tier's queued writes), stop the tensor-parallel
        ranks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        publisher: KVEventPublisher | None = getattr(self, "kv_events", None)
        if publisher is not None:
            publisher.close()
        if isinstance(self.executor, PagedExecutor):
            self.executor.close()
        if self.draft_model is not None:
            self.draft_model.close()
        if self.config.parallel.ranks_per_engine > 1:  # local ranks, and the group itself
            self._stop_workers()
            torch.set_num_threads(self._num_threads)
        elif self.lockstep:
            shutdown_distributed()
        gc.unfreeze()  # what the engine held may be collected again (its cycles too)

    def step(self) -> list[Request]:
        """One engine step; returns the requests that got a new token or finished."""
        arrived, self.finished_on_arrival = self.finished_on_arrival, []
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.lockstep:  # the other replicas' tokens may need this one's experts
                assert isinstance(self.executor, PagedExecutor)
                self.executor.join_expert_exchange()
            return arrived
        for s in out.scheduled:
            r = s.request
            prompt_end = min(r.num_computed_tokens + s.num_new_tokens, len(r.prompt_token_ids))
            self.prompt_tokens += max(prompt_end - r.num_computed_tokens, 0)
        try:
            sampled = self.executor.execute(out)
        except RuntimeError as e:
            if lost := self._lost_ranks():  # a collective failed because a rank died
                raise EngineDeadError(f"{lost} stopped") from e
            raise
        self.generation_tokens += sum(map(len, sampled.values()))
        self._export(out, sampled)
        self.scheduler.update(out, sampled)
        kv = self._event_store()
        if kv is not None and kv.pool.events is not None:
            events = kv.events_taken()
            if self.kv_events is not None:
                self.kv_events.publish(events)
            if self.dp.size > 1:
                self.page_events += events
        return arrived + [s.request for s in out.scheduled if s.request.request_id in sampled]
