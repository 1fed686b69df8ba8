"""Sliding-window attention: grouped-query attention whose windowed layers read only the last
`window` tokens (a query's own and the window - 1 before it): Mistral, Qwen2/Qwen3 with
`use_sliding_window` (the layers from `max_window_layers` on), Gemma 3's local layers,
gpt-oss's sliding layers (its layers, sliding and full, with attention sinks: a logit per head
in the softmax's denominator). The whole kind: its KV groups, its paged operator and custom
op, its dense oracle, and `attend`, its model code's call.

Keys and values are GQA's ([layers, kv_heads, slots, head_dim] each). The windowed layers form
one group whose manager keeps `window - 1` tokens before the next one: it gives back every
page the window has passed while a request runs (still cached for a later prompt's hit), and
claims a prefix hit with only the window's pages held, so a sequence of any length holds
about a window of pages. A model whose other layers attend to everything has a second group
of full attention, first (`kv_groups`), whose pages grow with the sequence as GQA's do.

    full    ▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓     every page
    window  ░░░░░░░░░░░░░░░░░░░░░░▓▓▓▓▓▓     the window's pages; -1 where a page went back

The paged operator is StepAttention's with a window: it gathers, per sequence, only the pages
from the first one its window reaches (never a page given back), and masks keys outside the
window and after each query: PyTorch's attention (the native kernels read from a sequence's
first page: `KERNELS` is False), compiled like GQA's (an opaque custom op in the layer
graphs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pypto_serving.errors import PyptoError
from pypto_serving.kv.kinds.gqa import paged_attend
from pypto_serving.kv.paged_attention import StepAttention, StepBatch, current_step
from pypto_serving.kv.spec import KVGroup, KVSpec
from pypto_serving.ops.attention import DenseKV, KVAttention

if TYPE_CHECKING:
    from pypto_serving.kv.groups import KVGroups

NAME = "window"
KERNELS = False
NATIVE_DECODE = False
OWN_KERNELS = False
SPECULATES = True
FULL, SLIDING = "full", "sliding"
"""The names of the kind's groups (they key the SSD tier's folders apart)."""


def kv_spec(cfg: Any, num_layers: int, page_size: int, dtype: torch.dtype) -> KVSpec:
    """K and V of this rank's KV heads (`cfg.num_kv_heads`), `cfg.head_dim` values each."""
    heads, dim = cfg.num_kv_heads, cfg.head_dim
    return KVSpec(NAME, num_layers, heads, dim, dim, page_size, dtype, num_tensors=2)


def layer_groups(cfg: Any, layers: range) -> list[tuple[str, int]]:
    """Each of the rank's `layers` (checkpoint indices: its stage's): its group and its index
    there."""
    seen = {FULL: 0, SLIDING: 0}
    out = []
    for i in layers:
        group = SLIDING if i in cfg.window_layers else FULL
        out.append((group, seen[group]))
        seen[group] += 1
    return out


def kv_groups(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> list[KVGroup]:
    """The full-attention layers' group (if the model has any: first, the one events report),
    then the windowed layers', which keeps `window - 1` tokens before the next one. A
    pipeline stage declares both where the model has both, holding its own layers of each
    (none, for a stage without such layers)."""
    if kv_cache_dtype == "int8":
        raise PyptoError(
            "kv_cache_dtype int8 runs on the native kernels, which sliding-window attention "
            "does not use",
            "kv_cache_dtype",
        )
    assert cfg.window_layers, "a model of this kind has windowed layers (models/config.py)"
    counts = {FULL: 0, SLIDING: 0}
    for group, _ in layer_groups(cfg, layers):
        counts[group] += 1
    groups = []
    if len(cfg.window_layers) < cfg.num_layers:
        groups.append(KVGroup(FULL, kv_spec(cfg, counts[FULL], page_size, dtype)))
    keep = cfg.sliding_window - 1
    groups.append(KVGroup(SLIDING, kv_spec(cfg, counts[SLIDING], page_size, dtype), keep=keep))
    return groups


def attend(
    kv: KVAttention,
    layer: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k/v [T, kv_heads, D] of the new tokens and attend q [T, heads, D] causally, over
    the last `window` tokens (a windowed layer's), or over everything (None); returns
    [T, heads, D]. `layer` is the layer's index as a 0-d CPU tensor; `sinks` [heads]: the
    layer's attention sinks (gpt-oss's: a logit per head in the softmax's denominator)."""
    if isinstance(kv, DenseKV):
        return dense_attend(kv, int(layer), q, k, v, window, sinks)
    return window_attention(q, k, v, layer, sinks)


def dense_attend(
    kv: DenseKV,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: the sequence's keys and values so far, then causal attention within the
    window (over the keys from the first one the window lets the first query see), with the
    sinks' logits in each softmax's denominator where the layer has them."""
    k, v = kv.extend(layer, k, v)
    t, s = q.shape[0], k.shape[0]
    first = 0 if window is None else max(0, s - t - window + 1)  # the first key any query sees
    k, v = k[first:], v[first:]
    keys = torch.arange(first, s, device=q.device)
    mask = _mask(keys[s - first - t :], keys, window)
    if sinks is not None:
        return sink_attention(q, k, v, mask, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention written out: q [T, H, D] over k, v [S, Hkv, D] where mask [T, S] allows, each
    head's sink logit beside its scores in the softmax (float32), dropped after it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("thd,shd->hts", q.float(), k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, -torch.inf)
    sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs, v).to(q.dtype)


def _mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., Q, K] whether each query position [..., Q] sees each key position [..., K]: not
    after it, and within the `window` positions ending at it (None: every one)."""
    q, k = queries[..., :, None], keys[..., None, :]
    seen = k <= q
    return seen if window is None else seen & (k > q - window)


class WindowStep(StepAttention):
    """The kind's operator over one step: StepAttention's block table and slot mapping over
    the windowed group's pages (-1 where the window gave a page back), attending within the
    window, and a full-attention group's own step where the model has one. A windowed layer
    writes its new keys and values through the slot mapping, then attends each sequence's
    queries over the pages its window reaches, with the window's mask (`StepAttention`'s
    `window`)."""

    def __init__(self, kv: KVGroups, cfg: Any, batch: StepBatch, layers: range) -> None:
        super().__init__(
            kv.manager(SLIDING).pool.cache,
            batch.pages[SLIDING],
            batch.positions,
            batch.q_lens,
            batch.ctx_lens,
            batch.num_decodes,
            batch.max_q,
            None,
            batch.progress,
            window=cfg.sliding_window,
        )
        self.where = layer_groups(cfg, layers)
        self.full: StepAttention | None = None
        """The full-attention layers' step (GQA's), where the model has them."""
        if FULL in batch.pages:
            self.full = StepAttention(
                kv.manager(FULL).pool.cache,
                batch.pages[FULL],
                batch.positions,
                batch.q_lens,
                batch.ctx_lens,
                batch.num_decodes,
                batch.max_q,
                None,
                batch.progress,
            )

    def attend_layer(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer `layer`'s paged attention for the step's tokens (as `attend` promises)."""
        group, index = self.where[layer]
        if group == SLIDING:  # GQA's writes, then the window's attend
            return paged_attend(self, index, q, k, v, sinks)
        full = self.full
        assert full is not None
        seconds, prefill = full.attention_seconds, full.prefill_seconds
        out = paged_attend(full, index, q, k, v, sinks)
        self.attention_seconds += full.attention_seconds - seconds  # what the step observes
        self.prefill_seconds += full.prefill_seconds - prefill
        return out


def step(kv: KVGroups, cfg: Any, batch: StepBatch) -> WindowStep:
    """The step's operator over the groups' pages (PyTorch's attention)."""
    assert batch.kernel is None, "the window kind runs on PyTorch's attention"
    layers = batch.layers
    if layers is None:  # the whole model
        layers = range(sum(m.pool.cache.spec.num_layers for m in kv.managers))
    return WindowStep(kv, cfg, batch, layers)


@torch.library.custom_op("pypto::window_attention", mutates_args=())
def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compiled graphs' view of the paged operator: opaque, over the active step."""
    step = current_step()
    assert isinstance(step, WindowStep), "a sliding-window model runs on its own step"
    return step.attend_layer(int(layer), q, k, v, sinks)


@window_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q)
