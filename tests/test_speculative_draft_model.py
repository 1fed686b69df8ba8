"""Speculative decoding with a draft model (`{"model": DIR, "num_speculative_tokens": k}`):
greedy tokens are the plain ones whether the draft always agrees (the target itself), often
(the target's weights perturbed) or never (another architecture), on the native step (bf16's
8 rows, int4's 256) and the graphs, GQA and MLA targets, alone, batched, after a prefix hit,
across preemptions, with a grammar, a draft pool too small for every request, TP 2; sampled
tokens come from the plain distribution (chi-square); the draft model's pages all come back;
a bad draft model is named."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculative import (
    GREEDY,
    MODEL,
    assert_drafts_held_and_missed,
    assert_same_distribution,
    prompts,
    tokens,
)

from pypto_serving import LLM, SamplingParams
from pypto_serving.config import EngineConfig, parse_speculative_config
from pypto_serving.errors import PyptoError
from pypto_serving.executor.draft_model import shared_prefix


def perturbed(source: Path, out: Path, scale: float) -> Path:
    """The checkpoint at `source` with noise of `scale` times each tensor's spread added (a
    seeded draw): a draft that agrees with its target often, not always."""
    if out.exists():
        return out
    shutil.copytree(source, out)
    gen = torch.Generator().manual_seed(7)
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if w.is_floating_point() and w.numel() > 1:
            noise = torch.randn(w.shape, generator=gen) * float(w.float().std()) * scale
            weights[name] = (w.float() + noise).to(w.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def drafts(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Draft models for MODEL: itself, itself perturbed, and a tiny Llama (same tokenizer)."""
    target = tiny_model(MODEL)
    return {
        "same": target,
        "perturbed": perturbed(target, tmp_path_factory.mktemp("d") / "perturbed", 0.4),
        "other": tiny_model("llama-gqa4-tied"),
    }


def draft_config(path: Path, k: int = 4) -> dict[str, Any]:
    return {"model": str(path), "num_speculative_tokens": k}


# --- the config -----------------------------------------------------------------------------


def test_the_config_reads_a_draft_model():
    spec = parse_speculative_config('{"model": "/d", "num_speculative_tokens": 3}')
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model",
        "/d",
        3,
    )
    spec = parse_speculative_config(
        {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    )
    assert spec is not None and (spec.model, spec.quantization) == ("/d", "auto")
    spec = parse_speculative_config(
        {"model": "/d.gguf", "num_speculative_tokens": 2, "quantization": "gguf"}
    )
    assert spec is not None and spec.quantization == "gguf"


@pytest.mark.parametrize(
    "raw, says",
    [
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs its path"),
        (
            '{"model": "/d", "num_speculative_tokens": 3, "prompt_lookup_min": 2}',
            "prompt_lookup_min belong to the ngram method",
        ),
        ('{"model": "/d"}', "num_speculative_tokens must be"),
        ('{"model": "/d", "num_speculative_tokens": 3, "quantization": "q3"}', "quantization must"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "quantization": "int4"}',
            "quantization belongs to a draft model",
        ),
    ],
)
def test_a_bad_draft_config_is_named(raw: str, says: str):
    with pytest.raises(PyptoError, match=says) as e:
        EngineConfig(speculative_config=raw).validate()
    assert e.value.param == "speculative_config"


def test_a_missing_or_unfit_draft_model_is_named(tiny_model, tmp_path):
    target = str(tiny_model(MODEL))
    with pytest.raises(PyptoError, match="the draft model: model path not found") as e:
        LLM(target, enforce_eager=True, speculative_config=draft_config(tmp_path / "none"))
    assert e.value.param == "speculative_config"
    big = tmp_path / "big"
    shutil.copytree(tiny_model("llama-gqa4-tied"), big)
    config = (big / "config.json").read_text().replace('"vocab_size": 320', '"vocab_size": 400')
    (big / "config.json").write_text(config)
    with pytest.raises(PyptoError, match=r"vocabulary \(400 tokens\) is larger"):
        LLM(target, enforce_eager=True, speculative_config=draft_config(big))
    v4 = tiny_model("deepseekv4-swa-csa-hca-hash")
    with pytest.raises(PyptoError, match=r"draft model's attention \(compressed\)"):
        LLM(target, enforce_eager=True, speculative_config=draft_config(v4))


def test_the_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2], [1, 2, 3]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([5], [6]) == 0


def test_the_drafts_are_the_draft_models_own_greedy_tokens(tiny_model):
    """The proposer's shadow of a request follows it as the target keeps some drafts and
    rejects the rest (its KV rolled back to what it shares with the request's tokens), is
    asked again with nothing new, and with a limit: every time its drafts are the draft
    model's own greedy continuation of the request's tokens (a plain engine's)."""
    import random

    from pypto_serving.request import Request

    draft, knobs = str(tiny_model("llama-gqa4-tied")), {"dtype": "float32", "page_size": 4}
    with LLM(draft, enforce_eager=True, **knobs) as ref:

        def truth(seq: list[int], k: int) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
            return tokens(ref.generate([seq], params, use_tqdm=False))[0]

        spec = draft_config(Path(draft))
        with LLM(
            str(tiny_model(MODEL)), enforce_eager=True, speculative_config=spec, **knobs
        ) as llm:
            proposer = llm.engine.draft_model
            assert proposer is not None
            rng = random.Random(3)
            request = Request("r", prompts()[1], GREEDY)
            for round_ in range(12):
                k = 4 if round_ % 5 else 2
                got = proposer.propose([(request, k)])["r"]
                assert got == truth(request.token_ids, k), round_
                if round_ % 4 == 3:
                    continue  # asked again with the same tokens
                kept = got[: round_ % (k + 1)]
                request.output_token_ids += [*kept, rng.randrange(3, 320)]
            proposer.forget("r")
            assert proposer.executor.kv.usage() == 0.0


# --- greedy: the plain tokens -----------------------------------------------------------------

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # (draft, target knobs)
    "same-native": ("same", {}),
    "perturbed-native": ("perturbed", {}),
    "perturbed-int4": ("perturbed", {"quantization": "int4"}),  # 256 rows: drafts in batches
    "perturbed-graphs": ("perturbed", {"native_decode": False}),
    "other-native": ("other", {}),
}


@pytest.fixture(scope="module")
def plain(tiny_model) -> Any:
    made: dict[str, list[list[int]]] = {}

    def get(knobs: dict[str, Any]) -> list[list[int]]:
        key = repr(sorted(knobs.items()))
        if key not in made:
            with LLM(str(tiny_model(MODEL)), enforce_eager=True, **knobs) as llm:
                made[key] = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
        return made[key]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_are_the_plain_ones(tiny_model, drafts, plain, case):
    """A batch of 8 with a draft model's drafts, then each prompt alone (a prefix hit for the
    target; the draft model's shadow of it starts over): the plain tokens every time, the
    drafts kept as often as the draft agrees, and every draft page back when all finish."""
    which, knobs = CASES[case]
    spec = draft_config(drafts[which])
    with LLM(str(tiny_model(MODEL)), enforce_eager=True, speculative_config=spec, **knobs) as llm:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == plain(knobs)
        alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
        assert alone == plain(knobs)
        stats = llm.engine.stats().spec_decode
        assert stats is not None and stats.num_draft_tokens > 0
        if which == "same":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        elif which == "perturbed":
            assert_drafts_held_and_missed(llm)
        draft = llm.engine.draft_model
        assert draft is not None and draft.executor.kv.usage() == 0.0


def test_an_mla_target_with_a_draft_model(tiny_model, tmp_path):
    """DeepSeek-V3's latent KV as the target, its perturbed self as the draft."""
    target = tiny_model("deepseekv3-qlora-yarn")
    draft = perturbed(target, tmp_path / "draft", 0.3)
    knobs: dict[str, Any] = {"dtype": "float32"}
    with LLM(str(target), enforce_eager=True, **knobs) as llm:
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    with LLM(
        str(target), enforce_eager=True, speculative_config=draft_config(draft), **knobs
    ) as llm:
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()] == want
        assert_drafts_held_and_missed(llm)


def test_preemption_and_a_small_draft_pool(tiny_model, drafts, plain):
    """A target pool of a few pages (requests preempted and recomputed) and a draft pool too
    small for every request (some get no drafts, some lose their shadow and start over):
    the plain tokens."""
    knobs: dict[str, Any] = {"page_size": 16, "num_kv_pages": 14, "kv_cpu_bytes": 0}
    spec = draft_config(drafts["same"])
    with LLM(str(tiny_model(MODEL)), enforce_eager=True, speculative_config=spec, **knobs) as llm:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == plain({})
        assert llm.engine.stats().num_preemptions > 0
        draft = llm.engine.draft_model
        assert draft is not None and draft.executor.kv.num_pages == 14
        assert draft.executor.kv.usage() == 0.0


def test_a_grammars_outputs_are_the_plain_ones(tiny_model, tmp_path):
    """Drafts of a draft model that knows nothing of the grammar end where the grammar would
    refuse them: the plain constrained tokens."""
    import re

    from pypto_serving.sampling import StructuredOutputsParams

    pattern = "(the (cat|dog) sat on the mat\\. ){2,4}"
    params = SamplingParams(
        temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    texts = ["the cat", "a dog", "on the mat"]
    target = tiny_model("llama-gqa4-tied")
    draft = perturbed(target, tmp_path / "draft", 0.2)
    with LLM(str(target), enforce_eager=True) as llm:
        want = llm.generate(texts, params, use_tqdm=False)
    with LLM(str(target), enforce_eager=True, speculative_config=draft_config(draft)) as llm:
        got = [llm.generate([t], params, use_tqdm=False)[0] for t in texts]
        assert_drafts_held_and_missed(llm, missed=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert re.fullmatch(pattern, g.outputs[0].text), g.outputs[0].text


def test_tensor_parallel_target_with_a_draft_model_on_rank_0(tiny_model, drafts):
    """TP 2: the draft model runs whole on rank 0, the target's ranks verify together."""
    path = str(tiny_model(MODEL))
    knobs: dict[str, Any] = {"quantization": "int4", "tensor_parallel_size": 2}
    with LLM(path, enforce_eager=True, **knobs) as llm:
        want = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
    spec = draft_config(drafts["perturbed"])
    with LLM(path, enforce_eager=True, speculative_config=spec, **knobs) as llm:
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()] == want
        assert_drafts_held_and_missed(llm)


# --- sampled: the plain distribution ------------------------------------------------------------


def test_sampled_tokens_come_from_the_plain_distribution(tiny_model, drafts):
    """One prompt sampled 1,500 times each way (temperature 1, top-k 6), the perturbed draft
    proposing its greedy guesses: the 2nd, 3rd and 4th tokens' distributions pass a
    chi-square test of sameness."""
    path = str(tiny_model(MODEL))
    prompt = prompts()[1]
    n = 1500
    knobs: dict[str, Any] = {"quantization": "int4", "max_num_seqs": 256}

    def params(first: int) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=first + i)
            for i in range(n)
        ]

    with LLM(path, enforce_eager=True, **knobs) as llm:
        plain_out = tokens(llm.generate([prompt] * n, params(0), use_tqdm=False))
    spec = draft_config(drafts["perturbed"], k=3)
    with LLM(path, enforce_eager=True, speculative_config=spec, **knobs) as llm:
        spec_out = tokens(llm.generate([prompt] * n, params(n), use_tqdm=False))
        assert_drafts_held_and_missed(llm)
    assert_same_distribution(plain_out, spec_out)


@pytest.mark.slow
def test_the_default_model_drafted_by_its_own_file():
    """SmolLM2 in bf16 (the GGUF dequantized) drafted by the same GGUF's Q4_1 records (the
    draft's own native step): the plain tokens, most drafts kept, every draft page back."""
    from pypto_serving.bench.datasets import chat_prompts

    params = SamplingParams(temperature=0, max_tokens=48)
    # eager: a bf16 SmolLM2 compiled in this worker would leave dynamo's caches holding
    # graphs test_compile.py counts on compiling itself
    with LLM("default", quantization="none", enforce_eager=True) as llm:
        ps = chat_prompts(llm.tokenizer, "echo")[:1] + chat_prompts(llm.tokenizer, "open")[:1]
        want = tokens(llm.generate(ps, params, use_tqdm=False))
    spec = {"model": "default", "num_speculative_tokens": 4}  # its file's records
    with LLM("default", quantization="none", enforce_eager=True, speculative_config=spec) as llm:
        draft = llm.engine.draft_model
        assert draft is not None and draft.executor.native is not None
        got = [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in ps]
        stats = llm.engine.stats().spec_decode
        assert draft.executor.kv.usage() == 0.0
    assert got == want
    assert stats is not None and stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
