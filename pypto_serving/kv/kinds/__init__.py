"""The attention kinds, one module each (`gqa`, `mla`): everything a kind is lives in its file.

A kind's module holds its KV spec (`kv_spec`, from the model config: what a token costs, the
page layout), its paged operator (writes the layer's new entries through the active
`StepAttention`'s slot mapping into the cache's tensors, then `StepAttention.attend`), the
custom op the compiled graphs call it through, its dense oracle (over the reference
executor's `DenseKV`), and `attend`, the one call its model code makes, which picks the dense
or the paged path by the `KVAttention` it is given. A model declares its kind
(`CausalLM.attention_kind`); the executor builds its KV from that kind's spec. The generic
machinery (`paged_attention.StepAttention`, `paged_cache.PagedCache`, the store, the tiers,
`ops.attention.DenseKV`) never names a kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from pypto_serving.kv.spec import KVSpec

if TYPE_CHECKING:
    from pypto_serving.kv.paged_attention import StepAttention, StepProgress
    from pypto_serving.kv.windowed_store import WindowedKVStore


class AttentionKind(Protocol):
    """What the executor asks of a model's attention kind (a module of this package)."""

    def kv_spec(
        self,
        cfg: Any,
        num_layers: int,
        page_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> KVSpec:
        """The KV spec of this rank's share (`cfg` holds its heads, `num_layers` its layers)
        in the model's `dtype`, or as `kv_cache_dtype` says ("auto": the model's)."""
        ...


@runtime_checkable
class WindowedKind(AttentionKind, Protocol):
    """A kind that keeps per-token rows only for a sliding window besides its pages kept
    whole (`kv_spec`'s): the executor gives it a `WindowedKVStore` and its own step."""

    def row_spec(
        self,
        cfg: Any,
        num_layers: int,
        page_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> tuple[KVSpec, int]:
        """The rows' spec, and how many tokens before the next one a sequence keeps."""
        ...

    def windowed_step(
        self,
        store: WindowedKVStore,
        cfg: Any,
        request_ids: list[str],
        positions: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        num_decodes: int,
        max_q: int,
        progress: StepProgress | None = None,
    ) -> StepAttention:
        """The step's attention operator over the store's two groups of pages."""
        ...
