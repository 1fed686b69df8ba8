"""The attention operator's interface, and the plain dense KV cache of the reference executor.

The model calls `kv.attend(layer, q, k, v)` for the new tokens of a step. Whoever implements
`KVAttention` owns the KV storage: it writes the new k/v and reads the cached ones. The paged
store (pypto_serving.kv) implements it over pages; `DenseKV` here implements it for a single
sequence with growing tensors, as the simplest correct oracle.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class KVAttention(Protocol):
    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store k/v [T, kv_heads, D] of the new tokens, attend q [T, heads, D] causally over
        everything cached for their sequences, and return [T, heads, D]. `layer` is the
        layer's index as a 0-d CPU tensor (so that compiled layers share one graph)."""
        ...

    def attend_latent(
        self, layer: torch.Tensor, q: torch.Tensor, entry: torch.Tensor
    ) -> torch.Tensor:
        """MLA: store entry [T, E] of the new tokens (the normed latent c_kv, then the roped
        k_pe), attend q [T, heads, E] causally over the sequence's cached entries, each both
        key and value, with scale E**-0.5 (the model pre-scales q), and return [T, heads, E]
        (softmax(q entries^T E**-0.5) @ entries)."""
        ...


class DenseKV:
    """KV cache of one sequence: per layer, K and V tensors [S, kv_heads, D] that grow."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.latent: list[torch.Tensor | None] = [None] * num_layers
        """MLA: per layer, the entries [S, E] (one per token, shared by all heads)."""

    def __len__(self) -> int:
        first = self.k[0] if self.latent[0] is None else self.latent[0]
        return 0 if first is None else first.shape[0]

    def attend(
        self, layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        i = int(layer)
        past_k, past_v = self.k[i], self.v[i]
        if past_k is not None and past_v is not None:
            k, v = torch.cat((past_k, k)), torch.cat((past_v, v))
        self.k[i], self.v[i] = k, v
        return causal_attention(q, k, v)

    def attend_latent(
        self, layer: torch.Tensor, q: torch.Tensor, entry: torch.Tensor
    ) -> torch.Tensor:
        """MLA: store entry [T, E] of the new tokens, attend q [T, heads, E] causally over the
        cached entries (each one both key and value, scale E**-0.5), return [T, heads, E]."""
        i = int(layer)
        past = self.latent[i]
        entries = entry if past is None else torch.cat((past, entry))
        self.latent[i] = entries
        return causal_attention(q, entries[:, None, :], entries[:, None, :])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] are the last T positions of a sequence whose keys/values are k, v [S, Hkv, D]."""
    t, s = q.shape[0], k.shape[0]
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)
