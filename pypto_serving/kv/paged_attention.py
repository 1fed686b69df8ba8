"""The paged attention operator's machinery, shared by every attention kind (`kv/kinds/`).

Tokens of a step arrive flat ([T], sequences concatenated, decodes first), with the
sequences' page lists from the pool: from them the operator computes its block table and slot
mapping itself (`paged_cache.block_table`, `slot_mapping`; slot = page * page_size + offset).
For each layer the kind writes its new entries into its cache's slots
(`paged_cache.PagedCache`, through `StepAttention.slot_mapping`), then `StepAttention.attend`
attends for the decodes and for the prefill chunks separately. On the CPU the native kernels
(`native_attention`) read the pages in place. Otherwise (CUDA, no compiler, a shape they do
not take) PyTorch's path gathers each sequence's keys and values page by page through its
block table into a padded [kv_head, B, ctx] batch: decodes attend with two batched matmuls,
prefill chunks with one masked, causal, GQA-aware scaled-dot-product attention. A kind whose
keys and values are one tensor (MLA's latent) passes it as both, and it is gathered once.

To the compiler each kind's operator is one opaque custom op (GQA: `pypto::paged_attention(q,
k, v, layer)`): the step's metadata and the KV tensors are reached through the active
`StepAttention` (`current_step`, set by the executor around the forward), so a compiled model
never sees cache mutation or the per-step shapes of the metadata (the vLLM "forward context"
pattern). The model is given a `PagedKV`, which tells its kinds to take that path.

Each layer's attention also advances the executor's `StepProgress`: the step watchdogs tell a
long step (layers keep coming) from a hung one by it, and the layer costs it measures let the
engine refuse up front a prompt one layer of which would outlast the watchdog's limit.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pypto_serving.kv.native_attention import paged_attention as native_attention
from pypto_serving.kv.paged_cache import PagedCache, block_table, slot_mapping
from pypto_serving.ops.attention import KVAttention

if TYPE_CHECKING:
    from pypto_serving.kv.groups import KVGroups


class _ActiveSteps(threading.local):
    """Per thread: the steps whose attention metadata the attention op reads (a warm-up
    compiling in the background runs its own steps beside the serving thread's)."""

    def __init__(self) -> None:
        self.steps: list[StepAttention] = []


_active = _ActiveSteps()

EMA = 0.3
"""Weight of a new measurement in StepProgress's running layer costs."""


@dataclass(slots=True)
class StepProgress:
    """An executor's steps as they run, read from other threads by the step watchdogs
    (engine/async_llm.py, a data-parallel replica's heartbeat): `layers` moves on as each
    layer attends, so a step that runs long but keeps moving is told from one that hangs.
    Also what a layer costs here, measured on prefill steps (0 until one ran), for
    `layer_seconds`."""

    layers: int = 0
    """Layers attended by this executor's steps so far."""
    attention_s_per_work: float = 0.0
    """One layer's prefill attention, seconds per (query token x context token)."""
    other_s_per_token: float = 0.0
    """The rest of one layer (projections, MLP, norms), seconds per token of the step."""

    def layer_seconds(self, tokens: int, context: int) -> float:
        """About how long one layer of a prefill chunk of `tokens` tokens ending at `context`
        takes here (0.0 before any prefill step was measured)."""
        return tokens * (self.attention_s_per_work * context + self.other_s_per_token)

    def observe(self, step: StepAttention, seconds: float, layers: int, tokens: int) -> None:
        """Learn from a step that ran `layers` layers over `tokens` tokens in `seconds`."""
        if step.prefill_work == 0 or layers == 0:
            return
        attention = step.prefill_seconds / (layers * step.prefill_work)
        other = max(seconds - step.attention_seconds, 0.0) / (layers * tokens)
        weight = 1.0 if self.other_s_per_token == 0.0 else EMA  # the first sets them
        self.attention_s_per_work += weight * (attention - self.attention_s_per_work)
        self.other_s_per_token += weight * (other - self.other_s_per_token)


@dataclass(slots=True)
class StepBatch:
    """One step's sequences as the executor lays them out (decodes first), for a kind's
    `step` to build its operator from."""

    pages: dict[str, list[list[int]]]
    """Each KV group's (by name, in the kind's order): each sequence's page ids (as rank 0
    sends them to the others under tensor or pipeline parallelism)."""
    positions: torch.Tensor
    """[T] the new tokens' positions."""
    q_lens: torch.Tensor
    """[B] new tokens per sequence."""
    ctx_lens: torch.Tensor
    """[B] tokens per sequence after the step (the new ones included)."""
    num_decodes: int
    max_q: int
    kernel: ctypes.CDLL | None = None
    """The native attention library, where the run plan attends with it."""
    progress: StepProgress | None = None
    """The executor's, advanced by each layer."""
    decodes_as_prefill: bool = False
    """--batch-invariant: decodes attend through the prefill kernel (`StepAttention`)."""
    layers: range | None = None
    """The checkpoint indices of the rank's layers (its pipeline stage's); None: the whole
    model's."""
    own_kernels: bool = False
    """The kind's operator runs its own native kernels (the run plan's `own_kernels`)."""


class _Group:
    """Sequences of one kind in a step (all decodes, or all prefill chunks): their pages, and
    for PyTorch's path their masks. Its tokens are `tokens` of the step's flat batch; `kernel`
    is the native attention library, or None for PyTorch's path; `window`: each query sees
    only the last `window` positions (its own among them), and each sequence gathers only the
    pages from the first its earliest query's window reaches (the ones before may have been
    given back: never read)."""

    def __init__(
        self,
        page_size: int,
        kv_heads: int,
        block_table: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        tokens: slice,
        max_q: int,
        kernel: ctypes.CDLL | None = None,
        window: int | None = None,
    ) -> None:
        assert kernel is None or window is None, "the native kernels read every page"
        self.page_size, self.tokens, self.decode = page_size, tokens, max_q == 1
        self.kernel = kernel
        if kernel is not None:  # reads pages in place: no gather, no mask
            self.block_table, self.ctx_lens = block_table.contiguous(), ctx_lens.contiguous()
            self.q_lens = None if self.decode else q_lens.contiguous()
            return
        device, starts = block_table.device, ctx_lens - q_lens  # each sequence's first query
        first = torch.zeros_like(starts)  # each sequence's first page read
        if window is not None:
            first = (starts - (window - 1)).clamp(min=0) // page_size
            width = int(((ctx_lens + page_size - 1) // page_size - first).max())
            cols = first[:, None] + torch.arange(width, device=device)[None, :]
            held = block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1))
            block_table = torch.where(cols < block_table.shape[1], held, 0)  # padding: page 0
        batch, width = block_table.shape
        self.pages = block_table.flatten()  # keys are gathered whole pages at a time
        self.shape = (batch, width * page_size)  # [B, padded context]
        j = torch.arange(self.shape[1], device=device)
        keys = first[:, None] * page_size + j[None, :]  # [B, ctx]: each key's position
        inside = keys < ctx_lens[:, None]  # keys that exist
        if self.decode:  # one query per sequence: padding (and keys before a window) masked
            if window is not None:
                inside &= keys > (ctx_lens - 1 - window)[:, None]
            bias = torch.zeros(self.shape, device=device).masked_fill(~inside, -torch.inf)
            self.bias = bias[None].expand(kv_heads, -1, -1).reshape(-1, 1, self.shape[1])
            return
        i = torch.arange(max_q, device=device)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        self.q_index = (q_starts[:, None] + i[None, :]).clamp(max=int(q_lens.sum()) - 1)
        # a padded query row repeats its sequence's last query (never a row that sees nothing)
        queries = starts[:, None] + torch.minimum(i[None, :], q_lens[:, None] - 1)  # [B, max_q]
        seen = keys[:, None, :] <= queries[:, :, None]
        if window is not None:
            seen &= keys[:, None, :] > queries[:, :, None] - window
        self.mask = (seen & inside[:, None, :])[:, None]  # [B, 1, max_q, ctx]
        valid = (i[None, :] < q_lens[:, None]).flatten()  # padded query rows to drop
        self.out_index = valid.nonzero().squeeze(1)

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """[Hkv, slots, D] -> the group's keys or values [Hkv, B, ctx, D], page by page."""
        heads, _, dim = cache.shape
        pages = cache.view(heads, -1, self.page_size, dim).index_select(1, self.pages)
        return pages.view(heads, *self.shape, dim)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] over the group's keys and values; `sinks` [H]: a logit per head in
        each softmax's denominator, whose value is zero (gpt-oss's; PyTorch's path only)."""
        if self.kernel is not None:
            assert sinks is None, "the native kernels have no attention sinks"
            return native_attention(
                self.kernel,
                q,
                k_cache,
                v_cache,
                self.block_table,
                self.ctx_lens,
                self.page_size,
                self.q_lens,
            )
        keys = self.gather(k_cache)
        values = keys if v_cache is k_cache else self.gather(v_cache)  # one tensor: gathered once
        if self.decode:
            return self._decode(q, keys, values, sinks)
        queries = q[self.q_index].transpose(1, 2)  # [B, H, max_q, D]
        mask: torch.Tensor = self.mask
        if sinks is not None:  # a zero key and value whose score is the head's sink logit
            keys, values = F.pad(keys, (0, 0, 0, 1)), F.pad(values, (0, 0, 0, 1))
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(~mask, -torch.inf).expand(-1, q.shape[1], -1, -1)
            sink = sinks.to(q.dtype)[None, :, None, None].expand(*bias.shape[:3], 1)
            mask = torch.cat([bias, sink], dim=-1)
        out = F.scaled_dot_product_attention(
            queries,
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        out = out.transpose(1, 2)  # [B, max_q, H, D]
        return out.reshape(-1, *out.shape[2:])[self.out_index]  # [T, H, D]

    def _decode(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per sequence as two batched matmuls over (kv head, sequence): the
        queries sharing a KV head are rows of one matrix (GQA without expanding K/V).
        About 3x faster than the CPU flash kernel at these shapes; softmax in float32."""
        batch, heads, dim = q.shape
        kv_heads, ctx = keys.shape[0], keys.shape[2]
        group = heads // kv_heads
        queries = q.view(batch, kv_heads, group, dim).transpose(0, 1).reshape(-1, group, dim)
        keys, values = keys.reshape(-1, ctx, dim), values.reshape(-1, ctx, dim)
        scores = torch.bmm(queries, keys.transpose(1, 2)).float() * dim**-0.5 + self.bias
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # each head's sink logit joins the denominator
            sink = sinks.float().view(kv_heads, 1, group, 1).expand(-1, batch, -1, -1)
            probs = torch.cat([scores, sink.reshape(-1, group, 1)], dim=-1).softmax(-1)
            probs = probs[..., :ctx]
        out = torch.bmm(probs.to(values.dtype), values)  # [Hkv * B, G, D]
        out = out.view(kv_heads, batch, group, dim).transpose(0, 1)
        return out.reshape(batch, heads, dim).contiguous()  # group 1 (MHA): reshape is a view


class StepAttention:
    """The attention operator over a PagedCache for one step (built once, used by every layer):
    it computes the step's block table and slot mapping from the sequences' page lists, which
    each attention kind's paged operator writes through and attends over (`attend`).

    The step's sequences come decodes first (`num_decodes` of them, one token each), then
    prefill chunks; each kind runs its own attention, so a decode never pays for the padding
    of a long prefill chunk."""

    def __init__(
        self,
        cache: PagedCache,
        pages: list[list[int]],
        positions: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        num_decodes: int,
        max_q: int,
        kernel: ctypes.CDLL | None = None,
        progress: StepProgress | None = None,
        decodes_as_prefill: bool = False,
        window: int | None = None,
    ) -> None:
        """pages: each sequence's page ids (from the pool); positions [T] of the new tokens;
        q_lens, ctx_lens [B] (ctx includes new), all int64 on the cache's device;
        `kernel`: the native attention library (the run plan's, `native.library`), or None for
        PyTorch's path; `progress`: advanced by each layer (the executor's);
        `decodes_as_prefill`: decodes run through the native prefill kernel, as chunks of one
        token (--batch-invariant: a token's attention is then the same bits whether it was
        decoded or, after a preemption, recomputed in a prefill; the decode kernel sums a dot
        product across vector lanes, the prefill kernel along it); `window`: each query attends
        over the last `window` positions only (a sliding-window layer's, `_Group`)."""
        self.cache, self.kernel, self.progress = cache, kernel, progress
        self.window = window
        self.decodes_as_prefill = decodes_as_prefill
        self.block_table = block_table(pages, cache.device)
        """[B, W] each sequence's page ids, padded with 0."""
        self.slot_mapping = slot_mapping(self.block_table, q_lens, positions, cache.page_size)
        """[T] the cache slot of each new token."""
        self.q_lens, self.ctx_lens = q_lens, ctx_lens
        self.num_decodes, self.max_q = num_decodes, max_q
        self.layers = 0
        """Layers this step has attended so far."""
        self.attention_seconds = self.prefill_seconds = 0.0
        """Time spent attending so far (all layers), and of it the prefill chunks'."""
        nd = num_decodes
        self.prefill_work = int((q_lens[nd:] * ctx_lens[nd:]).sum()) if nd < len(q_lens) else 0
        """Query tokens x context tokens of the prefill chunks (one layer's attention work)."""
        self._groups: list[_Group] | None = None

    @property
    def groups(self) -> list[_Group]:
        """The decodes' and the prefill chunks' attention (built at the first layer: a step
        the native decode step runs whole needs only the tables)."""
        if self._groups is None:
            self._groups = self._make_groups()
        return self._groups

    def _make_groups(self) -> list[_Group]:
        heads, page, nd = self.cache.spec.num_heads, self.cache.page_size, self.num_decodes
        table, q_lens, ctx_lens, kernel = self.block_table, self.q_lens, self.ctx_lens, self.kernel
        window, groups = self.window, []
        if nd > 0:
            decodes = _Group(
                page, heads, table[:nd], q_lens[:nd], ctx_lens[:nd], slice(0, nd), 1, kernel, window
            )
            if kernel is not None and self.decodes_as_prefill:
                decodes.q_lens = q_lens[:nd].contiguous()
            groups.append(decodes)
        if nd < len(q_lens):
            width = int((ctx_lens[nd:].max() + page - 1) // page)  # drop decodes' extra width
            groups.append(
                _Group(
                    page,
                    heads,
                    table[nd:, :width],
                    q_lens[nd:],
                    ctx_lens[nd:],
                    slice(nd, len(self.slot_mapping)),
                    self.max_q,
                    kernel,
                    window,
                )
            )
        return groups

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend q [T, H, D] over the step's pages of one layer's keys and values [Hkv, slots,
        D] (written by the kind first; one tensor passed as both where keys are values); every
        kind's paged operator ends here, once per layer. `sinks` [H]: the layer's attention
        sinks, a logit per head in the softmax's denominator (gpt-oss's), or None."""
        outs = []
        for g in self.groups:
            start = time.perf_counter()
            outs.append(g.attend(q[g.tokens], k_cache, v_cache, sinks))
            seconds = time.perf_counter() - start
            self.attention_seconds += seconds
            self.prefill_seconds += 0.0 if g.decode else seconds
        self.layers += 1
        if self.progress is not None:
            self.progress.layers += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def paged_step(kv: KVGroups, cfg: Any, batch: StepBatch) -> StepAttention:
    """The step of a kind with one group of full attention (GQA, MLA): `StepAttention` over
    its cache and the batch's pages."""
    return StepAttention(
        kv.pool.cache,
        batch.pages[kv.managers[0].name],
        batch.positions,
        batch.q_lens,
        batch.ctx_lens,
        batch.num_decodes,
        batch.max_q,
        batch.kernel,
        batch.progress,
        batch.decodes_as_prefill,
    )


@contextmanager
def active_step(step: StepAttention) -> Iterator[None]:
    """Make `step` the attention metadata the model's attention layers use."""
    _active.steps.append(step)
    try:
        yield
    finally:
        _active.steps.pop()


def current_step() -> StepAttention:
    """The step this thread made active: what a kind's custom op attends with."""
    return _active.steps[-1]


class PagedKV(KVAttention):
    """What the model is given on the paged path: its attention kinds run their paged
    operators, through their custom ops, over the active step."""
