"""The KV a forward runs over (`KVAttention`), the reference executor's dense per-sequence KV
store (`DenseKV`), and plain causal attention.

The model's attention layers hand their new tokens to their attention kind
(`pypto_serving.kv.kinds`: `gqa.attend(kv, layer, q, k, v)`, `mla.attend(kv, layer, q,
entry)`), with the `KVAttention` object the forward was given: on a `DenseKV` the kind runs
its dense oracle, storing what it keeps per layer here; otherwise (`kv.paged_attention.PagedKV`)
its paged operator, through its custom op. Nothing here knows the kinds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVAttention:
    """What every decoder layer of a forward is given for its attention: a `DenseKV`, or the
    paged operator's `PagedKV`. Each attention kind's `attend` takes it and chooses."""


class DenseKV(KVAttention):
    """The KV of one sequence, as the reference executor keeps it: per layer, the tensors its
    attention kind stores (GQA: K and V [S, kv_heads, D]; MLA: the entries [S, E]), one row per
    token along the first dimension, growing with each forward."""

    def __init__(self, num_layers: int) -> None:
        self.layers: list[tuple[torch.Tensor, ...]] = [()] * num_layers

    def __len__(self) -> int:
        """Tokens stored."""
        first = self.layers[0]
        return first[0].shape[0] if first else 0

    def forget(self, layer: int) -> None:
        """Let go of layer `layer`'s tensors (a forward run layer by layer that is done with it)."""
        self.layers[layer] = ()

    def extend(self, layer: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append the new tokens' tensors to layer `layer`'s; return all of its tokens'."""
        past = self.layers[layer]
        if past:
            new = tuple(torch.cat((p, n)) for p, n in zip(past, new, strict=True))
        self.layers[layer] = new
        return new


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] are the last T positions of a sequence whose keys/values are k, v [S, Hkv, D]."""
    t, s = q.shape[0], k.shape[0]
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)
