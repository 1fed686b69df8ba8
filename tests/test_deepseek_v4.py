"""DeepSeek-V4 (sliding window + compressed caches with a lightning indexer, shared-KV MQA with
sinks, the grouped output projection, hyper-connections, hash-routed and scored experts)
against HF transformers on tiny random checkpoints: prompt logits within 1e-4 in fp32 (whole
and in chunks that split compressor windows), and 32 greedy tokens equal to HF `generate` on
four prompts longer than the window and than several compressor windows, through the
reference executor, the paged executor (its KV: tests/test_deepseek_v4_kv.py), `pypto
generate` and `pypto serve`."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from checkpoints import TINY_DEEPSEEK_V4, hf_expected, hf_greedy, hf_model, token_ids
from live_server import assert_served_as_offline, tiny_llm
from parallel_checks import MOE_PARALLEL

from pypto_serving import LLM, SamplingParams
from pypto_serving.cli import main
from pypto_serving.errors import ModelLoadError
from pypto_serving.kv.kinds.compressed import pool_each_window, pool_windows
from pypto_serving.models.config import load_model_config
from pypto_serving.models.deepseek_v4 import Compressor, DeepseekV4ForCausalLM
from pypto_serving.models.loader import load_model
from pypto_serving.ops.attention import DenseKV

NAMES = sorted(TINY_DEEPSEEK_V4)
PROMPTS = [list(range(40, 90)), [5, 17, 33, 90, 12] * 4, [7] * 9 + [250, 251] * 4, [200, 3] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model):
    """HF's greedy 32 tokens for each PROMPTS, per checkpoint."""
    return hf_expected(tiny_model, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_match_hf(tiny_model, name):
    path = tiny_model(name)
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert isinstance(ours, DeepseekV4ForCausalLM)
    ids = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        want = hf_model(path)(ids[None]).logits[0]
        whole = ours.logits(ours(ids, torch.arange(50), DenseKV(ours.cfg.num_layers)))
        kv = DenseKV(ours.cfg.num_layers)  # chunks that end inside compressor windows
        bounds = [0, 13, 14, 31, 50]
        hidden = [ours(ids[a:b], torch.arange(a, b), kv) for a, b in itertools.pairwise(bounds)]
        chunked = ours.logits(torch.cat(hidden))
    assert (whole - want).abs().max().item() < 1e-4
    assert (chunked - want).abs().max().item() < 1e-4


def test_every_cache_changes_the_logits(tiny_model):
    """The checkpoint exercises what the test compares: reading more entries through the
    indexer, or none of the compressed ones, changes the logits (the window alone is not
    the whole answer)."""
    path = tiny_model("deepseekv4-swa-csa-hca-hash")
    ours = load_model(path, torch.float32, torch.device("cpu"))
    ids, positions = torch.tensor(PROMPTS[0]), torch.arange(50)

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return ours.logits(ours(ids, positions, DenseKV(ours.cfg.num_layers)))

    base = logits()
    csa, hca = ours.model.layers[1].attn, ours.model.layers[2].attn
    assert csa.indexer is not None and hca.compressor is not None and hca.indexer is None
    csa.indexer.topk = 100  # every entry instead of the top 2
    assert (logits() - base).abs().max().item() > 1e-3
    csa.indexer.topk = 2
    hca.ratio = hca.compressor.ratio = 1000  # no HCA entries at all
    assert (logits() - base).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_reference_greedy_matches_hf_generate(tiny_model, expected, name):
    # chunks of 12 tokens: prefill continues over the window and half-filled windows
    knobs = {"max_num_batched_tokens": 12, "long_prefill_token_threshold": 12}
    llm = LLM(str(tiny_model(name)), executor="reference", dtype="float32", **knobs)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)


COMPILED = "deepseekv4-swa-csa-hca-hash"  # every kind of layer: window-only, CSA, HCA, hashed


@pytest.mark.parametrize("name", NAMES)
def test_paged_greedy_matches_hf_generate(tiny_model, expected, name):
    """Compiled for the model with every kind of layer (each kind its own graph; the
    attention an opaque op in it), eagerly for the others (a cold compile of a V4 layer graph
    costs ~20 s here)."""
    # pages of 6 (ending inside compressor windows), chunks of 12 tokens
    knobs = {"page_size": 6, "max_num_batched_tokens": 12, "long_prefill_token_threshold": 12}
    eager = name != COMPILED
    llm = LLM(str(tiny_model(name)), dtype="float32", enforce_eager=eager, **knobs)
    assert llm.engine.attention.compiled is not eager
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)
    assert llm.engine.executor.num_recompilations == 0
    if not eager:  # one graph per kind of layer, each ahead of time and captured
        run_layer = llm.engine.executor.run_layer
        assert len(run_layer.graphs) == 3 and not run_layer._through_dynamo


@pytest.mark.slow
@pytest.mark.parametrize("parallel", list(MOE_PARALLEL))
def test_tp_and_pp_greedy_match_hf_generate(tiny_model, expected, parallel):
    """TP: each rank its heads, sinks and output groups (one all-reduce after `wo_b`), the
    KV head, compressors and indexers whole on each, the experts over EP; PP: the residual
    streams [T, hc_mult, hidden] go from stage to stage, the last collapses them. The
    four-layer checkpoint splits 2 + 2 (a CSA and a window-only layer on the first stage).
    TP=2 runs compiled (0 recompilations), the others eagerly."""
    name = "deepseekv4-csa2-window5-2hash" if "pp" in parallel else COMPILED
    knobs = {"page_size": 6, "max_num_batched_tokens": 12, "long_prefill_token_threshold": 12}
    eager = parallel != "tp2"
    with tiny_llm(tiny_model(name), enforce_eager=eager, **knobs, **MOE_PARALLEL[parallel]) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)
        assert llm.engine.executor.num_recompilations == 0


def test_a_tp_share_splits_heads_and_output_groups_and_keeps_the_kv_head(tiny_model):
    """TP=2 of 4 heads and 2 output groups: 2 heads and 1 group a rank, the one KV head
    whole; TP=4 cannot split 2 output groups, and says so before any process starts."""
    cfg = load_model_config(tiny_model(COMPILED))
    share = cfg.parallel_shard(2, 1, True)
    assert share.compressed is not None
    assert (share.num_heads, share.num_kv_heads, share.compressed.o_groups) == (2, 1, 1)
    with pytest.raises(ModelLoadError, match=r"does not divide the model's output projection's"):
        cfg.parallel_shard(4, 1, True)


@pytest.mark.parametrize("name", NAMES)
def test_pypto_generate_matches_hf(tiny_model, tmp_path, name):
    from transformers import AutoTokenizer

    path = tiny_model(name)
    texts = ["hello world " * 4, "the quick brown fox " * 3, "what is the capital of france"]
    texts.append("paris is " * 6)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = hf_model(path)
    want = [hf_greedy(hf, tokenizer.encode(t), 32) for t in texts]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(path), "--prompts-file", str(prompts)]
    argv += ["--output", str(out), "--max-tokens", "32", "--temperature", "0"]
    argv += [] if name == COMPILED else ["--enforce-eager"]  # as the paged test: one compiles
    assert main([*argv, "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == want


@pytest.mark.parametrize("name", NAMES)
def test_pypto_serve_matches_hf(tiny_model, expected, name):
    with tiny_llm(tiny_model(name)) as llm:
        # offline first: once served, the server's loop steps the same engine
        offline = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(offline) == expected(name)
        assert_served_as_offline(llm, PROMPTS, offline, 32)


def test_config_reads_compressed_attention(tiny_model):
    cfg = load_model_config(tiny_model("deepseekv4-hca-csa-yarn-nohash"))
    v4 = cfg.compressed
    assert v4 is not None
    assert v4.compress_ratios == (16, 4, 4) and v4.indexed == (False, True, True)
    assert (v4.sliding_window, v4.index_topk, v4.hc_mult, v4.scoring_func) == (6, 3, 3, "sigmoid")
    assert v4.hash_layers == () and cfg.num_kv_heads == 1 and cfg.qk_rope_head_dim == 8
    assert v4.compress_inv_freq != v4.main_inv_freq  # YaRN's frequencies on the compressed


@pytest.mark.parametrize("overlap", [False, True])
def test_pooling_a_window_at_a_time_equals_pooling_all(overlap):
    """What a paged cache does (pool the windows as they complete, the previous window's rows
    leading with overlap; the native decodes' batch of one window each, window 0's "window
    before" ignored) gives the entries of pooling the whole sequence at once."""
    torch.manual_seed(0)
    comp = Compressor(hidden=16, dim=8, ratio=4, overlap=overlap, eps=1e-6)
    with torch.no_grad():
        comp.ape.normal_()
        comp.norm.weight.normal_()
    comp.inv_freq = 1.0 / (1e4 ** (torch.arange(0, 4, 2).float() / 4))
    kv, gate = torch.randn(24, comp.ape.shape[1]), torch.randn(24, comp.ape.shape[1])
    with torch.no_grad():
        whole = pool_windows(comp.pooling, kv, gate, 0)
        for w in range(1, 6):
            lead = 4 if overlap else 0
            rows = slice(4 * w - lead, 4 * (w + 1))
            one = pool_windows(comp.pooling, kv[rows], gate[rows], w)
            assert torch.allclose(one, whole[w : w + 1], atol=1e-6), w
        span = 8 if overlap else 4  # each decode's rows: its window (and the one before)
        windows = torch.tensor([0, 3, 1, 5])
        starts = [max(4 * (w + 1) - span, 0) for w in windows.tolist()]
        noise = torch.randn(span, kv.shape[1]) * 100  # window 0's "window before": ignored
        each = [
            torch.cat([noise[: span - 4], kv[:4]]) if w == 0 else kv[s : s + span]
            for w, s in zip(windows.tolist(), starts, strict=True)
        ]
        gates = [
            torch.cat([noise[: span - 4], gate[:4]]) if w == 0 else gate[s : s + span]
            for w, s in zip(windows.tolist(), starts, strict=True)
        ]
        batch = pool_each_window(comp.pooling, torch.stack(each), torch.stack(gates), windows)
        assert torch.allclose(batch, whole[windows], atol=1e-6)
