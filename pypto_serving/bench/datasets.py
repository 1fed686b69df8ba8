"""Benchmark prompts: random token ids drawn from the vocabulary, or prompts read from a file.

Random prompts are a pure function of (vocabulary, count, length, seed), so another process
(bench/side_by_side.py feeding a peer engine) can rebuild exactly the same token ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pypto_serving.chat_prompt import ChatTemplateOptions, chat_token_ids
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


_PARAGRAPH = (
    "The river town wakes early. Before the sun clears the hills, the bakers have lit their "
    "ovens and the ferry has made its first crossing, carrying milk, letters and two sleepy "
    "teachers to the far bank. By eight the market square is full of voices: fishermen "
    "arguing over the price of eel, children racing to school, and an old man who sells "
    "umbrellas whatever the weather."
)
_CODE = '''def total_price(items, tax_rate, discount=0.0):
    """The price of a basket of items after the discount and the tax."""
    subtotal = 0.0
    for item in items:
        subtotal += item.price * item.quantity
    subtotal -= subtotal * discount
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)
'''
_TYPOS = (
    "Our team will meet on Tuesdy at ten in the morning to reveiw the budget for the next "
    "quarter. Please bring your notes, the latest sales figures and any questions you have "
    "about the new travel polcy. Coffee and pastries will be provided, and the meeting should "
    "finish before lunch."
)
_STEPS = (
    "1. Preheat the oven to 200 degrees.\n2. Mix the flour, sugar and butter in a large "
    "bowl.\n3. Add two eggs and a cup of milk, then stir until smooth.\n4. Pour the batter "
    "into a greased tin.\n5. Bake for thirty minutes, until golden."
)
WORKLOADS: dict[str, list[str]] = {
    "echo": [
        f"Repeat the following text exactly, with no other words:\n\n{_PARAGRAPH}",
        "Rewrite this Python code with the variable subtotal renamed to net_amount:\n\n"
        f"```python\n{_CODE}```",
        f"Correct the spelling in the following text and write it out again in full:\n\n{_TYPOS}",
        f"Repeat this list exactly:\n\n{_STEPS}",
    ],
    "open": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me ten ideas for a child's birthday party.",
        "Describe a walk through a forest in autumn.",
    ],
}
"""Chat prompts (user messages) for single-stream benchmarks of speculative decoding: `echo`
asks for a given text back, repeated or lightly edited (what n-gram drafts guess well),
`open` for new text."""


def chat_prompts(tokenizer: Any, workload: str) -> list[list[int]]:
    """A workload's prompts as token ids, each a user message under the chat template."""
    if workload not in WORKLOADS:
        raise PyptoError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    options = ChatTemplateOptions()
    return [
        chat_token_ids(tokenizer, [{"role": "user", "content": text}], options)
        for text in WORKLOADS[workload]
    ]
