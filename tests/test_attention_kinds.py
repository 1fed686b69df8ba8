"""An attention kind is one file (docs/attention_kinds.md): a toy kind, defined in this file
alone, runs on the generic machinery unchanged. Its spec sizes the executor's KV store, its
paged operator writes through the step's slot mapping and attends through `StepAttention`
(called through its own custom op, over the active step), and its outputs equal its dense
oracle's over `DenseKV`, across pages, with decodes and prefill chunks in one step.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from pypto_serving.config import CacheConfig
from pypto_serving.distributed import ParallelGroups
from pypto_serving.executor.kv_stores import build_kv_store
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.paged_attention import (
    PagedKV,
    StepAttention,
    StepBatch,
    active_step,
    current_step,
    paged_step,
)
from pypto_serving.kv.spec import KVGroup, KVSpec
from pypto_serving.ops.attention import DenseKV, KVAttention, causal_attention
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

PAGE, LAYERS, HEADS, D = 4, 2, 3, 8


# --- the toy kind: multi-query attention, one KV head, its K and V pages apart ----------------


def kv_spec(
    cfg: Any, num_layers: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> KVSpec:
    return KVSpec("toy", num_layers, 1, cfg.head_dim, cfg.head_dim, page_size, dtype, num_tensors=2)


def kv_groups(
    cfg: Any, layers: range, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> list[KVGroup]:
    return [KVGroup("toy", kv_spec(cfg, len(layers), page_size, dtype))]


step = paged_step  # one group of full attention: the generic step


def attend(
    kv: KVAttention, layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """q [T, H, D], the new tokens' k, v [T, D] (one head, no head dimension)."""
    if isinstance(kv, DenseKV):
        keys, values = kv.extend(int(layer), k, v)
        return causal_attention(q, keys[:, None], values[:, None])
    return toy_attention(q, k, v, layer)


def paged_attend(
    step: StepAttention, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    keys, values = (t[layer] for t in step.cache.tensors)  # [1, slots, D] each
    keys[0].index_copy_(0, step.slot_mapping, k)
    values[0].index_copy_(0, step.slot_mapping, v)
    return step.attend(q, keys, values)


@torch.library.custom_op("pypto_test::toy_attention", mutates_args=())
def toy_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    return paged_attend(current_step(), int(layer), q, k, v)


@toy_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


# --- the test -----------------------------------------------------------------------------------


def toy_store() -> KVGroups:
    """The executor's KV store for a model whose attention kind is the toy one."""
    toy = SimpleNamespace(kv_groups=kv_groups, step=step)
    model = SimpleNamespace(
        cfg=SimpleNamespace(head_dim=D),
        num_local_layers=LAYERS,
        local_layers=range(LAYERS),
        kv_layers=range(LAYERS),
        groups=ParallelGroups(),
        attention_kind=toy,
    )
    cache = CacheConfig(page_size=PAGE, num_kv_pages=12, kv_cpu_bytes=0)
    cpu = torch.device("cpu")
    return build_kv_store(model, cpu, torch.float32, cache, 0, "", describe=False)  # type: ignore[arg-type]


def run_step(store: KVGroups, plan: list[tuple[Request, int]], dense: dict[str, DenseKV]) -> None:
    """A step as the paged executor runs it (decodes first), each layer's output checked
    against the dense oracle's, sequence by sequence."""
    plan = sorted(plan, key=lambda p: p[1] > 1)
    for r, n in plan:
        assert store.allocate(r, n)
    starts = [r.num_computed_tokens for r, _ in plan]
    q_lens = torch.tensor([n for _, n in plan])
    positions = torch.cat([torch.arange(s, s + n) for s, (_, n) in zip(starts, plan, strict=True)])
    ids = [r.request_id for r, _ in plan]
    batch = StepBatch(
        store.pages(ids),
        positions,
        q_lens,
        torch.tensor(starts) + q_lens,
        sum(n == 1 for _, n in plan),
        int(q_lens.max()),
    )
    attention = step(store, None, batch)
    total = len(positions)
    for layer in range(LAYERS):
        q, k, v = torch.randn(total, HEADS, D), torch.randn(total, D), torch.randn(total, D)
        with active_step(attention):
            got = attend(PagedKV(), torch.tensor(layer), q, k, v)
        first = 0
        for r, n in plan:
            rows = slice(first, first + n)
            want = attend(dense[r.request_id], torch.tensor(layer), q[rows], k[rows], v[rows])
            torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)
            first += n
    assert attention.layers == LAYERS
    for r, n in plan:
        r.num_computed_tokens += n


def test_a_kind_defined_in_one_file_runs_on_the_generic_machinery() -> None:
    torch.manual_seed(0)
    store = toy_store()
    spec = store.pool.cache.spec
    assert spec.kind == "toy" and len(store.pool.cache.tensors) == 2
    assert store.pool.page_bytes == 2 * LAYERS * PAGE * D * 4  # K and V of one head, float32
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    a, b = Request("a", list(range(11)), params), Request("b", list(range(100, 109)), params)
    dense = {"a": DenseKV(LAYERS), "b": DenseKV(LAYERS)}
    for r in (a, b):
        assert store.num_cached_tokens(r) == 0
    run_step(store, [(a, 6)], dense)  # a prefill chunk across two pages
    run_step(store, [(b, 5), (a, 1)], dense)  # a decode beside a prefill chunk
    run_step(store, [(a, 1), (b, 1)], dense)  # decodes
    run_step(store, [(b, 3), (a, 3)], dense)  # two prefill chunks
    assert len(dense["a"]) == 11 and len(dense["b"]) == 9
    assert [len(store.managers[0].pages([r])[0]) for r in "ab"] == [3, 3]
