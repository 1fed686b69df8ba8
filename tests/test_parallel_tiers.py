"""The CPU KV tier under tensor and pipeline parallelism: rank 0 decides each page move, the
other ranks mirror it on their own share (`kv/mirror.py`). Greedy tokens through a CPU
reload and a swap equal the single-rank reference executor's; MLA's latent (the same on every
TP rank) is kept once, by rank 0. The models' q and k projections are scaled up so that
attention is far from uniform: a page with the wrong KV on any rank changes the tokens (the
tiny llama of test_tiered_engine.py answers the same token whatever its KV).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import BASE, build_tokenizer
from live_server import tiny_llm
from test_mla_engine import build, page_bytes
from test_tiered_engine import GREEDY, PAGE_BYTES, PROMPTS, SHORT

from pypto_serving import LLM
from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.executor.kv_stores import parallel_cpu_tier
from pypto_serving.kv.kinds import gqa, mla

PARALLEL = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


def sharp_llama(out: Path) -> Path:
    """A tiny GQA llama (8 heads, 2 KV heads of dim 8: PAGE_BYTES a page) whose attention
    is sharp enough that its tokens depend on every page's KV."""
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = {"num_attention_heads": 8, "num_key_value_heads": 2}
    config = AutoConfig.for_model("llama", **{**BASE, **heads})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4)
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def reload_and_swap(path: Path, page: int, **parallel: object) -> None:
    """A prefix pushed to the CPU tier and loaded back, then preemptions by swap: the tokens
    of the reference executor, with the counters showing both paths were taken."""
    ref = LLM(str(path), executor="reference", dtype="float32")
    expected, short = greedy(ref, PROMPTS[:3]), greedy(ref, SHORT)
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 64 * page, "kv_ssd_dir": None}
    with tiny_llm(path, **knobs, **parallel) as llm:
        store = llm.engine.executor.kv  # rank 0's: 64 pages of its share (MLA: all of it)
        assert store.pool.cpu is not None and store.pool.cpu.capacity == 64
        if store.pool.cache.spec.kind == "mla":  # the whole latent of its stage's layers:
            stages = int(str(parallel.get("pipeline_parallel_size", 1)))  # the copy is rank 0's
            assert store.pool.page_bytes == page // stages
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS[:3]]
        last = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert [o.outputs[0].token_ids for o in [*outs, last]] == [*expected, expected[0]]
        assert last.cached_tokens_by_tier == {"cpu": 32}
    knobs = {"num_kv_pages": 7, "kv_cpu_bytes": 64 * page, "max_num_seqs": 4}
    with tiny_llm(path, **knobs, **parallel) as llm:
        assert greedy(llm, SHORT) == short
        stats = llm.engine.stats()
        assert (
            stats.num_swapped > 0 and llm.engine.executor.kv.pool.num_swap_ins == stats.num_swapped
        )


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_gqa_cpu_tier_under_tp_and_pp(tmp_path: Path, parallel: str) -> None:
    reload_and_swap(sharp_llama(tmp_path / "llama"), PAGE_BYTES, **PARALLEL[parallel])


@pytest.mark.parametrize("pp", [1, 2])
def test_mla_cpu_tier_under_tp2(tmp_path: Path, pp: int) -> None:
    """Under TP x PP each stage's first TP rank keeps the latent and hands the pages it
    writes to its stage's other TP rank."""
    path = build(tmp_path / "mla", 16)
    knobs = {"tensor_parallel_size": 2, "pipeline_parallel_size": pp}
    reload_and_swap(path, page_bytes("native"), enable_expert_parallel=True, **knobs)


def test_each_rank_keeps_its_share_and_mla_is_kept_once() -> None:
    """kv_cpu_bytes is the engine's budget: each GQA rank holds as many pages of its share;
    MLA's latent lives in rank 0's tier only (one copy, the whole budget)."""
    budget = 1 << 20
    llama = SimpleNamespace(num_kv_heads=2, head_dim=8, num_layers=4)  # one TP rank's share
    deepseek = SimpleNamespace(kv_lora_rank=32, qk_rope_head_dim=16, num_layers=4)
    for tp_rank in (0, 1):
        groups = ParallelGroups(tp=Group(tp_rank, 2))
        spec = gqa.kv_spec(llama, 4, 16, torch.float32)
        model = SimpleNamespace(cfg=llama, groups=groups)
        pages, journal = parallel_cpu_tier(model, spec, budget)  # type: ignore[arg-type]
        assert pages == budget // (2 * spec.page_bytes) and (journal is None) == (tp_rank > 0)
        spec = mla.kv_spec(deepseek, 4, 16, torch.float32)
        model = SimpleNamespace(cfg=deepseek, groups=groups)
        pages, _ = parallel_cpu_tier(model, spec, budget)  # type: ignore[arg-type]
        assert spec.page_bytes == 4 * 16 * (32 + 16) * 4
        assert pages == (budget // spec.page_bytes if tp_rank == 0 else 0)
    stages = ParallelGroups(pp=Group(1, 2))  # a stage holds half the layers: pages of half
    stage, whole = (gqa.kv_spec(llama, n, 16, torch.float32) for n in (2, 4))
    model = SimpleNamespace(cfg=llama, groups=stages)
    pages, _ = parallel_cpu_tier(model, whole, budget)  # type: ignore[arg-type]
    assert pages == budget // (2 * stage.page_bytes)


@pytest.mark.parametrize("kind", ["gqa", "window"])
def test_every_pipeline_stage_counts_the_same_pages(kind: str) -> None:
    """Rank 0 decides page ids for every stage, so each group's device and CPU pages must be
    the same count on every stage whatever its layers: 3 layers over 2 stages (1 and 2) on
    a byte budget that binds. The window kind's stages hold a group without layers (stage 0:
    the full layer only; stage 1: the two windowed ones), sized like the others."""
    from pypto_serving.config import CacheConfig
    from pypto_serving.executor.kv_stores import build_kv_store
    from pypto_serving.kv.kinds import window
    from pypto_serving.models.llama import stage_layers

    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8)
    attention_kind: object = gqa
    if kind == "window":
        cfg = SimpleNamespace(**vars(cfg), window_layers=(1, 2), sliding_window=6)
        attention_kind = window
    cache = CacheConfig(
        page_size=4, num_kv_pages=None, kv_device_bytes=40 << 10, kv_cpu_bytes=64 << 10
    )
    counts = []
    for rank in (0, 1):
        groups = ParallelGroups(pp=Group(rank, 2))
        layers = stage_layers(3, groups.pp)
        model = SimpleNamespace(
            cfg=cfg,
            groups=groups,
            local_layers=layers,
            kv_layers=layers,
            num_local_layers=len(layers),
            attention_kind=attention_kind,
        )
        store = build_kv_store(model, torch.device("cpu"), torch.float32, cache, 1 << 20, "", False)  # type: ignore[arg-type]
        layer_counts = [m.pool.cache.spec.num_layers for m in store.managers]
        cpu = [0 if m.pool.cpu is None else m.pool.cpu.capacity for m in store.managers]
        counts.append(
            [(m.name, m.pool.num_pages, c) for m, c in zip(store.managers, cpu, strict=True)]
        )
        assert sum(layer_counts) == len(layers)
        device = sum(m.pool.num_pages * m.pool.cache.spec.page_bytes for m in store.managers)
        assert device <= cache.kv_device_bytes  # the stage with more layers within it too
        store.close()
    assert counts[0] == counts[1], counts
    assert all(n > 1 and c > 0 for _, n, c in counts[0]), counts
