"""An MLA model (tiny DeepSeek-V3) gives the same greedy tokens whichever way its KV got
there: recomputed, hit on the device, loaded back from the CPU tier or SSD (also after a
restart), swapped out and in, or recomputed after preemption; the oracle is the reference
executor. Two shapes: entries of 40 values (kv_lora_rank 32 + rope 8: PyTorch's attention
path) and of 48 (32 + 16: the native kernels). Pages of 16 tokens; the KV of a page is the
latent size, one tensor.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import BASE, DS_MOE, build_tokenizer
from live_server import tiny_llm

from pypto_serving import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
rng = random.Random(11)
PROMPTS = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]  # 2 full pages + 8
SHORT = [p[:30] for p in PROMPTS]
LAYERS = 2
SHAPES = {"pytorch": 8, "native": 16}
"""qk_rope_head_dim of each shape (kv_lora_rank 32)."""


def entry(shape: str) -> int:
    return 32 + SHAPES[shape]


def build(out: Path, rope: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    mla = dict(num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope)
    config = AutoConfig.for_model(
        "deepseek_v3",
        **{**BASE, **mla, **DS_MOE, "num_hidden_layers": LAYERS},
        q_lora_rank=None,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f"{x}.weight" in name for x in ("q_proj", "kv_a_proj_with_mqa")):
                p.mul_(4)  # attention far from uniform, so a wrong KV shows
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {s: build(tmp_path_factory.mktemp(f"mla-{s}"), rope) for s, rope in SHAPES.items()}


def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), executor="reference", dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(models: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {s: reference(m, PROMPTS) for s, m in models.items()}


def page_bytes(shape: str) -> int:
    return LAYERS * 16 * entry(shape) * 4  # one latent tensor, fp32


def one_by_one(llm: LLM, order: list[int]) -> list[Any]:
    return [llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False)[0] for i in order]


PATHS = {  # six device pages hold two 48-token requests (as in test_tiered_engine.py)
    "recompute": ({"enable_prefix_caching": False}, {}),
    "device": ({"num_kv_pages": 64}, {"device": 32}),
    "cpu": ({"num_kv_pages": 6, "kv_cpu_bytes": 64}, {"cpu": 32}),
    "ssd": ({"num_kv_pages": 6, "kv_cpu_bytes": 0}, {"ssd": 32}),
    "cpu+ssd": ({"num_kv_pages": 6, "kv_cpu_bytes": 1}, {"cpu": 16, "ssd": 16}),
}
"""kv_cpu_bytes in pages here."""


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_greedy_outputs_are_identical_on_every_kv_path(
    models, expected, tmp_path: Path, shape: str, path: str
) -> None:
    knobs, by_tier = PATHS[path]
    if "kv_cpu_bytes" in knobs:
        knobs = knobs | {"kv_cpu_bytes": knobs["kv_cpu_bytes"] * page_bytes(shape)}
    if "ssd" in path:
        knobs = knobs | {"kv_ssd_dir": str(tmp_path)}
    with tiny_llm(models[shape], **knobs) as llm:
        store = llm.engine.executor.kv
        assert store.pool.cache.spec.kind == "mla" and store.pool.page_bytes == page_bytes(shape)
        assert (llm.engine.executor.attention_kernel is not None) == (shape == "native")
        outs = one_by_one(llm, [0, 1, 2])
        if store.pool.ssd is not None:
            store.pool.ssd.flush()
        last = one_by_one(llm, [0])[0]
        assert [o.outputs[0].token_ids for o in [*outs, last]] == [
            *expected[shape],
            expected[shape][0],
        ]
        assert last.cached_tokens_by_tier == by_tier


@pytest.mark.parametrize("cpu_pages", [64, 0], ids=["swap", "recompute"])
def test_mla_preemption_by_swap_or_recompute_gives_identical_outputs(
    models, cpu_pages: int
) -> None:
    knobs = {"num_kv_pages": 7, "kv_cpu_bytes": cpu_pages * page_bytes("native")}
    with tiny_llm(models["native"], max_num_seqs=4, **knobs) as llm:
        outs = llm.generate(SHORT, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(models["native"], SHORT)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and (stats.num_swapped > 0) == bool(cpu_pages)


def test_mla_pages_on_ssd_are_found_after_a_restart(models, expected, tmp_path: Path) -> None:
    knobs = {"num_kv_pages": 64, "kv_cpu_bytes": 0, "kv_ssd_dir": str(tmp_path)}
    with tiny_llm(models["pytorch"], **knobs) as first:
        one_by_one(first, [0, 1])
    with tiny_llm(models["pytorch"], **knobs) as second:
        assert second.engine.executor.kv.pool.ssd.num_found == 4
        outs = one_by_one(second, [0, 1])
        assert [o.outputs[0].token_ids for o in outs] == expected["pytorch"][:2]
        assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 32}] * 2
