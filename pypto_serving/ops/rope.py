"""Rotary position embedding (the "rotate half" / NeoX layout used by HF Llama and Qwen)."""

import torch


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim] for the given positions, computed in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the per-token angles in cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim / 2] in float32: one angle per pair of dims (DeepSeek-V4's
    interleaved layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :].float()
    return freqs.cos(), freqs.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x [T, ..., D] in pairs (2i, 2i + 1) by
    the per-token angles cos/sin [T, rope_dim / 2] (negate sin to undo it); the leading dims
    pass through. Computed in float32, returned in x's dtype."""
    rope = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    pairs = x[..., -rope:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope], rotated.to(x.dtype)), dim=-1)
