"""The paged executor: one batched forward per step over every scheduled request.

Prefill chunks and decodes of all requests go through the model together as one flat token
batch; the executor hands the attention operator (`StepAttention`) the requests' page lists,
positions and lengths, and the operator maps its slots itself (no per-token Python). The
forward is compiled once at start-up (warm-up covers every graph shape) unless
`enforce_eager`; on the CPU a step of up to 8 decodes runs instead as one call of the native
decode step (`native_decode.py`), where it applies.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pypto_serving.config import CacheConfig, EngineConfig
from pypto_serving.device import synchronize
from pypto_serving.distributed import (
    JOIN_EXPERTS,
    KV_EXPORT,
    KV_RECEIVE,
    SSD_LOAD,
    STOP,
    Control,
    StepInputs,
    broadcast_step,
    receive_from,
    receive_step,
    send_to,
)
from pypto_serving.errors import PyptoError
from pypto_serving.executor.compiled import (
    COUNTER,
    CompiledLayers,
    forward_logits,
    trust_cpu_vector_isa,
)
from pypto_serving.executor.kv_shares import hold_received, send_export
from pypto_serving.executor.kv_stores import build_kv_store
from pypto_serving.executor.mtp import MTPDrafter
from pypto_serving.executor.native_decode import FEW_ROWS as NATIVE_FEW_ROWS
from pypto_serving.executor.native_decode import NativeDecoder
from pypto_serving.executor.prompt_logprobs import prompt_scoring, score_prompts
from pypto_serving.grammar import Grammars
from pypto_serving.kv.mirror import (
    agree_ssd_loads,
    follow_moves,
    group_moves,
    ssd_load_group,
    ssd_load_message,
    take_moves,
)
from pypto_serving.kv.paged_attention import PagedKV, StepBatch, StepProgress, active_step
from pypto_serving.models.llama import CausalLM
from pypto_serving.models.loader import checkpoint_digest
from pypto_serving.native import library
from pypto_serving.ops.sampler import Sampled, SamplingRow, sample
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams
from pypto_serving.scheduler import ScheduledRequest, SchedulerOutput
from pypto_serving.speculative import ROW_COST

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class AttentionPlan:
    """How one rank's share of a model attends and steps (decided by engine/plan.py's
    `plan_attention`)."""

    kind: str
    """The model's attention kind (`kv/kinds/`, its `NAME`)."""
    kernels: tuple[int, int] | None
    """(query heads per KV head, head_dim): the shape of the native attention library its
    paged operator attends with; None: PyTorch's attention."""
    compiled: bool
    """Its decoder layers run compiled (warm-up compiles them); else eagerly."""
    native_decode: bool
    """Its steps of a few decodes run as one call of the native decode step."""
    native_rows: int = NATIVE_FEW_ROWS
    """The most decodes a native step takes (native_decode.py's FEW_ROWS, or MAX_ROWS where
    the records are the model's only weights)."""
    own_kernels: bool = False
    """Its kind's operator runs its own native kernels (`AttentionKind.OWN_KERNELS`)."""
    draft_row_cost: float = ROW_COST
    """What a speculative draft's row adds to a step, as a fraction of a one-row step
    (`native_decode.draft_row_cost` where the native step runs)."""


def part_of(step: StepInputs, first: int, end: int) -> StepInputs:
    """The step's sequences first .. end - 1 as a step of their own (no page moves): their
    tokens, pages and lengths, the rows of `logits_index` among their tokens (or row 0, as a
    step always has one, when none is)."""
    token_ends = torch.cumsum(step.q_lens, 0).tolist()
    lo = token_ends[first - 1] if first else 0
    hi = token_ends[end - 1]
    rows = step.logits_index
    wanted = rows[(rows >= lo) & (rows < hi)] - lo
    q_lens = step.q_lens[first:end]
    return StepInputs(
        step.input_ids[lo:hi],
        step.positions[lo:hi],
        [group[first:end] for group in step.pages],
        q_lens,
        step.ctx_lens[first:end],
        wanted if len(wanted) else torch.zeros(1, dtype=rows.dtype, device=rows.device),
        max(0, min(step.num_decodes, end) - first),
        int(q_lens.max()),
    )


def _agrees(kept: list[Sampled], drafts: list[int]) -> bool:
    """Whether a draft row's sample counts: every row before it sampled its draft (`kept`
    holds those samples, the last of which is the draft this row follows)."""
    return len(kept) == len(drafts) and all(
        t.error is None and t.token_id == d for t, d in zip(kept, drafts, strict=True)
    )


def build_paged_executor(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    attention: AttentionPlan,
    model_dir: Path,
) -> PagedExecutor:
    """The paged executor of an engine (or of one tensor-parallel rank: every rank builds the
    same one, so page counts agree), its pool sized for the longest sequences, attending and
    stepping as `attention` says (the loader packed the model for its native decode step);
    quantization: the model's (the run plan's, auto resolved)."""
    cfg = model.cfg
    max_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
    return PagedExecutor(
        model,
        device,
        dtype,
        config.cache,
        config.scheduler.max_num_seqs * max_len,
        attention,
        # the KV of a quantized model differs: its SSD pages must not mix with the plain ones
        # (and an MTP layer's entries beside the target's make other pages again)
        checkpoint_digest(model_dir)
        + (f"|{quantization}" if quantization else "")
        + ("|mtp" if model.kv_layers != model.local_layers else ""),
        (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens),
        config.batch_invariant,
    )


class PagedExecutor:
    """Runs steps on its model. Under tensor or pipeline parallelism rank 0's executor builds
    each step and broadcasts its inputs; the other ranks' executors `follow()`, running the
    same forward on their shares (TP: the collectives inside the model join them; PP:
    activations pass stage to stage), and never sample."""

    grammars: Grammars | None = None
    """The engine's structured-output matchers (set by the engine): a step fills the masks of
    its constrained rows while its forward runs."""
    mtp: MTPDrafter | None = None
    """DeepSeek's multi-token prediction layer drafting (set at start-up on rank 0 where the
    config asks for it): a step hands it its hidden states once it has sampled."""
    keeps_hidden: bool = False
    """Whether rank 0 keeps every row's final hidden states (for `mtp`; set on every rank):
    under PP the last stage sends them to rank 0 beside the logits."""
    _hidden: torch.Tensor | None = None
    """The last forward's final hidden states (kept for `mtp`)."""
    _mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pypto-grammar")

    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        cache: CacheConfig,
        max_tokens_in_use: int,
        attention: AttentionPlan,
        digest: str = "",
        running: tuple[int, int] = (1, 1),
        batch_invariant: bool = False,
    ) -> None:
        """max_tokens_in_use: the most tokens all running sequences can hold at once;
        attention: how the model attends and steps (the run plan's `plan_attention`); digest:
        identifies the checkpoint (keys the SSD tier's pages); running: (max_num_seqs,
        max_num_batched_tokens), what a windowed kind's rows hold; batch_invariant: decodes
        attend through the prefill kernel (`StepAttention`)."""
        self.model, self.device, self.dtype, self.groups = model, device, dtype, model.groups
        self.batch_invariant = batch_invariant
        self.attention_kernel = None if attention.kernels is None else library(*attention.kernels)
        """The native paged attention library, or None for PyTorch's attention."""
        self.own_kernels = attention.own_kernels
        if cache.kv_cache_dtype == "int8" and self.attention_kernel is None:
            raise PyptoError(
                "kv_cache_dtype int8 needs the native CPU attention kernels, which did not "
                "build here (a C++ compiler: g++, or $CXX; see the log)"
            )
        self.kv = build_kv_store(
            model, device, dtype, cache, max_tokens_in_use, digest, running=running
        )
        if self.groups.world_size > 1 and self.groups.rank == 0:
            for i, m in enumerate(self.kv.managers):
                if m.pool.ssd is not None:
                    m.pool.agree = functools.partial(self._agree_ssd_loads, i)
        self.paged_kv = PagedKV()
        self.progress = StepProgress()
        """Layers attended so far, and what a layer costs here (read by the watchdogs)."""
        self.native: NativeDecoder | None = None
        """Runs steps of up to `native_rows` decodes in one native call; other steps run on
        the graphs."""
        self.native_rows = attention.native_rows
        if attention.native_decode and self.attention_kernel is not None:
            self.native = NativeDecoder(model, self.kv.pool.cache, self.attention_kernel)
        self.run_layer = CompiledLayers() if attention.compiled else None
        """How the model's decoder layers run: compiled, or eagerly (None)."""
        self._warming: threading.Thread | None = None
        """The warm-up compiling in the background (`warmup(background=True)`), if any."""
        self._stop_warming = threading.Event()

    @property
    def num_recompilations(self) -> int:
        return COUNTER.num_recompilations

    @property
    def compiling(self) -> bool:
        """Whether warm-up is still compiling in the background (steps run eagerly where a
        graph is missing)."""
        return self._warming is not None and self._warming.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background warm-up to finish; whether it has."""
        if self._warming is not None:
            self._warming.join(timeout)
        return not self.compiling

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[Sampled]]:
        """Run one step; what it samples for each request that caught up: one token, or for
        a request with drafts (speculative decoding) the drafts its samples agree with and
        the sample after them."""
        # decodes first, then prefill chunks: each kind gets its own attention; a request's
        # drafts are decodes too, one row each at its position after its last token
        scheduled = sorted(
            out.scheduled, key=lambda s: s.num_new_tokens > 1 and not (s.draft or s.as_rows)
        )
        seqs: list[tuple[Request, int, int]] = []  # (request, first position, tokens)
        token_ids: list[int] = []
        drafted: dict[int, list[int]] = {}  # a draft row's sequence -> the drafts before it
        drafts: dict[int, list[int]] = {}  # a drafting request's first row -> its drafts
        for s in scheduled:
            r, start = s.request, s.request.num_computed_tokens
            if s.as_rows:
                seqs += [(r, start + i, 1) for i in range(s.num_new_tokens)]
                token_ids += r.tokens(start, start + s.num_new_tokens)
                continue
            if not s.draft:
                seqs.append((r, start, s.num_new_tokens))
                token_ids += r.tokens(start, start + s.num_new_tokens)
                continue
            drafts[len(seqs)] = s.draft
            for i, token in enumerate([*r.tokens(start, start + 1), *s.draft]):
                drafted[len(seqs)] = s.draft[:i]
                seqs.append((r, start + i, 1))
                token_ids.append(token)
        reqs = [r for r, _, _ in seqs]
        starts = [start for _, start, _ in seqs]
        counts = [n for _, _, n in seqs]
        num_decodes = sum(n == 1 for n in counts)
        dev = self.device
        q_lens = torch.tensor(counts, device=dev)
        ctx_lens = torch.tensor(starts, device=dev) + q_lens
        q_ends = torch.cumsum(q_lens, 0)
        seq = torch.repeat_interleave(torch.arange(len(reqs), device=dev), q_lens)
        positions = ctx_lens[seq] - q_ends[seq] + torch.arange(len(token_ids), device=dev)
        started = time.perf_counter()
        done = [
            b for b, r in enumerate(reqs) if b in drafted or starts[b] + counts[b] == r.num_tokens
        ]
        ends = list(itertools.accumulate(counts))
        scoring = prompt_scoring(reqs, starts, counts)
        score_rows = [
            ends[b] - counts[b] + p - starts[b] for b, lo, hi in scoring for p in range(lo, hi)
        ]
        rows_wanted = sorted(score_rows + [ends[b] - 1 for b in done]) or [0]  # never empty
        logits_index = torch.tensor(rows_wanted, device=dev)
        step = StepInputs(
            torch.tensor(token_ids, device=dev),
            positions,
            list(self.kv.pages([r.request_id for r in reqs]).values()),
            q_lens,
            ctx_lens,
            logits_index,
            num_decodes,
            max(counts),
            self._take_moves(),
        )
        constrained = [b for b in done if reqs[b].matcher is not None and b not in drafted]
        drafting = {b: d for b, d in drafts.items() if reqs[b].matcher is not None}
        masks = (  # filled in a thread while the forward runs (both release the GIL)
            self._mask_thread.submit(self._fill_masks, reqs, constrained, drafting)
            if (constrained or drafting) and self.grammars is not None
            else None
        )
        logits = self.run(step)
        if scoring:  # the logits hold both kinds of rows: part them
            at = {row: i for i, row in enumerate(rows_wanted)}
            score_prompts(logits[[at[r] for r in score_rows]], reqs, scoring)
            logits = logits[[at[ends[b] - 1] for b in done]] if done else logits
        allowed = masks.result() if masks else {}
        if self.mtp is None:  # (with it: once its entries of the step's tokens are written)
            self._cache_full_pages(scheduled)
        if len(token_ids) >= self.kv.page_size:  # prefill-heavy: the rate recompute would cost
            synchronize(dev)
            self.kv.observe_compute(len(token_ids), time.perf_counter() - started)
        rows = [
            SamplingRow(
                reqs[b].params,
                reqs[b].prompt_token_ids,
                [*reqs[b].output_token_ids, *drafted[b]]
                if b in drafted
                else reqs[b].output_token_ids,
                reqs[b].generator,
                reqs[b].eos_token_ids,
                allowed.get(b),
            )
            for b in done
        ]
        sampled: dict[str, list[Sampled]] = {}
        for b, got in zip(done, sample(logits, rows) if done else [], strict=True):
            kept = sampled.setdefault(reqs[b].request_id, [])
            if b not in drafted or _agrees(kept, drafted[b]):
                kept.append(got)
        if self.mtp is not None:
            assert self._hidden is not None
            self.mtp.catch_up(self, seqs, drafts, sampled, self._hidden)
            self._hidden = None
            self._cache_full_pages(scheduled)
        for s in (s for s in scheduled if s.draft):
            r = s.request
            held = [t.token_id for t in sampled[r.request_id][:-1]]  # drafts computed here
            self.kv.cache_full_pages(r, r.num_tokens + len(held), r.token_ids + held)
            self.kv.trim(r, r.num_tokens + len(held))  # the rejected drafts' KV goes
        return sampled

    def _cache_full_pages(self, scheduled: list[ScheduledRequest]) -> None:
        """Index the pages the step's requests without drafts filled (a request with drafts:
        once the step knows which it keeps)."""
        for s in scheduled:
            if not s.draft:
                self.kv.cache_full_pages(
                    s.request, s.request.num_computed_tokens + s.num_new_tokens
                )

    def _fill_masks(
        self, reqs: list[Request], rows: list[int], drafting: dict[int, list[int]]
    ) -> dict[int, torch.Tensor]:
        """The grammar masks of a step's constrained rows (by row): one row's each, and a
        drafting request's at each of its rows (the matcher as if the drafts before it were
        consumed)."""
        assert self.grammars is not None
        matchers = [reqs[b].matcher for b in rows]
        out = dict(zip(rows, self.grammars.fill_masks(matchers), strict=True))
        for first, draft in drafting.items():
            masks = self.grammars.fill_draft_masks(reqs[first].matcher, draft)
            out.update((first + i, mask) for i, mask in enumerate(masks))
        return out

    def run(self, step: StepInputs) -> torch.Tensor:
        """The forward of one step: rank 0 broadcasts it first to the other ranks; a pipeline
        stage receives the previous stage's hidden states and sends its own to the next, and
        the last stage's logits go back to rank 0, which samples. Where the native decode
        step runs, it takes the step's decodes (up to `native_rows`), and a prefill chunk
        beside them runs on the graphs alone: a decode is computed the same way whatever
        shares its step."""
        g = self.groups
        if g.world_size > 1 and g.rank == 0:
            broadcast_step(step, self.device)
        if step.moves:  # rank 0's page moves, mirrored on every rank's share
            self._follow_moves(step.moves)
        nd = step.num_decodes
        if self.native is None or not 0 < nd <= self.native_rows:
            return self._forward(step)
        if step.max_q == 1:  # decodes alone (a 1-token prefill chunk counts among them)
            return self._native_logits(step, step.logits_index)
        wanted = step.logits_index
        decodes = self._native_logits(part_of(step, 0, nd), wanted[wanted < nd])
        rest = self._forward(part_of(step, nd, len(step.q_lens)))
        return torch.cat([decodes, rest]) if bool((wanted >= nd).any()) else decodes

    def _native_logits(self, step: StepInputs, wanted: torch.Tensor) -> torch.Tensor:
        """The logits of the rows `wanted` of a step of decodes, through the native step
        (under TP: every rank, each its share)."""
        assert self.native is not None
        attention = self.model.attention_kind.step(self.kv, self.model.cfg, self.batch_of(step))
        logits = self.native.logits(
            step.input_ids,
            step.positions,
            attention.slot_mapping,
            attention.block_table,
            step.ctx_lens,
        )  # every row's; the step samples those that caught up (all, unless a 1-token chunk)
        return logits if len(wanted) == len(logits) else logits[wanted]

    def batch_of(self, step: StepInputs) -> StepBatch:
        """What the kind's operator maps the step's slots from."""
        return StepBatch(
            {m.name: pages for m, pages in zip(self.kv.managers, step.pages, strict=True)},
            step.positions,
            step.q_lens,
            step.ctx_lens,
            step.num_decodes,
            step.max_q,
            self.attention_kernel,
            self.progress,
            self.batch_invariant,
            self.model.local_layers,
            self.own_kernels,
        )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The step's forward on the graphs (rank 0's logits of its `logits_index` rows)."""
        g = self.groups
        attention = self.model.attention_kind.step(self.kv, self.model.cfg, self.batch_of(step))
        hidden = None
        if g.pp.rank > 0:
            shape = self.model.stage_output_shape(len(step.input_ids))
            hidden = receive_from(shape, g.rank - g.tp.size, self.device)
        started = time.perf_counter()
        final = None  # the final hidden states of every row, where the MTP layer reads them
        with active_step(attention):
            if self.keeps_hidden and self.model.last_stage:
                final = self.model(
                    step.input_ids, step.positions, self.paged_kv, hidden, self.run_layer
                )
                out = self.model.logits(final[step.logits_index])
            else:
                out = forward_logits(
                    self.model,
                    self.paged_kv,
                    step.input_ids,
                    step.positions,
                    step.logits_index,
                    hidden,
                    self.run_layer,
                )
        if attention.prefill_work and g.world_size == 1:  # what a layer costs, for admission
            synchronize(self.device)
            seconds, layers = time.perf_counter() - started, self.model.num_local_layers
            self.progress.observe(attention, seconds, layers, len(step.input_ids))
        if g.pp.size == 1:
            self._hidden = final if self.mtp is not None else None  # (TP: rank 0's alone)
            return out
        last = (g.pp.size - 1) * g.tp.size  # the last stage's first TP rank
        if not self.model.last_stage:
            send_to(out, g.rank + g.tp.size)
        elif g.rank == last:
            send_to(out, 0)
            if final is not None:
                send_to(final.float(), 0)
        if g.rank == 0:  # the last stage's logits (and final hidden states)
            shape = (len(step.logits_index), self.model.cfg.vocab_size)
            out = receive_from(shape, last, self.device)
            if self.keeps_hidden:
                shape = (len(step.input_ids), self.model.cfg.hidden_size)
                self._hidden = receive_from(shape, last, self.device)
        return out

    def _take_moves(self) -> bytes:
        """Rank 0: every KV group's page moves since the last step, for the other ranks."""
        return take_moves([m.pool.journal for m in self.kv.managers])

    def _follow_moves(self, moves: bytes) -> None:
        g, managers = self.groups, self.kv.managers
        for m, ops in zip(managers, group_moves(moves, len(managers)), strict=True):
            if ops:
                kv = m.pool
                shared = kv.cache.spec.same_on_tp_ranks and g.tp.size > 1
                args = (kv.ssd, kv.agreed, kv.received)
                follow_moves(ops, kv.cache, kv.cpu, g.rank, g.tp.rank, shared, *args)

    def _on_ssd_load(self, message: bytes) -> int:
        g, kv = self.groups, self.kv.managers[ssd_load_group(message)].pool
        shared = kv.cache.spec.same_on_tp_ranks and g.tp.size > 1
        return agree_ssd_loads(
            message, kv.cache, kv.cpu, kv.ssd, kv.agreed, g.rank, g.tp.rank, shared, kv.received
        )

    def _agree_ssd_loads(self, group: int, hashes: list[bytes], loaded: int) -> int:
        """Rank 0, at admission to KV group `group`: how many of the SSD pages it read every
        rank read too."""
        journal = self.kv.managers[group].pool.journal
        assert journal is not None
        message = ssd_load_message(group, journal.take(), hashes, loaded)
        broadcast_step(Control(SSD_LOAD, message), self.device)
        return self._on_ssd_load(message)

    @torch.inference_mode()
    def join_expert_exchange(self) -> None:
        """DP attention + EP, no tokens in this replica this step: every rank of it joins the
        MoE layers' exchanges (rank 0 tells the others first)."""
        if self.groups.world_size > 1:
            broadcast_step(Control(JOIN_EXPERTS), self.device)
        self.model.join_expert_exchange()

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run the steps rank 0 broadcasts until it says stop (after the last
        page moves: its spill to the SSD tier), then finish the SSD tier's writes."""
        while True:
            step = receive_step(self.device, len(self.kv.managers))
            if isinstance(step, StepInputs):
                self.run(step)
            elif step.kind == SSD_LOAD:
                self._on_ssd_load(step.data)
            elif step.kind == JOIN_EXPERTS:
                self.model.join_expert_exchange()
            elif step.kind == KV_EXPORT:
                send_export(self.kv, self.groups, step.data, self.device)
            elif step.kind == KV_RECEIVE:
                hold_received(self.kv, self.groups, step.data, self.device)
            else:
                break
        if step.data:
            self._follow_moves(step.data)
        self.kv.close()

    def close(self) -> None:
        """Tell the other ranks to stop (rank 0), finish the KV store's background work and
        a background warm-up (after the graph it is compiling)."""
        if self.compiling:
            self._stop_warming.set()
            log.info("waiting for the background compile to finish its graph")
            self.wait_compiled()
        if self.groups.world_size > 1 and self.groups.rank == 0:
            try:
                self.kv.keep_on_ssd()  # the spill's moves ride on the stop message
                broadcast_step(Control(STOP, self._take_moves()), self.device)
            except RuntimeError:  # a rank died: the others stop when rank 0 leaves the group
                log.warning("could not tell every rank to stop; they stop with this process")
        self.kv.close()

    def _warmup_step(self, plan: list[tuple[Request, int]], reqs: list[Request]) -> None:
        out = SchedulerOutput([ScheduledRequest(r, n) for r, n in plan])
        for r, n in plan:
            if not self.kv.allocate(r, n):
                raise PyptoError(f"the KV cache ({self.kv.num_pages} pages) is too small to run")
        for request_id, tokens in self.execute(out).items():
            next(q for q in reqs if q.request_id == request_id).output_token_ids.append(
                tokens[0].token_id
            )
        for r, n in plan:
            r.num_computed_tokens += n

    def warmup(self, background: bool = False) -> None:
        """Compile every graph shape serving can meet: decode of one, of many, prefill, mixed.

        background: return at once and compile in a thread, over a small KV store of its own,
        while steps run eagerly wherever a graph is not there yet (each is used as soon as it
        is): the first token of a cold start then waits for the model, not for g++. Not
        under tensor or pipeline parallelism, whose warm-up steps are collective."""
        if self.run_layer is None:
            return
        if not background or self.groups.world_size > 1:
            self._compile_shapes(self, progress=True)
            return
        cache = CacheConfig(
            page_size=self.kv.page_size,
            num_kv_pages=2 * -(-9 // self.kv.page_size),  # the warm-up's requests: 8, 9 tokens
            kv_cpu_bytes=0,
            enable_prefix_caching=False,
            kv_cache_dtype="int8" if self.kv.pool.cache.spec.dtype == torch.int8 else "auto",
        )
        scratch = copy.copy(self)  # the same model and graphs; its own pages
        scratch.kv = build_kv_store(self.model, self.device, self.dtype, cache, 0, "", False)
        scratch.native = None  # it writes the serving store's pages, and compiles nothing
        scratch.mtp = None  # its guesses are the serving steps' (the graphs are the target's)
        scratch.progress = StepProgress()  # its steps are no progress of the serving ones
        self.run_layer.compiler = self._warming = threading.Thread(
            target=self._compile_beside, args=(scratch,), name="pypto-compile", daemon=True
        )
        log.info("compiling in the background; serving eagerly until each graph is ready")
        self._warming.start()

    def _compile_beside(self, scratch: PagedExecutor) -> None:
        try:
            self._compile_shapes(scratch, progress=False)
        except Exception:  # a bug, not a missing compiler: serve on, eagerly
            log.exception("the background compile failed; serving eagerly")
            self.run_layer = None
        finally:
            scratch.kv.close()
            if self.run_layer is not None:
                self.run_layer.compiler = None

    def _compile_shapes(self, runner: PagedExecutor, progress: bool) -> None:
        """Run warm-up steps on `runner` (this executor, or one sharing its model over a KV
        store of its own) until every graph is compiled, then count what follows as
        recompilations."""
        start, compiles = time.perf_counter(), COUNTER.num_compiles
        if self.device.type == "cpu":
            # first: it imports Inductor (and dynamo) under its lock, which the start-up's
            # background check holds while it imports them; importing them here at the same
            # time failed with a circular ImportError (two threads in dynamo's __init__)
            trust_cpu_vector_isa()
        from torch._dynamo.exc import BackendCompilerFailed  # torch.compile's (~2 s) imports
        from torch._inductor.exc import InductorError

        assert self.run_layer is not None
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        reqs = [Request(f"warmup-{i}", [1 + i] * (5 + 3 * i), params) for i in range(2)]
        plans = [
            [(reqs[0], 5)],
            [(reqs[0], 1)],
            [(reqs[1], 8), (reqs[0], 1)],
            [(reqs[0], 1), (reqs[1], 1)],
        ]
        try:
            for plan in tqdm(plans, desc="compiling (once; cached on disk)", disable=not progress):
                if self._stop_warming.is_set():
                    return
                runner._warmup_step(plan, reqs)
        except (BackendCompilerFailed, InductorError) as e:  # e.g. no C++ compiler here
            log.warning(
                "torch.compile failed, serving eagerly (as --enforce-eager): %s",
                str(e).splitlines()[0][:300],
            )
            self.run_layer = None
        finally:
            for r in reqs:
                runner.kv.free(r)
                if runner.mtp is not None:
                    runner.mtp.forget(r.request_id)
        COUNTER.mark_warm()
        log.info(
            "warm-up compiled %d graphs in %.1fs%s",
            COUNTER.num_compiles - compiles,
            time.perf_counter() - start,
            "" if progress else " in the background; serving on them now",
        )
