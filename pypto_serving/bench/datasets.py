"""Benchmark prompts: random token ids drawn from the vocabulary, or prompts read from a file.

Random prompts are a pure function of (vocabulary, count, length, seed), so another process
(bench/side_by_side.py feeding a peer engine) can rebuild exactly the same token ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pypto_serving.errors import PyptoError
from pypto_serving.flags import read_prompts


def sampling_vocab(tokenizer: Any, vocab_size: int) -> list[int]:
    """Token ids a random prompt may use: the model's vocabulary minus special/added tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}))
    limit = min(vocab_size, len(tokenizer))
    vocab = [t for t in range(limit) if t not in special]
    if not vocab:
        raise PyptoError("the tokenizer has no ordinary tokens to draw random prompts from")
    return vocab


def random_prompts(
    vocab: Sequence[int], num_prompts: int, input_len: int, seed: int
) -> list[list[int]]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from `vocab`."""
    rng = random.Random(seed)
    return [rng.choices(vocab, k=input_len) for _ in range(num_prompts)]


def file_prompts(path: Path, num_prompts: int | None) -> list[str]:
    """The first `num_prompts` prompts of a file (JSONL with a 'prompt' field, or plain lines)."""
    prompts = read_prompts(path)
    if num_prompts is None:
        return prompts
    if num_prompts > len(prompts):
        raise PyptoError(f"--num-prompts {num_prompts}: {path} has only {len(prompts)} prompts")
    return prompts[:num_prompts]
