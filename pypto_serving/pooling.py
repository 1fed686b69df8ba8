"""Embeddings: a prompt's final hidden states pooled into one vector (vLLM's pooling runner).

A decoder's last hidden states (after its final norm) are pooled by the model's rule: the
last token's (Qwen3-Embedding, most decoder embedding models), the mean over the tokens, or
the first token's (`cls`); then optionally cut to their first `dimensions` values (Matryoshka
embeddings) and scaled to unit length. A model directory that holds a sentence-transformers
pooling config (`modules.json` naming a Pooling module whose `config.json` sets
`pooling_mode_lasttoken`, `pooling_mode_mean_tokens` or `pooling_mode_cls_token`) gives its
own rule and is an embedding model; any other model embeds with `--runner pooling`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pypto_serving.errors import PyptoError

POOLING_TYPES = ("last", "mean", "cls")
ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
"""sentence-transformers' Pooling config keys -> our pooling types."""


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How one prompt is embedded (vLLM's names)."""

    pooling_type: str | None = None
    """last, mean or cls; None: the model's rule (its pooling config, else last)."""
    normalize: bool = True
    """Scale the vector to unit length (L2)."""
    dimensions: int | None = None
    """Keep the first this many values (before normalizing), as OpenAI's `dimensions`."""

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise PyptoError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                f"{self.pooling_type!r}",
                "pooling_type",
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise PyptoError(
                f"dimensions must be an integer >= 1, got {self.dimensions!r}", "dimensions"
            )

    def resolved(self, model_rule: str) -> PoolingParams:
        """These params with the model's rule where they name none."""
        return self if self.pooling_type is not None else replace(self, pooling_type=model_rule)


def model_pooling(model_dir: Path) -> str | None:
    """The pooling rule a sentence-transformers model directory declares, or None (not an
    embedding model by its files)."""
    modules = model_dir / "modules.json"
    if not model_dir.is_dir() or not modules.is_file():
        return None
    try:
        listed = json.loads(modules.read_text())
        pooling = next(m for m in listed if str(m.get("type", "")).endswith("Pooling"))
        config = json.loads((model_dir / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError) as e:
        raise PyptoError(f"cannot read the pooling config of {model_dir}: {e}") from None
    modes = [ours for key, ours in ST_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise PyptoError(
            f"{model_dir}'s pooling config must set one of {', '.join(ST_MODES)}; this server "
            "pools by the last token, the mean or the first token"
        )
    return modes[0]


def pool(hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """One prompt's hidden states [T, hidden] (final norm applied) -> its embedding."""
    if params.pooling_type == "mean":
        vector = hidden.float().mean(dim=0)
    elif params.pooling_type == "cls":
        vector = hidden[0].float()
    else:
        vector = hidden[-1].float()
    if params.dimensions is not None:
        if params.dimensions > vector.shape[0]:
            raise PyptoError(
                f"dimensions {params.dimensions} is more than this model's {vector.shape[0]}",
                "dimensions",
            )
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
