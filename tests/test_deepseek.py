"""DeepSeek-V2/V3 (MLA, YaRN with DeepSeek's mscale, dense first layers, routed experts chosen
by groups, shared experts) against HF transformers on tiny random checkpoints: prompt logits
within 1e-4 in fp32, and greedy tokens equal to HF `generate` through the reference executor,
the paged one, `pypto generate`, `pypto serve` (in-process and as its own process), tensor
plus expert parallelism, and pipeline parallelism."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from checkpoints import TINY_DEEPSEEK, hf_expected, hf_greedy, hf_model, token_ids
from live_server import assert_served_as_offline, free_port, tiny_llm
from patience import patience, wait_for

from pypto_serving import LLM, SamplingParams
from pypto_serving.cli import main
from pypto_serving.errors import ModelLoadError
from pypto_serving.models.config import load_model_config
from pypto_serving.models.deepseek import DeepseekForCausalLM
from pypto_serving.models.loader import load_model
from pypto_serving.ops.attention import DenseKV
from pypto_serving.ops.moe import route_grouped

NAMES = sorted(TINY_DEEPSEEK)
PROMPTS = [[5, 17, 33, 90, 12], [200, 3, 4], list(range(40, 90)), [7] * 9 + [250, 251]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model):
    """HF's greedy 32 tokens for each PROMPTS, per checkpoint."""
    return hf_expected(tiny_model, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_match_hf(tiny_model, name):
    path = tiny_model(name)
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert isinstance(ours, DeepseekForCausalLM)
    ids = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        want = hf_model(path)(ids[None]).logits[0]
        kv = DenseKV(ours.cfg.num_layers)  # in two chunks: the second attends to the cache
        hidden = [ours(ids[:30], torch.arange(30), kv), ours(ids[30:], torch.arange(30, 50), kv)]
        got = ours.logits(torch.cat(hidden))
    assert (got - want).abs().max().item() < 1e-4
    (entries,) = kv.layers[0]  # one latent entry a token
    assert entries.shape == (50, ours.cfg.kv_lora_rank + ours.cfg.qk_rope_head_dim)


@pytest.mark.parametrize("name", NAMES)
def test_reference_greedy_matches_hf_generate(tiny_model, expected, name):
    llm = LLM(str(tiny_model(name)), executor="reference", dtype="float32")
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)


@pytest.mark.parametrize("name", NAMES)
def test_paged_greedy_matches_hf_generate(tiny_model, expected, name):
    # pages of 16, chunks of 24 tokens: prefill continues over cached pages; one model
    # compiled (the serving path), the others eager (seconds, not a compile each)
    compiled = name == "deepseekv3-qlora-yarn"
    knobs = {"page_size": 16, "max_num_batched_tokens": 24, "long_prefill_token_threshold": 24}
    llm = LLM(str(tiny_model(name)), dtype="float32", enforce_eager=not compiled, **knobs)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)
    assert llm.engine.executor.num_recompilations == 0


@pytest.mark.parametrize("name", NAMES)
def test_pypto_generate_matches_hf(tiny_model, tmp_path, capsys, name):
    from transformers import AutoTokenizer

    path = tiny_model(name)
    texts = ["hello world", "the quick brown fox", "what is the capital", "paris is"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = hf_model(path)
    want = [hf_greedy(hf, tokenizer.encode(t), 32) for t in texts]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(path), "--prompts-file", str(prompts)]
    argv += ["--output", str(out), "--max-tokens", "32", "--temperature", "0"]
    if name != "deepseekv3-qlora-yarn":  # one shape compiled, the others eager
        argv.append("--enforce-eager")
    assert main([*argv, "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == want  # no EOS among them: 32 tokens each
    assert all(r["finish_reason"] == "length" for r in rows)


@pytest.mark.parametrize("name", NAMES)
def test_pypto_serve_matches_hf(tiny_model, expected, name):
    with tiny_llm(tiny_model(name)) as llm:
        # offline first: once served, the server's loop steps the same engine
        offline = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(offline) == expected(name)
        assert_served_as_offline(llm, PROMPTS, offline, 32)


def serving_at(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_the_pypto_serve_process_matches_hf(tiny_model, expected):
    """`pypto serve` as users start it (a process of its own, the paged executor), asked
    over HTTP for each prompt's 32 greedy tokens: the text of an offline run whose tokens are
    HF's. One checkpoint, the one with most parts (q-LoRA, YaRN): every variant is served
    in-process by `test_pypto_serve_matches_hf` and run by the CLI in
    `test_pypto_generate_matches_hf`; the process adds only the way it is started."""
    name = "deepseekv3-qlora-yarn"
    offline = LLM(str(tiny_model(name)), dtype="float32", enforce_eager=True, page_size=16)
    outputs = offline.generate(PROMPTS, GREEDY, use_tqdm=False)
    offline.close()
    assert token_ids(outputs) == expected(name)
    port = free_port()
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(tiny_model(name))]
    argv += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--page-size", "16"]
    argv += ["--served-model-name", "tiny"]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: serving_at(url) or process.poll() is not None, 120, "the server started")
        assert process.poll() is None, process.communicate()[1][-2000:]
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0}
            body |= {"ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=patience(120))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 32
            assert r.json()["choices"][0]["text"] == out.outputs[0].text
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_tp2_expert_parallel_matches_hf(tiny_model, expected):
    name = "deepseekv3-qlora-yarn"
    with tiny_llm(tiny_model(name), tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        moe = llm.engine.model.model.layers[1].mlp
        assert moe.held == [0, 1, 2, 3]  # rank 0's half of the 8 experts
        assert llm.engine.model.cfg.num_heads == 2  # and of the 4 heads
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)


def test_pp2_matches_hf(tiny_model, expected):
    name = "deepseekv3-yarn-2dense"  # 4 layers: stage 0 the dense two, stage 1 the MoE two
    with tiny_llm(tiny_model(name), pipeline_parallel_size=2) as llm:
        assert list(llm.engine.model.model.local) == [0, 1]
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(name)


def test_config_reads_mla_and_routing(tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model("deepseekv3-qlora-yarn")
    cfg = load_model_config(path)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank) == (32, 8, 24)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim) == (16, 16, 24)
    assert (cfg.router, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (
        "noaux_tc",
        4,
        2,
        2,
    )
    assert cfg.moe_layers == (1, 2) and cfg.shared_intermediate_size == 32
    assert cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob and cfg.rope_interleave
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    attn = hf.model.layers[0].self_attn
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)  # YaRN's mscale²
    assert cfg.softmax_scale != pytest.approx(24**-0.5)
    assert cfg.rope_scaling == pytest.approx(hf.model.rotary_emb.attention_scaling)
    dense = load_model_config(tiny_model("llama-gqa4-tied"))
    assert (dense.kv_lora_rank, dense.qk_rope_head_dim) == (0, 0)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("deepseekv3-qlora-yarn", {"scoring_func": "softmax"}, "scoring_func"),
        ("deepseekv3-qlora-yarn", {"topk_method": "greedy"}, "topk_method"),
        ("deepseekv3-qlora-yarn", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("deepseekv3-qlora-yarn", {"quantization_config": {"quant_method": "fp8"}}, "quantiz"),
        ("deepseekv3-qlora-yarn", {"n_group": 3}, "groups"),
        ("deepseekv2-group-limited", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseekv2-group-limited", {"norm_topk_prob": True}, "norm_topk_prob"),
    ],
)
def test_unsupported_variants_are_refused(tiny_model, tmp_path, name, change, message):
    path = tmp_path / name
    shutil.copytree(tiny_model(name), path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(path)


def test_multi_token_prediction_layers_are_skipped(tiny_model, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "mtp"
    shutil.copytree(tiny_model("deepseekv3-noqlora-bias"), path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(4, 4)}, path / "mtp.safetensors")
    load_model(path, torch.float32, torch.device("cpu"))  # layer 2 (the MTP one) is skipped
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(4, 4)}, path / "mtp.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_grouped_routing_matches_hf_router(version):
    """route_grouped against HF's routers on many tokens (ids as sets; weights per id)."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    common = dict(hidden_size=16, num_attention_heads=4, n_routed_experts=16, n_group=4)
    common |= dict(num_experts_per_tok=3, topk_group=2, routed_scaling_factor=1.7)
    torch.manual_seed(0)
    if version == "v3":
        router = DeepseekV3TopkRouter(DeepseekV3Config(**common, norm_topk_prob=True))
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
        method, bias, normalize = "noaux_tc", router.e_score_correction_bias, True
    else:
        config = DeepseekV2Config(**common, topk_method="group_limited_greedy")
        router = DeepseekV2TopkRouter(config)
        method, bias, normalize = "group_limited_greedy", None, False
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16))
        x = torch.randn(200, 16)
        logits, want_w, want_ids = router(x)
    ids, weights = route_grouped(logits, bias, 3, method, (4, 2), normalize, 1.7)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))
