"""Speculative decoding by DeepSeek-V3's multi-token prediction layer (`"method": "mtp"`):
every draft is the MTP layer's own guess as HF transformers computes it (the target's final
hidden states, the next token's embedding, the layer over its own entries, its shared head),
through prefill chunks, decodes, verified drafts and a prefix hit (the layer's entries cached
in the target's pages); greedy tokens are the plain ones; a layer that guesses right has its
drafts kept (each kept draft's position caught up on with the sample after it); sampled
tokens come from the plain distribution; what cannot run is named."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import BASE, MTP_SOURCE, build_mtp_checkpoint, build_tokenizer
from safetensors.torch import load_file, save_file
from test_speculative import (
    GREEDY,
    assert_same_distribution,
    prompts,
    tokens,
)

from pypto_serving import LLM, SamplingParams
from pypto_serving.config import EngineConfig, parse_speculative_config
from pypto_serving.errors import PyptoError
from pypto_serving.executor.mtp import MTPDrafter

MTP = {"method": "mtp", "num_speculative_tokens": 1}
KNOBS: dict[str, Any] = {"dtype": "float32"}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mtp")
    build_mtp_checkpoint(out)
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def bigram_model(mtp_model, tmp_path_factory) -> Path:
    """The checkpoint with every block's output zeroed (attention's o_proj, the MLPs' and
    experts' down projections): the target's next token depends on its last token alone, and
    an MTP layer passing the next token's normed embedding through (eh_proj [I, 0]) to the
    target's final norm and head guesses the token after it exactly."""
    out = tmp_path_factory.mktemp("bigram")
    for f in mtp_model.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(w)
    size = BASE["hidden_size"]
    weights["model.layers.3.eh_proj.weight"] = torch.cat(
        [torch.eye(size), torch.zeros(size, size)], dim=1
    )
    weights["model.layers.3.enorm.weight"] = torch.ones(size)
    weights["model.layers.3.shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def reference_drafter(path: Path):
    """guess(tokens, k=1): the MTP layer's k guesses of the tokens after `tokens` (the newest
    not yet computed by the target) as HF transformers computes them: the target's final
    hidden states over tokens[:-1], the embeddings of tokens[1:] (zero at position 0), enorm
    and hnorm, eh_proj, then the layer and its shared head as a one-layer DeepSeek-V3; each
    further guess the same one position on, with the layer's own output (before the shared
    head's norm) where the target's hidden state would be, and the last guess's embedding
    (vLLM's chaining of one MTP layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = load_file(path / "model.safetensors")
    layer = "model.layers.3."
    family, overrides = MTP_SOURCE
    config = AutoConfig.for_model(
        family, **{**BASE, **overrides, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    )
    own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    state = {
        "model.layers.0." + k[len(layer) :]: v
        for k, v in weights.items()
        if k.startswith(layer) and not k[len(layer) :].startswith(own)
    }
    state["model.norm.weight"] = weights[layer + "shared_head.norm.weight"]
    state["lm_head.weight"] = weights[layer + "shared_head.head.weight"]
    state["model.embed_tokens.weight"] = weights[layer + "embed_tokens.weight"]
    with tempfile.TemporaryDirectory() as tmp:  # HF reads its own checkpoint layout
        config.save_pretrained(tmp)
        save_file(state, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        block = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    eps = config.rms_norm_eps

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    outputs: list[torch.Tensor] = []  # the layer's output (before the final norm)
    block.model.layers[0].register_forward_hook(
        lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )

    @torch.no_grad()
    def guess(seq: list[int], k: int = 1) -> list[int] | int:
        ids = torch.tensor([seq])
        hidden = target.model(ids[:, :-1]).last_hidden_state[0]
        embedded = weights[layer + "embed_tokens.weight"][ids[0, 1:]].clone()
        embedded[0] = 0  # position 0
        guesses: list[int] = []
        for _ in range(k):
            x = (
                torch.cat(
                    [
                        norm(embedded, weights[layer + "enorm.weight"]),
                        norm(hidden, weights[layer + "hnorm.weight"]),
                    ],
                    dim=-1,
                )
                @ weights[layer + "eh_proj.weight"].T
            )
            positions = torch.arange(len(x))[None]
            outputs.clear()
            logits = block(inputs_embeds=x[None], position_ids=positions).logits[0, -1]
            guesses.append(int(logits.argmax()))
            own = outputs[-1].reshape(len(x), -1)[-1]
            hidden = torch.cat([hidden, own[None]])
            embedded = torch.cat(
                [embedded, weights[layer + "embed_tokens.weight"][guesses[-1]][None]]
            )
        return guesses if k > 1 else guesses[0]

    return guess


def recording(llm: LLM, chains: bool = False) -> list[tuple[list[int], Any]]:
    """Every draft the engine's MTP drafter hands the scheduler, with the request's tokens
    (chains: each request's whole list of guesses, else its first)."""
    drafter = llm.engine.speculator.proposer
    assert isinstance(drafter, MTPDrafter)
    seen: list[tuple[list[int], Any]] = []
    propose = drafter.propose

    def record(wanted):
        out = propose(wanted)
        seen.extend(
            (list(r.token_ids), out[r.request_id] if chains else out[r.request_id][0])
            for r, _ in wanted
            if out.get(r.request_id)
        )
        return out

    drafter.propose = record  # type: ignore[method-assign]
    return seen


# --- the config -----------------------------------------------------------------------------


def test_the_config_reads_mtp():
    for method in ("mtp", "deepseek_mtp"):
        spec = parse_speculative_config({"method": method, "num_speculative_tokens": 1})
        assert spec is not None and spec.method == "mtp"


@pytest.mark.parametrize(
    "raw, says",
    [
        ({"method": "mtp", "num_speculative_tokens": 1, "model": "/d"}, "model not understood"),
    ],
)
def test_a_bad_mtp_config_is_named(raw: dict, says: str):
    with pytest.raises(PyptoError, match=says) as e:
        EngineConfig(speculative_config=raw).validate()
    assert e.value.param == "speculative_config"


def test_mtp_needs_a_layer(tiny_model):
    with pytest.raises(PyptoError, match="no multi-token prediction layer") as e:
        LLM(str(tiny_model("deepseekv3-qlora-yarn")), enforce_eager=True, speculative_config=MTP)
    assert e.value.param == "speculative_config"
    with pytest.raises(PyptoError, match="has no multi-token prediction layer served"):
        LLM(str(tiny_model("llama-gqa4-tied")), enforce_eager=True, speculative_config=MTP)


# --- the drafts: HF's MTP layer -------------------------------------------------------------


def test_every_draft_is_the_mtp_layers_own_guess(mtp_model):
    """A batch (prefill chunks of 16 tokens, decodes, verified drafts), then each prompt again
    (its prompt a prefix hit: the layer's entries come back with the pages): each draft the
    scheduler got is HF's MTP guess after the request's tokens; the tokens are the plain
    ones."""
    guess = reference_drafter(mtp_model)
    knobs = {
        **KNOBS,
        "page_size": 8,
        "max_num_batched_tokens": 16,
        "long_prefill_token_threshold": 16,
    }
    ps = prompts()
    with LLM(str(mtp_model), enforce_eager=True, **knobs) as llm:
        want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    with LLM(str(mtp_model), enforce_eager=True, speculative_config=MTP, **knobs) as llm:
        seen = recording(llm)
        assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == want
        batched = len(seen)
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps] == want
        assert llm.engine.stats().prefix_hits > 0
        assert llm.engine.executor.kv.usage() == 0.0
    assert batched > 100 and len(seen) > batched + 100
    wrong = [(seq, d, guess(seq)) for seq, d in seen if guess(seq) != d]
    assert not wrong, wrong[:3]


def test_under_tensor_parallelism_rank_0_drafts_with_the_whole_layer(mtp_model):
    """TP 2 (experts split over the ranks): rank 0 loads the MTP layer whole and drafts
    alone, its entries in rank 0's pages of the layer after the target's; every draft is
    still HF's guess and the tokens are the plain TP 1 ones, prefix hits included."""
    guess = reference_drafter(mtp_model)
    ps = prompts()
    with LLM(str(mtp_model), enforce_eager=True, **KNOBS) as llm:
        want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    with LLM(
        str(mtp_model), enforce_eager=True, speculative_config=MTP, **KNOBS, **parallel
    ) as llm:
        seen = recording(llm)
        assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == want
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps] == want
        assert llm.engine.stats().prefix_hits > 0
    assert len(seen) > 100
    wrong = [(seq, d, guess(seq)) for seq, d in seen if guess(seq) != d]
    assert not wrong, wrong[:3]


def test_chained_guesses_are_the_layers_own_guesses_on_its_own_output(mtp_model):
    """num_speculative_tokens 3: the one layer guesses on from its own output, every chain the
    scheduler got is HF's (as long as the scheduler asked, or shorter where the request's
    last page ends), through a batch, a prefix hit and rejected guesses; the tokens are the
    plain ones, every page back."""
    guess = reference_drafter(mtp_model)
    knobs = {**KNOBS, "page_size": 16}
    ps = prompts()
    with LLM(str(mtp_model), enforce_eager=True, **knobs) as llm:
        want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    chained = {"method": "mtp", "num_speculative_tokens": 3}
    with LLM(str(mtp_model), enforce_eager=True, speculative_config=chained, **knobs) as llm:
        seen = recording(llm, chains=True)
        assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == want
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps] == want
        assert llm.engine.stats().prefix_hits > 0
        assert llm.engine.executor.kv.usage() == 0.0
    assert len(seen) > 100  # k adapts to the (random) layer's few kept guesses: some 3
    assert sum(len(d) == 3 for _, d in seen) >= 10
    wrong = [(seq, d) for seq, d in seen if guess(seq, 3)[: len(d)] != d]
    assert not wrong, wrong[:3]


def test_under_pipeline_parallelism_the_last_stage_hands_rank_0_its_hidden_states(mtp_model):
    """PP 2: the last stage sends every row's final hidden states to rank 0 beside the
    logits, and rank 0 drafts with the whole layer, its entries in the KV layer after its
    stage's; every draft (chains of two) is HF's, the tokens the plain PP 1 ones, prefix hits
    included."""
    guess = reference_drafter(mtp_model)
    ps = prompts()
    with LLM(str(mtp_model), enforce_eager=True, **KNOBS) as llm:
        want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    chained = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(
        str(mtp_model),
        enforce_eager=True,
        speculative_config=chained,
        pipeline_parallel_size=2,
        **KNOBS,
    ) as llm:
        seen = recording(llm, chains=True)
        assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == want
        assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps] == want
        assert llm.engine.stats().prefix_hits > 0
    assert len(seen) > 100 and any(len(d) == 2 for _, d in seen)
    wrong = [(seq, d) for seq, d in seen if guess(seq, 2)[: len(d)] != d]
    assert not wrong, wrong[:3]


def test_a_layer_that_guesses_right_has_its_drafts_kept(bigram_model):
    """The bigram construction: every draft is kept (so every step catches up on two
    positions: the last token's and the kept draft's, each with the sample after it); the
    tokens are the plain ones, in half the steps."""
    with LLM(str(bigram_model), enforce_eager=True, **KNOBS) as llm:
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    with LLM(str(bigram_model), enforce_eager=True, speculative_config=MTP, **KNOBS) as llm:
        got = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
        spec = llm.engine.stats().spec_decode
    assert got == want
    assert spec is not None and spec.num_draft_tokens > 100
    assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_a_chain_that_guesses_right_is_kept_whole(bigram_model):
    """The bigram construction reads only the next token's embedding, so each chained guess
    is the target's next token too: with k 3 every draft is kept, four tokens a step where a
    chain runs whole."""
    with LLM(str(bigram_model), enforce_eager=True, **KNOBS) as llm:
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    chained = {"method": "mtp", "num_speculative_tokens": 3}
    with LLM(str(bigram_model), enforce_eager=True, speculative_config=chained, **KNOBS) as llm:
        got = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()]
        spec = llm.engine.stats().spec_decode
    assert got == want
    assert spec is not None and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.num_draft_tokens > 2.5 * spec.num_drafts > 100


def test_a_grammars_outputs_are_the_plain_ones(bigram_model):
    """A structured output: the layer's guesses end where the grammar would refuse them (a
    guess it refuses is no draft), the kept ones advance the grammar: the plain constrained
    tokens."""
    import re

    from pypto_serving.sampling import StructuredOutputsParams

    pattern = "[a-z ]{4,40}\\."
    params = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    texts = ["the cat", "a dog", "on the mat"]
    with LLM(str(bigram_model), enforce_eager=True, **KNOBS) as llm:
        want = llm.generate(texts, params, use_tqdm=False)
    with LLM(str(bigram_model), enforce_eager=True, speculative_config=MTP, **KNOBS) as llm:
        got = [llm.generate([t], params, use_tqdm=False)[0] for t in texts]
        spec = llm.engine.stats().spec_decode
    assert spec is not None and spec.num_accepted_tokens > 0
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert re.fullmatch(pattern, g.outputs[0].text), g.outputs[0].text


def test_compiled_steps_verify_without_recompiling(mtp_model):
    """The compiled graphs (the target's layers): a verified draft's rows are decode rows of
    a shape warm-up compiled, so serving with the layer drafting recompiles nothing."""
    with LLM(str(mtp_model), **KNOBS) as llm:
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    with LLM(str(mtp_model), speculative_config=MTP, **KNOBS) as llm:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
        stats = llm.engine.stats()
        assert stats.spec_decode is not None and stats.spec_decode.num_drafts > 100
        assert stats.num_recompilations == 0


def test_preempted_requests_resume_on_the_plain_tokens(mtp_model):
    """A pool of a few pages: requests are preempted and recompute (the layer's entries with
    them) and end on the plain tokens, every page back."""
    knobs = {**KNOBS, "page_size": 16, "num_kv_pages": 14, "kv_cpu_bytes": 0}
    with LLM(str(mtp_model), enforce_eager=True, **KNOBS) as llm:
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    with LLM(str(mtp_model), enforce_eager=True, speculative_config=MTP, **knobs) as llm:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
        assert llm.engine.stats().num_preemptions > 0
        assert llm.engine.executor.kv.usage() == 0.0


def test_sampled_tokens_come_from_the_plain_distribution(bigram_model):
    """One prompt sampled 1,500 times each way (temperature 1, top-k 6), the bigram layer's
    guesses kept about as often as the target draws its argmax: the 2nd, 3rd and 4th tokens'
    distributions pass a chi-square test of sameness."""
    path = str(bigram_model)
    prompt = prompts()[1]
    n = 1500
    knobs = {**KNOBS, "max_num_seqs": 256}

    def params(first: int) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=first + i)
            for i in range(n)
        ]

    with LLM(path, enforce_eager=True, **knobs) as llm:
        plain_out = tokens(llm.generate([prompt] * n, params(0), use_tqdm=False))
    with LLM(path, enforce_eager=True, speculative_config=MTP, **knobs) as llm:
        spec_out = tokens(llm.generate([prompt] * n, params(n), use_tqdm=False))
        spec = llm.engine.stats().spec_decode
        assert spec is not None and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert_same_distribution(plain_out, spec_out)


def test_the_mtp_layers_entries_live_in_the_targets_pages(mtp_model):
    """The KV store holds one layer more than the model (the MTP layer's), and its SSD
    pages are keyed apart from a run without it."""
    with LLM(str(mtp_model), enforce_eager=True, speculative_config=MTP, **KNOBS) as llm:
        spec = llm.engine.executor.kv.pool.cache.spec
        assert (
            spec.num_layers
            == json.loads((mtp_model / "config.json").read_text())["num_hidden_layers"] + 1
        )
