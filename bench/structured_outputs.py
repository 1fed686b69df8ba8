#!/usr/bin/env python
"""What structured outputs cost: a batch of 16 prompts, none or half of them held to a JSON
schema, output tokens per second (medians of --rounds, alternating); and the time to make a
matcher for each of the tests' schemas (tests/test_structured_outputs.py's SCHEMAS).

    python bench/structured_outputs.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_structured_outputs import SCHEMAS

from pypto_serving import LLM, SamplingParams, grammar
from pypto_serving.sampling import StructuredOutputsParams

QUESTIONS = [
    "Tell me about Paris, as JSON.",
    "Describe a city you like.",
    "List three rivers and their lengths.",
    "What is a good breakfast?",
]


def run(llm: LLM, prompts: list[list[int]], constrained: bool) -> float:
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=128,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[-1])
            if constrained and i % 2 == 0
            else None,
        )
        for i in range(len(prompts))
    ]
    families = [llm.add(p, q) for p, q in zip(prompts, params, strict=True)]
    start = time.perf_counter()
    while any(not f.finished for f in families):
        llm.step()
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for f in families for o in f.output().outputs) / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with LLM("default") as llm:
        prompts = [
            llm.chat_prompt([{"role": "user", "content": f"{q} ({i})"}])
            for i in range(4)
            for q in QUESTIONS
        ]
        run(llm, prompts, True)  # warm-up: graphs compiled, matchers' tokenizer read
        free, held = [], []
        for _ in range(args.rounds):
            free.append(run(llm, prompts, False))
            held.append(run(llm, prompts, True))
        print(f"free: {statistics.median(free):.1f} tok/s  ({', '.join(f'{x:.1f}' for x in free)})")
        print(
            f"8 of 16 held to a schema: {statistics.median(held):.1f} tok/s  "
            f"({', '.join(f'{x:.1f}' for x in held)})"
        )
        print(f"ratio: {statistics.median(held) / statistics.median(free):.3f}")
        grammars = llm.engine.grammars  # type: ignore[union-attr]
        grammar._grammar_text.cache_clear()  # each schema compiled from its text
        times = []
        for schema in SCHEMAS:
            start = time.perf_counter()
            grammars.vocabulary.compile(StructuredOutputsParams(json=schema))  # uncached
            times.append(1000 * (time.perf_counter() - start))
        print(
            f"matcher per schema: median {statistics.median(times):.2f} ms, "
            f"max {max(times):.2f} ms over {len(times)} schemas "
            "(compiled from the text, first tokens walked)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
