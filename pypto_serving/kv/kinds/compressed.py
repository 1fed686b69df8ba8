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
length restores it by keeping those rows (docs/attention_kinds.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pypto_serving.errors import PyptoError
from pypto_serving.kv.spec import KVSpec
from pypto_serving.ops.attention import DenseKV, KVAttention

NAME = "compressed"

Pool = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(kv rows, gate rows of whole windows, the first window's index) -> their entries [n, D]
(a compressed layer's compressor: models/deepseek_v4.py)."""


@dataclass(slots=True)
class IndexerInputs:
    """A CSA layer's indexer, for the step's new tokens."""

    kv: torch.Tensor
    """[T, 2 * index_head_dim] the indexer compressor's kv projections."""
    gate: torch.Tensor
    """[T, 2 * index_head_dim] its gate projections."""
    pool: Pool
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
    pool: Pool
    indexer: IndexerInputs | None
    """The CSA layer's indexer; None for HCA (its entries are read whole)."""


PAGED_NOT_YET = (
    "DeepSeek-V4's compressed attention runs on the reference executor for now "
    "(--executor reference): its paged KV is not built yet"
)


def kv_spec(
    cfg: Any, num_layers: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> KVSpec:
    """The paged executor asks for this kind's pages: not yet (a clear error)."""
    raise PyptoError(PAGED_NOT_YET, "executor")


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
    raise PyptoError(PAGED_NOT_YET, "executor")


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
        entries = compression.pool(rows[1][:whole], rows[2][:whole], 0)
        seen = window_seen(positions, len(entries), ratio)
        indexer = compression.indexer
        if indexer is not None:
            index_keys = indexer.pool(rows[3][:whole], rows[4][:whole], 0)
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


def indexer_choice(
    indexer: IndexerInputs, keys: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
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
