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

from typing import Any, Protocol

import torch

from pypto_serving.kv.spec import KVSpec


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
