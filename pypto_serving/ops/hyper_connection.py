"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is `n` streams per token,
[T, n, hidden] in float32. Before a block its streams are collapsed into the block's input
(weights `pre`); after it the block's output is spread back over them (`post`) and added to
the streams mixed by a doubly stochastic matrix (`comb`, by Sinkhorn-Knopp). The three come
from one small projection of the normed streams, per token.

    streams [T, n, D] ──┬── pre · streams ──▶ block ──▶ post ⊗ out ──┐
                        └──────── combᵀ · streams ──────────────────── + ──▶ streams
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim (no learned weight), the rms in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hyper_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's (post [T, n], comb [T, n, n], collapsed input [T, D]) for streams [T, n, D];
    fn [(2 + n) n, n D], base [(2 + n) n] and scale [3] are the layer's weights."""
    n = streams.shape[1]
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1)
    return post, comb, collapsed


def hyper_residual(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: its output [T, D] spread by post, plus combᵀ · streams
    (a sum of n broadcast products, which a compiled graph fuses with the rest: as a batched
    matmul of T [n, n] x [n, D] products it was an opaque call, 4 % of a prefill chunk)."""
    mixed = post.unsqueeze(-1) * out.float().unsqueeze(-2)
    for i in range(streams.shape[1]):
        mixed = mixed + comb[:, i, :, None] * streams[:, i, None, :]
    return mixed


def hyper_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """The final collapse of the streams [T, n, D] into one [T, D] before the last norm."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1)
