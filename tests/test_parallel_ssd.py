"""The SSD KV tier under tensor and pipeline parallelism: each rank keeps its share in its own
folder (`<kv_ssd_dir>/rank<r>`; MLA's latent once, by rank 0) and mirrors rank 0's stores and
evictions (`kv/mirror.py`). A clean restart serves every cached prefix from SSD with the
single-rank reference executor's greedy tokens; a page file damaged on rank 1 only is a miss
on every rank (SSD loads are agreed before rank 0 counts them), never wrong tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from live_server import tiny_llm
from test_mla_engine import build
from test_parallel_tiers import PARALLEL, greedy, sharp_llama
from test_tiered_engine import GREEDY, PROMPTS

from pypto_serving import LLM
from pypto_serving.kv.disk_tier import SUFFIX
from pypto_serving.kv.page_pool import hash_page


def one_by_one(llm: LLM, prompts: list[list[int]]) -> list:  # type: ignore[type-arg]
    return [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]


def first_run(path: Path, ssd: Path, **parallel: object) -> list[list[int]]:
    """Prompts 0, 1, 2 one by one on six device pages (0's pages go to SSD, 1's and 2's
    stay cached on the device), then a clean shutdown keeps all six pages on SSD; returns
    the reference's tokens."""
    ref = LLM(str(path), executor="reference", dtype="float32")
    expected = greedy(ref, PROMPTS[:3])
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(ssd)}
    with tiny_llm(path, **knobs, **parallel) as llm:
        outs = one_by_one(llm, PROMPTS[:3])
        assert [o.outputs[0].token_ids for o in outs] == expected
    return expected


def restart(path: Path, ssd: Path, **parallel: object) -> list:  # type: ignore[type-arg]
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(ssd)}
    with tiny_llm(path, **knobs, **parallel) as llm:
        store = llm.engine.executor.kv  # rank 0's
        assert store.pool.ssd is not None and store.pool.ssd.dir.parent == ssd / "rank0"
        assert store.pool.ssd.num_found == 6
        return one_by_one(llm, PROMPTS[:3])


def page_files(ssd: Path, rank: int) -> list[Path]:
    return sorted((ssd / f"rank{rank}").glob("*/*" + SUFFIX))


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_gqa_ssd_reload_after_a_restart_under_tp_and_pp(tmp_path: Path, parallel: str) -> None:
    path, ssd = sharp_llama(tmp_path / "llama"), tmp_path / "ssd"
    expected = first_run(path, ssd, **PARALLEL[parallel])
    assert len(page_files(ssd, 0)) == len(page_files(ssd, 1)) == 6  # each rank its share
    outs = restart(path, ssd, **PARALLEL[parallel])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 32}] * 3


def test_mla_ssd_reload_after_a_restart_under_tp2(tmp_path: Path) -> None:
    path, ssd = build(tmp_path / "mla", 16), tmp_path / "ssd"
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    expected = first_run(path, ssd, **parallel)
    assert len(page_files(ssd, 0)) == 6 and not page_files(ssd, 1)  # the latent: rank 0's
    outs = restart(path, ssd, **parallel)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.cached_tokens_by_tier for o in outs] == [{"ssd": 32}] * 3


def test_a_page_damaged_on_rank_1_only_is_a_miss_on_every_rank(tmp_path: Path) -> None:
    """Prompt 0's first page file is damaged on rank 1 only: rank 0 reads its share, rank 1
    cannot, so the agreed load is empty and prompt 0 is recomputed (the reference's tokens);
    prompts 1 and 2 still come from SSD."""
    path, ssd = sharp_llama(tmp_path / "llama"), tmp_path / "ssd"
    expected = first_run(path, ssd, tensor_parallel_size=2)
    first_page = hash_page(None, PROMPTS[0][:16]).hex() + SUFFIX
    (damaged,) = [f for f in page_files(ssd, 1) if f.name == first_page]
    data = damaged.read_bytes()
    damaged.write_bytes(data[:-1] + bytes([data[-1] ^ 0x5A]))  # the keyed digest disagrees
    knobs = {"num_kv_pages": 6, "kv_cpu_bytes": 0, "kv_ssd_dir": str(ssd)}
    with tiny_llm(path, **knobs, tensor_parallel_size=2) as llm:
        outs = one_by_one(llm, PROMPTS[:3])
        rank_0_unreadable = llm.engine.executor.kv.pool.ssd.num_unreadable
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.cached_tokens_by_tier for o in outs] == [{}, {"ssd": 32}, {"ssd": 32}]
    assert rank_0_unreadable == 0  # rank 0 read its copy: the miss came from rank 1's
