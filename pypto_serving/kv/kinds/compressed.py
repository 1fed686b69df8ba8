"""Compressed attention (DeepSeek-V4): a sliding window over the raw tokens, plus a compressed
cache of one entry per `ratio` tokens, read whole (HCA) or through a lightning indexer's
top-k (CSA). The kind's KV, its attention and its dense oracle.

One KV head, keys and values the same tensor (shared-KV MQA), partly roped. Per layer:

    raw rows       one per token [head_dim]: what the sliding window reads
    compressor     one per token: the compressor's projections (kv, gate) [c * head_dim]
    inputs         each, c = 2 for CSA (two overlapping series), 1 for HCA; indexed layers
                   also the indexer's [2 * index_head_dim] each
    entries        one per complete window of `ratio` tokens: the gate-softmax-pooled kv,
                   normed and roped at the window's first position [head_dim] (CSA: the
                   window pooled with the previous window's first series); the indexer's keys
                   likewise [index_head_dim]

A query at position t reads the raw rows of positions (t - window, t], and the entries of the
windows complete by then (w < (t + 1) // ratio): all of them (HCA), or the index_topk of them
the indexer scores highest (CSA); a learned per-head sink joins the softmax's denominator.

The compressor inputs are the compressor's whole state: an entry is a function of the rows of
its window (and, CSA, of the window before), so the state after any prefix - a partial window,
the previous window's first series - is the rows of its last tokens, and a prefix hit of any
length restores it by keeping those rows (docs/attention_kinds.md). The kind keeps them in
three KV groups by how long they live: the entries (the whole sequence), the raw rows with
HCA's inputs (the window), CSA's inputs (its window and the one before).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from pypto_serving.errors import PyptoError
from pypto_serving.kv.paged_attention import StepAttention, StepBatch, StepProgress, current_step
from pypto_serving.kv.paged_cache import block_table, slot_mapping
from pypto_serving.kv.spec import KVGroup, KVSpec
from pypto_serving.native import compressed_library
from pypto_serving.ops.attention import DenseKV, KVAttention
from pypto_serving.ops.norm import rms_norm
from pypto_serving.ops.rope import apply_rope_interleaved, rope_angles

if TYPE_CHECKING:
    from pypto_serving.kv.groups import KVGroups

NAME = "compressed"
KERNELS = False
NATIVE_DECODE = False
OWN_KERNELS = True
SPECULATES = False
"""A step's decodes attend in one call of its own native kernel (native/compressed.cpp, a
library of no shape), where the run plan runs native attention (`StepBatch.own_kernels`)."""
ROWS, ENTRIES, INPUTS = "compressed-rows", "compressed-entries", "compressed-inputs"
"""The names of the kind's KV groups (they key the SSD tier's folders apart)."""
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The cache dtypes the native kernel reads (its code for each)."""
QUERY_BLOCK = 256
"""A prefill chunk's queries attend in blocks of this many, each over its band of the window's
rows (block + window keys, not chunk + window)."""


@dataclass(frozen=True, slots=True)
class Pooling:
    """A compressor's weights for pooling its rows into entries (`pool_windows`): each window
    of `ratio` tokens is pooled into one entry: softmax over the window's gates (plus a
    learned bias per slot, `ape` [ratio, width]) weighting its kv projections, then an RMS
    norm (`norm_weight` [D], `eps`) and RoPE (`inv_freq`, interleaved) at the window's first
    position. With `overlap` (CSA and its indexer) each token projects two series and an entry
    pools the previous window's first series with its own second."""

    ratio: int
    overlap: bool
    ape: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor


def pool_windows(
    pooling: Pooling, kv: torch.Tensor, gate: torch.Tensor, first: int
) -> torch.Tensor:
    """Entries [n, D] float32 of the windows first .. first + n - 1 from their rows [n * ratio,
    width]; with overlap and first > 0 the rows start one window earlier (its first series
    joins entry `first`)."""
    r, d = pooling.ratio, pooling.norm_weight.shape[0]
    kv = kv.view(-1, r, kv.shape[-1])
    gate = gate.view(-1, r, gate.shape[-1]) + pooling.ape.float()
    if pooling.overlap:
        lead = 1 if first > 0 else 0
        n = kv.shape[0] - lead
        pooled_kv = kv.new_zeros(n, 2 * r, d)
        pooled_gate = gate.new_full((n, 2 * r, d), float("-inf"))
        pooled_kv[:, r:], pooled_gate[:, r:] = kv[lead:, :, d:], gate[lead:, :, d:]
        earlier = slice(0, n + lead - 1)
        pooled_kv[1 - lead :, :r] = kv[earlier, :, :d]
        pooled_gate[1 - lead :, :r] = gate[earlier, :, :d]
        kv, gate = pooled_kv, pooled_gate
    windows = torch.arange(kv.shape[0], device=kv.device) + first
    return _pooled(pooling, kv, gate, windows)


def pool_each_window(
    pooling: Pooling, kv: torch.Tensor, gate: torch.Tensor, windows: torch.Tensor
) -> torch.Tensor:
    """Entries [n, D] float32 of n windows of different sequences, window `windows[i]` from
    its rows kv[i], gate[i] ([ratio, width]; with overlap [2 * ratio, width]: the window
    before it first, whose first series joins the entry, ignored for window 0): what
    `pool_windows` gives each, in one batch (the decodes that complete a window)."""
    r, d = pooling.ratio, pooling.norm_weight.shape[0]
    gate = gate + pooling.ape.float().repeat(gate.shape[1] // r, 1)
    if pooling.overlap:
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
        gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
        gate[windows == 0, :r] = float("-inf")  # no window before the first
    return _pooled(pooling, kv, gate, windows)


def _pooled(
    pooling: Pooling, kv: torch.Tensor, gate: torch.Tensor, windows: torch.Tensor
) -> torch.Tensor:
    """Each window's rows [n, rows, D] pooled by the softmax of their gates, normed and roped
    at the window's first position (`windows` [n] the windows' indices)."""
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
    entries = rms_norm(pooled, pooling.norm_weight, pooling.eps).float()
    positions = windows * pooling.ratio
    return apply_rope_interleaved(entries, *rope_angles(positions, pooling.inv_freq))


@dataclass(slots=True)
class IndexerInputs:
    """A CSA layer's indexer, for the step's new tokens."""

    kv: torch.Tensor
    """[T, 2 * index_head_dim] the indexer compressor's kv projections."""
    gate: torch.Tensor
    """[T, 2 * index_head_dim] its gate projections."""
    pooling: Pooling
    q: torch.Tensor
    """[T, index_heads, index_head_dim] roped queries."""
    weights: torch.Tensor
    """[T, index_heads] each head's weight in a query's score (scales folded in)."""
    topk: int


@dataclass(slots=True)
class Compression:
    """A compressed layer's cache inputs for the step's new tokens."""

    ratio: int
    kv: torch.Tensor
    """[T, c * head_dim] the compressor's kv projections."""
    gate: torch.Tensor
    """[T, c * head_dim] its gate projections."""
    pooling: Pooling
    indexer: IndexerInputs | None
    """The CSA layer's indexer; None for HCA (its entries are read whole)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each layer keeps what in the kind's caches (`layout`):

    rows     [slots, row_width] in the model's dtype, a token's row: per layer, from
             `rows[layer]`, its raw row [head_dim]; an HCA layer's compressor kv and gate
             [head_dim each] from `inputs[layer]`
    inputs   [slots, input_width] in the model's dtype (CSA layers only, kept for a shorter
             span than the window): per CSA layer, from `inputs[layer]`, its compressor's kv
             and gate [2 * head_dim each], then its indexer's kv and gate [2 * index_head_dim
             each]
    entries  [slots, page_width] in the model's dtype, a page's page_size rows read as one
             flat block: per compressed layer, from `entries[layer]`, room for the entries
             of the windows that end in the page (`per_page`: ceil(page_size / ratio)) [head_dim
             each], and from `index_keys[layer]` the indexer's keys; window w's entry is in
             the page of its last token, (w + 1) * ratio - 1, at w - floor(page * page_size /
             ratio) (`entry_slots`)
    """

    page_size: int
    keep: int
    """Tokens before the next one whose rows a sequence still reads: the window's raw rows,
    and HCA's inputs of the window it has not pooled yet (the whole model's layers: every
    pipeline stage keeps as many)."""
    input_keep: int
    """Tokens before the next one whose CSA inputs a sequence still reads: its window not
    pooled yet and the one before (2 * ratio - 1); 0: the model has no CSA layer."""
    row_width: int
    input_width: int
    page_width: int
    rows: tuple[int, ...]
    inputs: tuple[int, ...]
    """A compressed layer's first column of its compressor inputs (in the rows for HCA, in
    the inputs for CSA); -1 for a window-only layer."""
    entries: tuple[int, ...]
    index_keys: tuple[int, ...]


Inputs = tuple[torch.Tensor, torch.Tensor]
"""A compressed layer's compressor inputs in a step: its columns of their store [slots, the
layer's inputs] and that store's block table."""


def per_page(page_size: int, ratio: int) -> int:
    """Most windows of `ratio` tokens that can end in one page."""
    return -(-page_size // ratio)


def entry_slots(
    table: torch.Tensor, first: int, end: int, ratio: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, slots within the page) of windows first .. end - 1's entries, for one
    sequence's entry pages `table` [pages]."""
    page, slot = entry_place(torch.arange(first, end, device=table.device), ratio, page_size)
    return table[page], slot


def entry_place(windows: torch.Tensor, ratio: int, page_size: int) -> tuple[torch.Tensor, ...]:
    """(index in its sequence's entry pages, slot within the page) of each window's entry:
    the page of the window's last token."""
    page = ((windows + 1) * ratio - 1) // page_size
    return page, windows - page * page_size // ratio


@functools.cache
def layout(cfg: Any, layers: range, page_size: int) -> Layout:
    """The layout of the model's `layers` (checkpoint indices: a pipeline stage's, in its
    order; `cfg.compressed`), worked out once (every step's operator asks for it)."""
    v4, dim, index_dim = cfg.compressed, cfg.head_dim, cfg.compressed.index_head_dim
    keep, input_keep = v4.sliding_window - 1, 0
    for ratio, indexed in zip(v4.compress_ratios, v4.indexed, strict=True):
        if ratio and indexed:
            input_keep = max(input_keep, 2 * ratio - 1)
        elif ratio:
            keep = max(keep, ratio - 1)
    rows, inputs, entries, index_keys = [], [], [], []
    row = column = flat = 0
    for i in layers:
        ratio, indexed = v4.compress_ratios[i], v4.indexed[i]
        rows.append(row)
        row += dim
        entries.append(flat)
        index_keys.append(flat + (per_page(page_size, ratio) * dim if ratio else 0))
        if not ratio:
            inputs.append(-1)
        elif indexed:
            inputs.append(column)
            column += 4 * dim + 4 * index_dim
        else:
            inputs.append(row)
            row += 2 * dim
        if ratio:
            flat += per_page(page_size, ratio) * (dim + (index_dim if indexed else 0))
    return Layout(
        page_size,
        keep,
        input_keep,
        row,
        column,
        max(-(-flat // page_size), 1),
        *map(tuple, (rows, inputs, entries, index_keys)),
    )


def kv_spec(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> KVSpec:
    """The pages kept whole: the compressed entries (and the indexer's keys) of page_size
    tokens, every one of `layers`' entries, one flat block a page (`Layout`). Every TP rank
    stores the same: the KV head, compressors and indexers are whole on each."""
    if kv_cache_dtype == "int8":
        raise PyptoError("kv_cache_dtype int8 is for grouped-query attention", "kv_cache_dtype")
    width = layout(cfg, layers, page_size).page_width
    return KVSpec(
        ENTRIES, 1, 1, width, width, page_size, dtype, num_tensors=1, same_on_tp_ranks=True
    )


def row_spec(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> tuple[KVSpec, int]:
    """The per-token rows of `layers` kept for the sliding window (and HCA's inputs), in the
    model's dtype (the projections come out of its matmuls in it: kept exactly), and how
    many tokens of them a sequence keeps (`Layout.keep`)."""
    lay = layout(cfg, layers, page_size)
    width = lay.row_width
    spec = KVSpec(ROWS, 1, 1, width, width, page_size, dtype, num_tensors=1, same_on_tp_ranks=True)
    return spec, lay.keep


def input_spec(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype
) -> tuple[KVSpec, int] | None:
    """The per-token CSA inputs of `layers` (its compressors' and indexers' projections) and
    how many tokens of them a sequence keeps (`Layout.input_keep`); None for a model without
    CSA layers. A pipeline stage without CSA layers declares it too, holding none."""
    lay = layout(cfg, layers, page_size)
    if not lay.input_keep:
        return None
    width = lay.input_width
    spec = KVSpec(
        INPUTS, 1, 1, width, width, page_size, dtype, num_tensors=1, same_on_tp_ranks=True
    )
    return spec, lay.input_keep


def kv_groups(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> list[KVGroup]:
    """The entries, kept whole (a prefix hit needs every one: they come first); the rows, of
    which a sequence keeps its last `Layout.keep` tokens' (the window's, and HCA's unpooled
    inputs); CSA's inputs, of which it keeps the last `Layout.input_keep` (a hit needs only
    those of each)."""
    rows, keep = row_spec(cfg, layers, page_size, dtype, kv_cache_dtype)
    entries = kv_spec(cfg, layers, page_size, dtype, kv_cache_dtype)
    groups = [KVGroup(ENTRIES, entries), KVGroup(ROWS, rows, keep=keep)]
    inputs = input_spec(cfg, layers, page_size, dtype)
    if inputs is not None:
        groups.append(KVGroup(INPUTS, inputs[0], keep=inputs[1]))
    return groups


def attend(
    kv: KVAttention,
    layer: torch.Tensor,
    q: torch.Tensor,
    positions: torch.Tensor,
    raw: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    compression: Compression | None,
) -> torch.Tensor:
    """Store the new tokens' raw rows [T, D] (and compressor inputs), attend q [T, H, D] (scale
    D**-0.5) over the sequence's window and compressed entries with the per-head sinks [H];
    return [T, H, D]. `positions` [T] are the new tokens'; `layer` a 0-d CPU tensor."""
    if isinstance(kv, DenseKV):
        return dense_attend(kv, int(layer), q, positions, raw, sinks, window, compression)
    return compressed_attention(q, raw, sinks, layer, window, *_flat(compression))


Flat = tuple[
    int,
    float,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    bool,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    int,
]
"""A `Compression` as `compressed_attention`'s arguments (the custom op takes tensors and
numbers only): ratio (0: none), eps, the compressor's kv, gate, ape, norm weight, whether it
overlaps, the RoPE's inv_freq, the indexer's kv, gate, ape, norm weight, queries, weights
(None: no indexer) and top k."""


def _flat(c: Compression | None) -> Flat:
    if c is None:
        return (0, 0.0, None, None, None, None, False, None, None, None, None, None, None, None, 0)
    p, i = c.pooling, c.indexer
    head = (c.ratio, p.eps, c.kv, c.gate, p.ape, p.norm_weight, p.overlap, p.inv_freq)
    if i is None:
        return (*head, None, None, None, None, None, None, 0)
    assert i.pooling.ratio == c.ratio and i.pooling.eps == p.eps and i.pooling.overlap
    return (*head, i.kv, i.gate, i.pooling.ape, i.pooling.norm_weight, i.q, i.weights, i.topk)


def _unflat(flat: Flat) -> Compression | None:
    ratio, eps, kv, gate, ape, norm, overlap, inv_freq, ikv, igate, iape, inorm, iq, iw, k = flat
    if ratio == 0:
        return None
    assert kv is not None and gate is not None and ape is not None and norm is not None
    assert inv_freq is not None
    indexer = None
    if ikv is not None:
        assert igate is not None and iape is not None and inorm is not None
        assert iq is not None and iw is not None
        pooling = Pooling(ratio, True, iape, inorm, eps, inv_freq)
        indexer = IndexerInputs(ikv, igate, pooling, iq, iw, k)
    pooling = Pooling(ratio, overlap, ape, norm, eps, inv_freq)
    return Compression(ratio, kv, gate, pooling, indexer)


@torch.library.custom_op("pypto::compressed_attention", mutates_args=())
def compressed_attention(
    q: torch.Tensor,
    raw: torch.Tensor,
    sinks: torch.Tensor,
    layer: torch.Tensor,
    window: int,
    ratio: int,
    eps: float,
    kv: torch.Tensor | None,
    gate: torch.Tensor | None,
    ape: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    overlap: bool,
    inv_freq: torch.Tensor | None,
    index_kv: torch.Tensor | None,
    index_gate: torch.Tensor | None,
    index_ape: torch.Tensor | None,
    index_norm_weight: torch.Tensor | None,
    index_q: torch.Tensor | None,
    index_weights: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    """The compiled graphs' view of the paged operator (opaque, over the active step): the
    layer's `attend` with its `Compression` spelled out (`Flat`)."""
    step = current_step()
    assert isinstance(step, CompressedStep), "a compressed model runs on its own step"
    flat: Flat = (
        ratio,
        eps,
        kv,
        gate,
        ape,
        norm_weight,
        overlap,
        inv_freq,
        index_kv,
        index_gate,
        index_ape,
        index_norm_weight,
        index_q,
        index_weights,
        topk,
    )
    return step.attend_layer(int(layer), q, raw, sinks, window, _unflat(flat))


@compressed_attention.register_fake
def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(q)


def dense_attend(
    kv: DenseKV,
    layer: int,
    q: torch.Tensor,
    positions: torch.Tensor,
    raw: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    compression: Compression | None,
) -> torch.Tensor:
    """The oracle: every row of the sequence kept, every complete window pooled afresh."""
    new = [raw]
    if compression is not None:
        new += [compression.kv, compression.gate]
        if compression.indexer is not None:
            new += [compression.indexer.kv, compression.indexer.gate]
    rows = kv.extend(layer, *new)
    keys = rows[0]
    j = torch.arange(len(keys), device=q.device)
    t = positions[:, None]
    bias = masked_bias((j[None, :] <= t) & (j[None, :] > t - window))
    if compression is not None and len(keys) >= compression.ratio:
        ratio = compression.ratio
        whole = len(keys) // ratio * ratio
        entries = pool_windows(compression.pooling, rows[1][:whole], rows[2][:whole], 0)
        seen = window_seen(positions, len(entries), ratio)
        indexer = compression.indexer
        if indexer is not None:  # the keys as a cache of the model's dtype keeps them
            index_keys = pool_windows(indexer.pooling, rows[3][:whole], rows[4][:whole], 0)
            index_keys = index_keys.to(q.dtype)
            seen = indexer_choice(indexer, index_keys, seen)
        keys = torch.cat([keys, entries.to(keys.dtype)])
        bias = torch.cat([bias, masked_bias(seen)], dim=1)
    return sink_attention(q, keys, bias, sinks)


def masked_bias(visible: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere (float32)."""
    zeros = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return zeros.masked_fill(~visible, float("-inf"))


def window_seen(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """[T, n] the entries a query may read: those of windows complete by its position."""
    w = torch.arange(num_entries, device=positions.device)
    return w[None, :] < ((positions + 1) // ratio)[:, None]


def indexer_choice(indexer: IndexerInputs, keys: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """[T, n] the entries each query reads: the indexer's top-k of those it may see, by
    score(t, w) = sum over heads h of weights[t, h] * relu(q[t, h] . keys[w])."""
    scores = torch.relu(torch.einsum("thd,nd->thn", indexer.q.float(), keys.float()))
    scores = (scores * indexer.weights.float()[:, :, None]).sum(dim=1)
    scores = scores.masked_fill(~seen, float("-inf"))
    top = scores.topk(min(indexer.topk, scores.shape[1]), dim=-1).indices
    chosen = torch.zeros_like(seen).scatter_(1, top, True)
    return chosen & seen


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [T, H, D] over one head's keys = values [S, D] with bias [T, S] (0 or -inf) and a
    per-head sink logit [H] in the softmax's denominator; float32 inside."""
    scores = torch.einsum("thd,sd->ths", q.float(), keys.float()) * q.shape[-1] ** -0.5
    scores = scores + bias[:, None, :]
    sink = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", probs, keys.float()).to(q.dtype)


class CompressedStep(StepAttention):
    """The kind's operator over one step: StepAttention's block table and slot mapping over
    the rows' pages (-1 where the window has given a page back), and the entries' block table.
    Each layer (`attend_layer`) writes its new rows, pools the windows its sequences complete
    into their entries' pages, and attends each sequence's queries, a block at a time, over
    the band of rows their windows cover and the entries: the dense oracle's arithmetic on
    what the pages hold."""

    def __init__(
        self,
        kv: KVGroups,
        layout: Layout,
        row_pages: list[list[int]],
        entry_pages: list[list[int]],
        input_pages: list[list[int]] | None,
        positions: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        num_decodes: int,
        max_q: int,
        progress: StepProgress | None = None,
        library: ctypes.CDLL | None = None,
    ) -> None:
        """library: the kind's native kernel (`native.compressed_library`), which attends
        every query; None: every sequence on the PyTorch path."""
        cache = kv.manager(ROWS).pool.cache
        super().__init__(
            cache, row_pages, positions, q_lens, ctx_lens, num_decodes, max_q, None, progress
        )
        self.layout, self.positions = layout, positions
        self.rows = cache.k_cache[0, 0]  # [slots, row_width]
        entries = kv.manager(ENTRIES).pool.cache.k_cache[0, 0]
        self.entries = entries.view(-1, layout.page_size * entries.shape[-1])  # a page a row
        self.entry_table = block_table(entry_pages, cache.device)
        self.inputs: torch.Tensor | None = None
        self.input_table: torch.Tensor | None = None
        self.input_slots: torch.Tensor | None = None
        if input_pages is not None:  # CSA's inputs: pages of their own
            self.inputs = kv.manager(INPUTS).pool.cache.k_cache[0, 0]
            self.input_table = block_table(input_pages, cache.device)
            page = layout.page_size
            self.input_slots = slot_mapping(self.input_table, q_lens, positions, page)
        firsts = (torch.cumsum(q_lens, 0) - q_lens).tolist()
        self.spans = list(zip(firsts, q_lens.tolist(), ctx_lens.tolist(), strict=True))
        """Per sequence: its first token in the step, its new tokens, its context after."""
        self.library = library
        seqs = torch.arange(len(q_lens), device=positions.device)
        self.queries = (torch.repeat_interleave(seqs, q_lens), positions.contiguous())
        """Each query's sequence and position, as the native kernel takes them (the same for
        every layer of the step)."""

    def attend_layer(
        self,
        layer: int,
        q: torch.Tensor,
        raw: torch.Tensor,
        sinks: torch.Tensor,
        window: int,
        compression: Compression | None,
    ) -> torch.Tensor:
        """Layer `layer`'s paged attention for the step's tokens (as `attend` promises)."""
        offset = self.layout.rows[layer]
        raw_rows = self.rows[:, offset : offset + raw.shape[1]]
        raw_rows.index_copy_(0, self.slot_mapping, raw.to(raw_rows.dtype))
        inputs = None if compression is None else self._store_inputs(layer, compression)
        if self.library is not None:
            out = self._attend_native(layer, q, sinks, window, compression, inputs)
        else:
            outs = []
            for b in range(len(self.spans)):
                outs += self._attend_sequence(
                    b, layer, q, raw_rows, sinks, window, compression, inputs
                )
            out = torch.cat(outs)
        self.layers += 1
        if self.progress is not None:
            self.progress.layers += 1
        return out

    def _store_inputs(self, layer: int, compression: Compression) -> Inputs:
        """Write the new tokens' compressor (and indexer) inputs of a compressed layer: HCA's
        beside the raw rows, CSA's in the inputs' pages (kept for a shorter span); return
        the layer's columns of that store and its block table."""
        new = [compression.kv, compression.gate]
        if compression.indexer is not None:
            new += [compression.indexer.kv, compression.indexer.gate]
        fresh = torch.cat(new, dim=1)
        store, table, slots = self.rows, self.block_table, self.slot_mapping
        if compression.indexer is not None:
            assert self.inputs is not None and self.input_table is not None
            assert self.input_slots is not None
            store, table, slots = self.inputs, self.input_table, self.input_slots
        offset = self.layout.inputs[layer]
        columns = store[:, offset : offset + fresh.shape[1]]
        columns.index_copy_(0, slots, fresh.to(columns.dtype))
        return columns, table

    def _attend_sequence(
        self,
        b: int,
        layer: int,
        q: torch.Tensor,
        raw_rows: torch.Tensor,
        sinks: torch.Tensor,
        window: int,
        compression: Compression | None,
        inputs: Inputs | None,
    ) -> list[torch.Tensor]:
        """Sequence b's new tokens on PyTorch's path: pool the windows they complete, then
        attend in blocks of queries, each over its band of the window's rows and the entries
        so far."""
        first, count, ctx = self.spans[b]
        start = ctx - count
        entries: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if compression is not None and inputs is not None:
            self._pool_sequence(b, layer, compression, inputs)
            entries = self._entries(b, layer, compression, ctx // compression.ratio)
        outs = []
        for q_start in range(start, ctx, QUERY_BLOCK):  # the window: a band of keys
            q_end = min(q_start + QUERY_BLOCK, ctx)
            tokens = slice(first + q_start - start, first + q_end - start)
            outs.append(
                self._attend_block(b, tokens, q, raw_rows, sinks, window, compression, entries)
            )
        return outs

    def _attend_native(
        self,
        layer: int,
        q: torch.Tensor,
        sinks: torch.Tensor,
        window: int,
        compression: Compression | None,
        inputs: Inputs | None,
    ) -> torch.Tensor:
        """Every query of the step in one call of the native kernel, which reads the pages
        in place (a prefill chunk's queries a block at a time, sharing one read of their
        band of rows), after pooling the windows the step completes (the decodes' in one
        batch)."""
        lay, lib, nd = self.layout, self.library, self.num_decodes
        assert lib is not None
        ratio = 0 if compression is None else compression.ratio
        if compression is not None and inputs is not None:
            if nd:
                self._pool_decodes(nd, layer, compression, inputs)
            for b in range(nd, len(self.spans)):
                self._pool_sequence(b, layer, compression, inputs)
        queries = q.float().contiguous()
        out = torch.empty_like(queries)
        indexer = None if compression is None else compression.indexer
        index_q = index_weights = None
        if indexer is not None:
            index_q = indexer.q.float().contiguous()
            index_weights = indexer.weights.float().contiguous()
        sink = sinks.float().contiguous()
        seqs, positions = self.queries
        failed = lib.pypto_compressed_attention(
            NATIVE_DTYPES[self.rows.dtype],
            len(queries),
            queries.shape[1],
            queries.shape[2],
            queries.data_ptr(),
            sink.data_ptr(),
            seqs.data_ptr(),
            positions.data_ptr(),
            window,
            self.rows.data_ptr(),
            self.rows.shape[1],
            lay.rows[layer],
            self.block_table.data_ptr(),
            self.block_table.shape[1],
            lay.page_size,
            ratio,
            self.entries.data_ptr(),
            lay.page_width,
            lay.entries[layer],
            self.entry_table.data_ptr(),
            self.entry_table.shape[1],
            0 if index_q is None else index_q.shape[1],
            0 if index_q is None else index_q.shape[2],
            None if index_q is None else index_q.data_ptr(),
            None if index_weights is None else index_weights.data_ptr(),
            lay.index_keys[layer],
            0 if indexer is None else indexer.topk,
            out.data_ptr(),
        )
        assert failed == 0, f"pypto_compressed_attention failed ({failed})"
        return out.to(q.dtype)

    def _pool_decodes(self, nd: int, layer: int, compression: Compression, inputs: Inputs) -> None:
        """Pool the windows the first `nd` sequences' (the decodes') tokens complete, all in
        one batch (`pool_each_window`), into their entry pages."""
        ratio, lay = compression.ratio, self.layout
        ctx = self.ctx_lens[:nd]
        done = (ctx % ratio == 0).nonzero().flatten()
        if len(done) == 0:
            return
        windows = ctx[done] // ratio - 1
        indexer = compression.indexer
        span = (2 if indexer is not None else 1) * ratio  # CSA's: the window before it too
        pos = (windows[:, None] + 1) * ratio - span + torch.arange(span, device=ctx.device)
        pos = pos.clamp(min=0)  # window 0's "window before" (ignored)
        page = lay.page_size
        columns, table = inputs
        seq_inputs = columns[table[done[:, None], pos // page] * page + pos % page].float()
        index, within = entry_place(windows, ratio, page)
        pages = self.entry_table[done, index]
        for column, width, offset, pooling in self._pooled_parts(layer, compression):
            kv = seq_inputs[:, :, column : column + width]
            gate = seq_inputs[:, :, column + width : column + 2 * width]
            entries = pool_each_window(pooling, kv, gate, windows)
            block = self._entry_block(offset, ratio, entries.shape[1])
            block[pages, within] = entries.to(block.dtype)

    def _pooled_parts(
        self, layer: int, compression: Compression
    ) -> list[tuple[int, int, int, Pooling]]:
        """Per cache a compressed layer pools (its entries; CSA's indexer keys too): the first
        column of its kv inputs in the layer's inputs (the gates follow them), their width,
        its entries' offset in the entry pages, and its pooling."""
        width = compression.kv.shape[1]  # the compressor's inputs: c * head_dim
        parts = [(0, width, self.layout.entries[layer], compression.pooling)]
        indexer = compression.indexer
        if indexer is not None:
            index = (2 * width, indexer.kv.shape[1], self.layout.index_keys[layer])
            parts.append((*index, indexer.pooling))
        return parts

    def _attend_block(
        self,
        b: int,
        tokens: slice,
        q: torch.Tensor,
        raw_rows: torch.Tensor,
        sinks: torch.Tensor,
        window: int,
        compression: Compression | None,
        entries: tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> torch.Tensor:
        """Queries `tokens` of sequence b over the raw rows of their windows (a band) and,
        for a compressed layer, the entries their windows completed (CSA: the indexer's
        choice among them)."""
        positions = self.positions[tokens]
        first, last = int(positions[0]), int(positions[-1])
        lo = max(first - window + 1, 0)
        keys = raw_rows[self._slots(b, lo, last + 1)].float()
        j = torch.arange(lo, last + 1, device=q.device)[None, :]
        bias = masked_bias((j <= positions[:, None]) & (j > positions[:, None] - window))
        if compression is not None and entries is not None:
            values, index_keys = entries
            seen = window_seen(positions, len(values), compression.ratio)
            indexer = compression.indexer
            if indexer is not None and index_keys is not None:
                mine = replace(indexer, q=indexer.q[tokens], weights=indexer.weights[tokens])
                seen = indexer_choice(mine, index_keys, seen)
            keys = torch.cat([keys, values.float()])
            bias = torch.cat([bias, masked_bias(seen)], dim=1)
        return sink_attention(q[tokens], keys, bias, sinks)

    def _slots(self, b: int, lo: int, hi: int, table: torch.Tensor | None = None) -> torch.Tensor:
        """The slots of sequence b's positions lo .. hi - 1 in the pages of `table` (None:
        the rows')."""
        page = self.layout.page_size
        table = self.block_table if table is None else table
        pos = torch.arange(lo, hi, device=table.device)
        return table[b, pos // page] * page + pos % page

    def _pool_sequence(self, b: int, layer: int, compression: Compression, inputs: Inputs) -> None:
        """Pool the windows sequence b's new tokens complete into its entry pages, from the
        layer's compressor inputs of those windows (CSA: and of the window before)."""
        ratio = compression.ratio
        _, count, ctx = self.spans[b]
        start = ctx - count
        done, total = start // ratio, ctx // ratio
        if total == done:
            return
        lead = 1 if compression.indexer is not None and done > 0 else 0
        columns, table = inputs
        seq_inputs = columns[self._slots(b, (done - lead) * ratio, total * ratio, table)].float()
        page = self.layout.page_size
        pages, slots = entry_slots(self.entry_table[b], done, total, ratio, page)
        for column, width, offset, pooling in self._pooled_parts(layer, compression):
            kv = seq_inputs[:, column : column + width]
            gate = seq_inputs[:, column + width : column + 2 * width]
            pooled = pool_windows(pooling, kv, gate, done)
            block = self._entry_block(offset, ratio, pooled.shape[1])
            block[pages, slots] = pooled.to(block.dtype)

    def _entries(
        self, b: int, layer: int, compression: Compression, total: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequence b's first `total` entries, and the indexer's keys (None without an
        indexer), from its entry pages."""
        page = self.layout.page_size
        pages, slots = entry_slots(self.entry_table[b], 0, total, compression.ratio, page)
        out = []
        for _, width, offset, pooling in self._pooled_parts(layer, compression):
            entry_width = width // (2 if pooling.overlap else 1)
            out.append(self._entry_block(offset, compression.ratio, entry_width)[pages, slots])
        return out[0], out[1] if compression.indexer is not None else None

    def _entry_block(self, offset: int, ratio: int, width: int) -> torch.Tensor:
        """One cache of a layer in the entry pages, as [pages, room, width] (a view): room
        for the entries of the windows that end in a page, `width` values each, from column
        `offset` of the page's flat block."""
        room = per_page(self.layout.page_size, ratio)
        return self.entries[:, offset : offset + room * width].unflatten(1, (room, width))


def step(kv: KVGroups, cfg: Any, batch: StepBatch) -> CompressedStep:
    """The step's operator over the groups' pages: every query on the kind's own native
    kernel where the run plan says so (`StepBatch.own_kernels`: on the CPU, for float32 and
    bfloat16 caches), else on PyTorch's path. A batch-invariant step (`decodes_as_prefill`)
    stays on PyTorch's path, whose arithmetic its guarantee was established on."""
    assert batch.kernel is None, "the compressed kind attends on kernels of its own"
    layers = batch.layers
    if layers is None:  # the whole model
        layers = range(len(cfg.compressed.compress_ratios))
    lay = layout(cfg, layers, kv.page_size)
    cache = kv.manager(ROWS).pool.cache.k_cache
    library = None
    native = cache.device.type == "cpu" and cache.dtype in NATIVE_DTYPES
    if batch.own_kernels and native and not batch.decodes_as_prefill:
        library = compressed_library()
    return CompressedStep(
        kv,
        lay,
        batch.pages[ROWS],
        batch.pages[ENTRIES],
        batch.pages.get(INPUTS),
        batch.positions,
        batch.q_lens,
        batch.ctx_lens,
        batch.num_decodes,
        batch.max_q,
        batch.progress,
        library,
    )
