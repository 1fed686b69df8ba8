"""One request's greedy tokens and logprobs in every situation a server puts it in: alone, again
after a prefix hit, in a batch of 16, with its prompt chunked, reloaded from the CPU tier, and
preempted (recomputed). Used by test_batch_invariance.py in its own process, and run as a child
process for the AVX2 build (`python invariance_checks.py MODEL_DIR KNOBS_JSON`: torch's ISA is
read from the environment as torch loads), printing one JSON object of the situations.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pypto_serving import LLM, SamplingParams

A = [(5 * j + 7) % 300 + 3 for j in range(40)]
OTHERS = [[(11 * i + 3 * j) % 300 + 3 for j in range(5 + 7 * i)] for i in range(15)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
BASE_KNOBS: dict[str, Any] = {"num_kv_pages": 256, "page_size": 16}

Result = tuple[list[int], list[float]]


def run(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    """The requests of `prompts`, queued in order and stepped to the end."""
    families = [llm.add(p, PARAMS) for p in prompts]
    while llm.engine.has_unfinished():
        llm.step()
    return [f.children[0] for f in families]


def result(request: Any) -> Result:
    return list(request.output_token_ids), [s.logprob for s in request.output_logprobs]


def situations(model_dir: str, knobs: dict[str, Any]) -> dict[str, Result]:
    """Request A's result in each situation; asserts each situation happened (a prefix hit,
    pages from the CPU tier, A preempted)."""
    knobs = BASE_KNOBS | knobs
    out: dict[str, Result] = {}
    with LLM(model_dir, **knobs) as llm:
        out["alone"] = result(run(llm, [A])[0])
        again = run(llm, [A])[0]
        assert again.num_cached_tokens >= 32, again.num_cached_tokens
        out["prefix hit"] = result(again)
        out["batch of 16"] = result(run(llm, [A, *OTHERS])[0])
    with LLM(model_dir, **(knobs | {"max_num_batched_tokens": 16})) as llm:
        out["chunked prefill"] = result(run(llm, [A])[0])
    tiny_pool = knobs | {"num_kv_pages": 12, "kv_cpu_bytes": 64 << 20}
    with LLM(model_dir, **tiny_pool) as llm:
        run(llm, [A])
        # their pages push A's out of the device pool, one request at a time: none is
        # preempted, so no swap-in times a load before A's (weighed against the first guess)
        for other in OTHERS[8:]:
            run(llm, [other])
        reloaded = run(llm, [A])[0]
        assert reloaded.cached_tokens_by_tier.get("cpu", 0) > 0, reloaded.cached_tokens_by_tier
        out["cpu tier reload"] = result(reloaded)
    no_cache = {"kv_cpu_bytes": 0, "enable_prefix_caching": False}
    with LLM(model_dir, **(tiny_pool | no_cache)) as llm:
        # A decodes at a lower priority when the others arrive: the one preempted (its KV
        # dropped, every token recomputed on resumption: prompt and outputs as one prefill)
        # when they outgrow the pool
        first = llm.add(A, PARAMS, priority=1).children[0]
        for _ in range(4):
            llm.step()
        assert first.output_token_ids
        run(llm, OTHERS[6:])
        assert first.num_preemptions > 0 and first.finished
        out["preempted"] = result(first)
    return out


if __name__ == "__main__":
    print(json.dumps(situations(sys.argv[1], json.loads(sys.argv[2]))))
