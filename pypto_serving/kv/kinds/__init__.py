"""The attention kinds, one module each (`gqa`, `mla`, `compressed`, ...): everything a kind
is lives in its file.

A kind's module declares what it can run on (`KERNELS`: its paged operator attends on the
native attention kernels; `NATIVE_DECODE`: the native decode step runs its decodes;
`OWN_KERNELS`: its operator has native kernels of its own, which it loads itself;
`SPECULATES`: speculative decoding's rejected drafts may leave entries behind), which
the run plan (engine/plan.py) reads once; its KV groups (`kv_groups`, from the model config:
each group's page layout, what a token costs, and the rule its manager keeps pages and claims
prefix hits by: every token, or a window of the last `keep`); builds a step's attention
operator over them (`step`); and holds its paged operator (writes the layer's new entries
through the step's slot mapping into the cache's tensors, then attends), the custom op the
compiled graphs call it through, its dense oracle (over the reference executor's `DenseKV`),
and `attend`, the one call its model code makes, which picks the dense or the paged path by
the `KVAttention` it is given. A model declares its kind (`CausalLM.attention_kind`); the
executor builds its KV from that kind's groups. The generic machinery
(`paged_attention.StepAttention`, `paged_cache.PagedCache`, the groups' managers, the pool,
the tiers, `ops.attention.DenseKV`) never names a kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from pypto_serving.kv.spec import KVGroup

if TYPE_CHECKING:
    from pypto_serving.kv.groups import KVGroups
    from pypto_serving.kv.paged_attention import StepAttention, StepBatch


class AttentionKind(Protocol):
    """What the run plan and the executor ask of a model's attention kind (a module of this
    package)."""

    NAME: str
    """The kind's name ("gqa", "mla", ...)."""
    KERNELS: bool
    """Whether its paged operator can attend on the native attention kernels (for a shape
    they take, `native_attention.takes`)."""
    NATIVE_DECODE: bool
    """Whether the native decode step (executor/native_decode.py) can run its decodes."""
    OWN_KERNELS: bool
    """Whether its paged operator has native kernels of its own (a library of its own, which
    it loads where the run plan says so: `StepBatch.own_kernels`)."""
    SPECULATES: bool
    """Whether a step's entries of tokens it then drops can be left behind (speculative
    decoding's rejected drafts): each entry is written at its token's position and read only
    by later positions, so the next token written there replaces it."""

    def kv_groups(
        self,
        cfg: Any,
        layers: range,
        page_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> list[KVGroup]:
        """The KV groups of this rank's share (`cfg` holds its heads, `layers` the checkpoint
        indices of its layers: its pipeline stage's) in the model's `dtype`, or as
        `kv_cache_dtype` says ("auto": the model's); the first is the one prefix-hit
        breakdowns and KV events report. Every stage of a model declares the same groups,
        in the same order (a stage may hold no layer of one)."""
        ...

    def step(self, kv: KVGroups, cfg: Any, batch: StepBatch) -> StepAttention:
        """The step's attention operator over the groups' pages."""
        ...
