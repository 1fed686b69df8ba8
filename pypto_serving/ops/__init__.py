"""Operators: attention (owning its KV), norms, RoPE, activations, sampling."""
