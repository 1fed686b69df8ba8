"""Speculative decoding (n-gram drafts): greedy tokens are the plain ones, bit for bit, on the
native decode step (rows of one sequence in one call: bf16's 8-row cap, int4's 256) and on the
graphs, GQA, MLA and windowed layers, alone, batched, after a prefix hit, across preemptions,
with stop tokens and strings, logprobs and a grammar, under TP 2 and DP 2, in this CPU's build
and the AVX2 build; sampled tokens come from the plain distribution (chi-square); the config's
errors; the drafter's rules; the counters."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from cpu_builds import AVX2_ENV, AVX2_IS_THIS_BUILD

from pypto_serving import LLM, SamplingParams
from pypto_serving.config import EngineConfig, parse_speculative_config
from pypto_serving.device import cpu_flags, cpu_isa
from pypto_serving.engine.core import EngineStats, combine_stats
from pypto_serving.errors import PyptoError
from pypto_serving.speculative import NgramIndex, SpecDecodeStats, Speculator, worth_drafting

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
MODEL = "qwen3-hd32-gqa4"  # a shape the native decode step takes


def prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    """Half repeat a short unit (the drafts mostly hold), half random (they mostly miss)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 2:
            out.append([rng.randrange(3, 320) for _ in range(rng.randrange(8, 60))])
        else:
            unit = [rng.randrange(3, 320) for _ in range(rng.randrange(3, 9))]
            out.append((unit * 20)[: rng.randrange(12, 90)])
    return out


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_drafts_held_and_missed(llm: LLM, missed: bool = True) -> SpecDecodeStats:
    spec = llm.engine.stats().spec_decode
    assert spec is not None and spec.num_accepted_tokens > 0, "no draft was kept"
    if missed:
        assert spec.num_draft_tokens > spec.num_accepted_tokens, "no draft was rejected"
    return spec


# --- the config -----------------------------------------------------------------------------


def test_the_config_reads_vllms_json():
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = parse_speculative_config({**NGRAM, "prompt_lookup_max": 4})
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 4)
    spec = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    "raw, says",
    [
        ("{not json", "not a JSON object"),
        ("[1]", "not a JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "medusa", "num_speculative_tokens": 1}', "Medusa heads"),
        ('{"method": "eagle", "model": "/d", "num_speculative_tokens": 3}', "EAGLE heads"),
        ('{"method": "lookahead", "num_speculative_tokens": 3}', "must be one of ngram"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}', "typo not understood"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "1 <= min <= max",
        ),
    ],
)
def test_a_bad_config_is_named(raw: str, says: str):
    with pytest.raises(PyptoError, match=says) as e:
        EngineConfig(speculative_config=raw).validate()
    assert e.value.param == "speculative_config"


def test_the_reference_executor_refuses_it():
    with pytest.raises(PyptoError, match="paged executor"):
        EngineConfig(executor="reference", speculative_config=NGRAM).validate()


def test_a_kind_that_cannot_take_drafts_back_is_refused(tiny_model):
    """DeepSeek-V4's compressed caches pool each window of rows once it is complete: a
    rejected draft's rows could not be taken back out of them."""
    path = tiny_model("deepseekv4-swa-csa-hca-hash")
    with pytest.raises(PyptoError, match=r"attention \(compressed\)") as e:
        LLM(str(path), enforce_eager=True, speculative_config=NGRAM)
    assert e.value.param == "speculative_config"


# --- the drafter ------------------------------------------------------------------------------


def test_the_longest_latest_ngram_is_continued():
    index = NgramIndex(1, 3)
    # "2 3" occurred twice before: the latest is continued; "1 2 3" once, longer, wins
    assert index.draft([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]
    assert NgramIndex(1, 3).draft([5, 6, 2, 3, 8, 2, 3], 3) == [8, 2, 3]
    assert NgramIndex(2, 2).draft([4, 5, 6, 7], 3) == []  # nothing occurred twice
    # a repeating pattern runs into the end: the draft goes on as it does
    assert NgramIndex(1, 2).draft([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]


def test_the_index_grows_with_the_tokens_once():
    tokens = [3, 4, 5, 3, 4]
    index = NgramIndex(1, 2)
    assert index.draft(tokens, 2) == [5, 3]
    tokens += [6, 3]
    assert index.draft(tokens, 2) == [4, 6]  # "3" latest before the end: at position 4
    assert index.indexed == len(tokens) - 1


def test_worth_drafting_makes_the_most_tokens_per_step_cost():
    # rate 0.5, a row 0.08 of a step: 1, 2, 3, 4 drafts give 1.5/1.08, 1.75/1.16, 1.875/1.24,
    # 1.9375/1.32 tokens per step = 1.389, 1.509, 1.512, 1.468
    assert worth_drafting(0.5, 8, row_cost=0.08) == 3
    assert worth_drafting(0.5, 2, row_cost=0.08) == 2  # never past k
    assert worth_drafting(0.2, 8, row_cost=0.08) == 1  # 1.2/1.08 against 1.24/1.16
    assert worth_drafting(0.0, 8) == 1  # still one: the text may turn repetitive
    assert worth_drafting(0.95, 8) == 8
    assert worth_drafting(0.5, 8, row_cost=0.0) == 8  # free rows: every draft pays
    assert worth_drafting(6 / 7, 9, row_cost=0.08) == 8  # KEPT_PRIOR's rate
    assert worth_drafting(6 / 7, 9, row_cost=0.25) == 4  # a dearer row: fewer
    counts = [worth_drafting(r / 100, 16) for r in range(100)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 16


def test_the_budget_follows_the_rate_drafts_are_kept():
    spec = parse_speculative_config({**NGRAM, "num_speculative_tokens": 8})
    assert spec is not None
    s = Speculator(spec)
    assert s.budget("r") == 8  # KEPT_PRIOR: as if 6 of 7 had been kept
    observed: list[tuple[int, int]] = []

    def step(kept_of: int | None = None) -> int:
        """Verify the budget's drafts, keeping `kept_of` of them (None: all)."""
        drafted = s.budget("r")
        kept = drafted if kept_of is None else min(kept_of, drafted)
        s.observe("r", drafted, kept)
        observed.append((drafted, kept))
        return s.budget("r")

    for _ in range(3):
        step()
    assert step(2) == 8  # one slip in a copied passage: still k
    falling = [step(0) for _ in range(12)]  # the copy ended: new text
    assert falling == sorted(falling, reverse=True) and falling[2] < 8 and falling[-1] == 1
    rising = [step() for _ in range(5)]  # a copy again
    assert rising == sorted(rising) and rising[-1] == 8
    assert s.budget("other") == 8
    stats = s.stats()
    assert stats.num_drafts == len(observed)
    assert stats.num_draft_tokens == sum(d for d, _ in observed)
    assert stats.num_accepted_tokens == sum(k for _, k in observed)
    s.forget("r")
    assert s.budget("r") == 8


def test_replicas_counters_add_up():
    def stats(spec: SpecDecodeStats | None) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, False, 0, 0, spec_decode=spec)

    a, b = SpecDecodeStats(2, 5, 3, (2, 1)), SpecDecodeStats(1, 4, 4, (1, 1, 1, 1))
    assert combine_stats([stats(a), stats(b)]).spec_decode == SpecDecodeStats(3, 9, 7, (3, 2, 1, 1))
    assert combine_stats([stats(None), stats(None)]).spec_decode is None


# --- greedy: the plain tokens ------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # the native step takes 8 rows: the drafts are cut to fit beside the decodes
    "bf16-native": (MODEL, {}),
    "int4-native": (MODEL, {"quantization": "int4"}),  # records its only weights: 256 rows
    "graphs": (MODEL, {"native_decode": False}),
    "batch-invariant": (MODEL, {"batch_invariant": True}),
    "llama-graphs": ("llama-gqa4-tied", {}),
    "mla": ("deepseekv3-qlora-yarn", {"dtype": "float32"}),  # one latent entry per token
    "window": ("mistral-window8", {"dtype": "float32", "page_size": 4}),  # pages given back
}


@pytest.fixture(scope="module")
def plain(tiny_model) -> Any:
    """Greedy tokens without drafts, per variant (computed once)."""
    made: dict[str, list[list[int]]] = {}

    def get(variant: str) -> list[list[int]]:
        if variant not in made:
            name, knobs = VARIANTS[variant]
            with LLM(str(tiny_model(name)), enforce_eager=True, **knobs) as llm:
                made[variant] = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
        return made[variant]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_are_the_plain_ones(tiny_model, plain, variant):
    """A batch of 8 with drafts, then each prompt alone (its prompt now a prefix hit): the
    plain batch's tokens every time; GQA on the native step and the graphs, MLA's latent
    entries, and windowed layers whose passed pages go back as the drafts move them."""
    name, knobs = VARIANTS[variant]
    with LLM(str(tiny_model(name)), enforce_eager=True, speculative_config=NGRAM, **knobs) as llm:
        native = llm.engine.executor.native is not None
        assert native == variant.endswith("native")
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == plain(variant)
        alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
        assert alone == plain(variant)
        assert llm.engine.stats().prefix_hits > 0
        spec = assert_drafts_held_and_missed(llm, missed=name == MODEL)
        if variant == "bf16-native":  # the 8-row cap left room for drafts now and then
            assert spec.num_drafts > 0


def test_preempted_requests_resume_on_the_plain_tokens(tiny_model, plain):
    """A pool of a few pages: requests with drafts are preempted (their KV recomputed or
    swapped) and go on to the plain tokens."""
    knobs: dict[str, Any] = {"page_size": 16, "num_kv_pages": 14, "kv_cpu_bytes": 0}
    with LLM(str(tiny_model(MODEL)), enforce_eager=True, speculative_config=NGRAM, **knobs) as llm:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == plain("bf16-native")
        assert llm.engine.stats().num_preemptions > 0
        assert_drafts_held_and_missed(llm, missed=False)
        assert llm.engine.executor.kv.usage() == 0.0  # every page came back


def test_stops_and_logprobs_are_the_plain_ones(tiny_model):
    """A stop token and a stop string met among kept drafts end the output where plain
    decoding ends it (the drafts after them dropped), and each kept token's logprobs are the
    plain step's."""
    path = str(tiny_model(MODEL))
    ps = prompts()[::2]  # the repeating ones: long runs of kept drafts
    with LLM(path, enforce_eager=True) as llm:
        free = llm.generate(ps, GREEDY, use_tqdm=False)
    stops = [o.outputs[0].token_ids[9] for o in free]
    texts = [o.outputs[0].text for o in free]
    cases = [
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop], logprobs=2)
        for stop in stops
    ] + [
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[text[12:15]])
        for text in texts
        if len(text) > 15
    ]
    batch = [p for p in ps] + [p for p, t in zip(ps, texts, strict=True) if len(t) > 15]
    with LLM(path, enforce_eager=True) as llm:
        want = llm.generate(batch, cases, use_tqdm=False)
    with LLM(path, enforce_eager=True, speculative_config=NGRAM) as llm:
        got = llm.generate(batch, cases, use_tqdm=False)
        assert_drafts_held_and_missed(llm)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert any(len(w.outputs[0].token_ids) < 32 for w in want)  # the stops did stop


def test_a_grammars_outputs_are_the_plain_ones(tiny_model):
    """Structured outputs: drafts end where the grammar would refuse them, each draft row is
    masked as the grammar stands after the drafts before it, and the grammar's own end (a
    completed match) among kept drafts ends the output there: the plain tokens, and text the
    pattern matches."""
    import re

    from pypto_serving.sampling import StructuredOutputsParams

    pattern = "(the (cat|dog) sat on the mat\\. ){2,4}"
    params = SamplingParams(
        temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    texts = ["the cat", "a dog", "on the mat"]
    path = str(tiny_model("llama-gqa4-tied"))
    with LLM(path, enforce_eager=True) as llm:
        want = llm.generate(texts, params, use_tqdm=False)
    with LLM(path, enforce_eager=True, speculative_config=NGRAM) as llm:
        got = [llm.generate([t], params, use_tqdm=False)[0] for t in texts]
        assert_drafts_held_and_missed(llm, missed=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert re.fullmatch(pattern, g.outputs[0].text), g.outputs[0].text


AVX2_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[2])
from test_speculative import GREEDY, NGRAM, prompts, tokens
from pypto_serving import LLM
with LLM(sys.argv[1], enforce_eager=True) as llm:
    want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
with LLM(sys.argv[1], enforce_eager=True, speculative_config=NGRAM) as llm:
    assert llm.engine.executor.native is not None
    got = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
    spec = llm.engine.stats().spec_decode
print(json.dumps({"same": got == want == alone, "kept": spec.num_accepted_tokens}))
"""


@pytest.mark.skipif(AVX2_IS_THIS_BUILD, reason="this CPU's own build is the AVX2 build")
def test_the_avx2_builds_native_step_verifies_the_same_way(tiny_model):
    """The AVX2 build's native decode step (rows of one sequence: every key written before
    any row attends) gives the plain tokens too (batched: 8 decodes fill its 8 rows, no room
    for drafts; alone: drafts)."""
    run = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK, str(tiny_model(MODEL)), str(Path(__file__).parent)],
        env=os.environ | AVX2_ENV,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert '"same": true' in run.stdout and '"kept": 0' not in run.stdout, run.stdout


# --- sampled: the plain distribution -------------------------------------------------------------


def chi_square_same(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """Pearson's chi-square of two samples' counts (a 2 x k table) and its degrees of
    freedom, categories of fewer than 5 expected merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
    rows: list[tuple[int, int]] = []
    rest = [0, 0]
    for t in keys:
        if (a[t] + b[t]) * min(na, nb) / (na + nb) >= 5:
            rows.append((a[t], b[t]))
        else:
            rest[0], rest[1] = rest[0] + a[t], rest[1] + b[t]
    if sum(rest):
        rows.append((rest[0], rest[1]))
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


def chi_square_critical(dof: int) -> float:
    """The chi-square quantile at 0.999 (Wilson-Hilferty), so that 3 positions' tests all
    pass by chance with probability 0.997 if the samples share their distribution."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_same_distribution(plain_out: list[list[int]], spec_out: list[list[int]]) -> None:
    """The 2nd, 3rd and 4th tokens of the two runs' samples pass a chi-square test of
    sameness, each at p = 0.999."""
    for position in (1, 2, 3):
        a = Counter(t[position] for t in plain_out)
        b = Counter(t[position] for t in spec_out)
        stat, dof = chi_square_same(a, b)
        assert dof >= 2, f"position {position}: too few outcomes to test ({a})"
        assert stat < chi_square_critical(dof), (position, stat, dof, a, b)


def test_sampled_tokens_come_from_the_plain_distribution(tiny_model):
    """One repeating prompt sampled 1,500 times each way (temperature 1, top-k 6): the
    drafts are its own continuation, kept about as often as the model draws them. The 2nd,
    3rd and 4th tokens' distributions pass a chi-square test of sameness."""
    path = str(tiny_model(MODEL))
    prompt = prompts()[0]
    n = 1500
    params = [
        SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=i)
        for i in range(n)
    ]
    with LLM(path, enforce_eager=True, quantization="int4", max_num_seqs=256) as llm:
        plain_out = tokens(llm.generate([prompt] * n, params, use_tqdm=False))
    spec_params = [
        SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=n + i)
        for i in range(n)
    ]
    knobs: dict[str, Any] = {"quantization": "int4", "max_num_seqs": 256}
    with LLM(path, enforce_eager=True, speculative_config=NGRAM, **knobs) as llm:
        spec_out = tokens(llm.generate([prompt] * n, spec_params, use_tqdm=False))
        assert_drafts_held_and_missed(llm)
    assert_same_distribution(plain_out, spec_out)


def test_the_counters_are_exposed_under_vllms_names_too():
    from prometheus_client import generate_latest

    from pypto_serving.engine.metrics import EngineMetrics

    spec = SpecDecodeStats(3, 9, 7, (3, 2, 1, 1))
    stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, False, 0, 0, spec_decode=spec)
    text = generate_latest(EngineMetrics(lambda: stats, "m").registry).decode()
    for prefix, labels in (("pypto_", 'model_name="m"'), ("vllm:", 'engine="0",model_name="m"')):
        assert f"{prefix}spec_decode_num_drafts_total{{{labels}}} 3.0" in text
        assert f"{prefix}spec_decode_num_draft_tokens_total{{{labels}}} 9.0" in text
        assert f"{prefix}spec_decode_num_accepted_tokens_total{{{labels}}} 7.0" in text
    per_position = 'engine="0",model_name="m",position="1"'
    assert f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{{per_position}}} 2.0" in text
    plain = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, False, 0, 0)
    assert "spec_decode" not in generate_latest(EngineMetrics(lambda: plain, "m").registry).decode()


def test_data_parallel_replicas_send_every_kept_token(tiny_model):
    """A replica's step may append several tokens to a request: each reaches the front, in
    order (the int4 native step: a row's tokens are the same in any batch)."""
    path = str(tiny_model(MODEL))
    with LLM(path, enforce_eager=True, quantization="int4") as llm:
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    knobs: dict[str, Any] = {"quantization": "int4", "data_parallel_size": 2}
    with LLM(path, enforce_eager=True, speculative_config=NGRAM, **knobs) as llm:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
        assert_drafts_held_and_missed(llm, missed=False)


@pytest.mark.slow
def test_the_default_model_gives_its_plain_tokens_and_keeps_drafts_of_echoed_text():
    """SmolLM2 from its GGUF (the records its only weights: every decode and its drafts in
    the native step): the echo and open workloads' replies, speculative and plain, are the
    same tokens, and drafts are kept on the echoed text."""
    from pypto_serving.bench.datasets import chat_prompts

    params = SamplingParams(temperature=0, max_tokens=96)
    with LLM("default") as llm:
        ps = chat_prompts(llm.tokenizer, "echo")[:2] + chat_prompts(llm.tokenizer, "open")[:1]
        want = tokens(llm.generate(ps, params, use_tqdm=False))
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}
    with LLM("default", speculative_config=spec) as llm:
        assert llm.engine.executor.native_rows == 256
        vnni = cpu_isa() == "avx512" and "avx512_vnni" in cpu_flags()  # records.h's VNNI path
        assert llm.engine.speculator is not None
        assert llm.engine.speculator.row_cost == (0.08 if vnni else 0.25)
        got = [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in ps]
        kept = assert_drafts_held_and_missed(llm)
    assert got == want
    assert kept.num_accepted_tokens > len(want[0]) // 2  # most of the echo came from drafts


def test_tensor_parallel_ranks_verify_the_drafts_together(tiny_model):
    """TP 2: rank 0 decides the drafts, the step carries their rows to the other rank, and
    each rank's share of the native step writes every row's keys before any row attends:
    the plain TP 2 run's tokens."""
    path = str(tiny_model(MODEL))
    knobs: dict[str, Any] = {"quantization": "int4", "tensor_parallel_size": 2}
    with LLM(path, enforce_eager=True, **knobs) as llm:
        want = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
    with LLM(path, enforce_eager=True, speculative_config=NGRAM, **knobs) as llm:
        native = llm.engine.executor.native
        assert native is not None and native.comm is not None
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()] == want
        assert_drafts_held_and_missed(llm)
