"""The attention operators own their KV: the MLA kind against a float64 reference, what each
kind's KV costs, MLA pages through the CPU and SSD tiers, and the rule that only the operators
map slots.

The MLA operator (`kv/kinds/mla.py`) is checked on both attention paths (PyTorch's
and the native kernels) over steps that mix decodes and prefill chunks, cross pages and share a
prefix page between two requests: each output equals softmax(q entries^T E**-0.5) @ entries
over the sequence's entries, computed in float64 from what the operator was given.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import one_group

from pypto_serving import native
from pypto_serving.config import CacheConfig
from pypto_serving.distributed import ParallelGroups
from pypto_serving.errors import PyptoError
from pypto_serving.executor.kv_stores import build_kv_store
from pypto_serving.kv.disk_tier import MAGIC, SUFFIX
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.host_tier import HostTier
from pypto_serving.kv.kinds import gqa, mla
from pypto_serving.kv.paged_attention import PagedKV, StepAttention, active_step
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.spec import KVSpec
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

CPU = torch.device("cpu")
PS, HEADS, E, LAYERS = 16, 4, 48, 2  # E = kv_lora_rank 32 + qk_rope_head_dim 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 5e-2}


def mla_store(
    num_pages: int,
    dtype: torch.dtype = torch.float32,
    page_size: int = PS,
    entry: int = E,
    **options: object,
) -> KVGroups:
    spec = KVSpec("mla", LAYERS, 1, entry, entry, page_size, dtype, num_tensors=1)
    return one_group(PagedCache(spec, num_pages, CPU), **options)  # type: ignore[arg-type]


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=64, ignore_eos=True))


# --- the MLA operator against float64 ---------------------------------------------------------


class Reference:
    """Every sequence's entries per layer, in float64, as the operator stored them."""

    def __init__(self) -> None:
        self.entries: dict[str, list[torch.Tensor]] = {}

    def share_prefix(self, to: str, source: str, num_tokens: int) -> None:
        self.entries[to] = [e[:num_tokens] for e in self.entries[source]]

    def attend(self, rid: str, layer: int, q: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """Append `entry` [n, E] to the sequence, attend its last n queries q [n, H, E]."""
        seq = self.entries.setdefault(rid, [torch.empty(0, E, dtype=torch.float64)] * LAYERS)
        seq[layer] = torch.cat((seq[layer], entry.double()))
        ents, n = seq[layer], len(q)
        scores = torch.einsum("thd,sd->ths", q.double(), ents) * E**-0.5
        ctx = len(ents)
        causal = torch.arange(ctx)[None, :] > (ctx - n + torch.arange(n))[:, None]
        scores.masked_fill_(causal[:, None, :], -torch.inf)
        return scores.softmax(-1) @ ents  # [n, H, E]


def run_step(
    store: KVGroups,
    plan: list[tuple[Request, int]],
    kernel: object,
    ref: Reference,
    gen: torch.Generator,
    dtype: torch.dtype,
) -> None:
    """One step the way the paged executor runs it (decodes first), every layer through the
    MLA operator, each output checked against the reference."""
    plan = sorted(plan, key=lambda p: p[1] > 1)
    for r, n in plan:
        while r.num_tokens < r.num_computed_tokens + n:
            r.output_token_ids.append(7000 + r.num_tokens)
        assert store.allocate(r, n)
    starts = [r.num_computed_tokens for r, _ in plan]
    q_lens = torch.tensor([n for _, n in plan])
    ctx_lens = torch.tensor(starts) + q_lens
    positions = torch.cat([torch.arange(s, s + n) for s, (_, n) in zip(starts, plan, strict=True)])
    num_decodes = sum(n == 1 for _, n in plan)
    step = StepAttention(
        store.pool.cache,
        store.managers[0].pages([r.request_id for r, _ in plan]),
        positions,
        q_lens,
        ctx_lens,
        num_decodes,
        int(q_lens.max()),
        kernel,  # type: ignore[arg-type]
    )
    total = int(q_lens.sum())
    for layer in range(LAYERS):
        q = (torch.randn(total, HEADS, E, generator=gen) * 2).to(dtype)
        entry = torch.randn(total, E, generator=gen).to(dtype)
        if layer == 0:  # through the custom op the model calls
            with active_step(step):
                got = mla.attend(PagedKV(), torch.tensor(layer), q, entry)
        else:
            got = mla.paged_attend(step, layer, q, entry)
        first = 0
        for r, n in plan:
            want = ref.attend(r.request_id, layer, q[first : first + n], entry[first : first + n])
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(got[first : first + n].double(), want, atol=tol, rtol=tol)
            first += n
    for r, n in plan:
        store.cache_full_pages(r, r.num_computed_tokens + n)
        r.num_computed_tokens += n


def admit(store: KVGroups, r: Request, ref: Reference, source: str | None = None) -> int:
    cached = store.num_cached_tokens(r)
    assert cached is not None
    r.num_computed_tokens = cached
    if cached:
        assert source is not None
        ref.share_prefix(r.request_id, source, cached)
    return cached


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["pytorch", "native"])
def test_mla_operator_matches_float64(path: str, dtype: torch.dtype) -> None:
    kernel = None
    if path == "native":
        kernel = native.library(HEADS, E)  # one KV head: all heads share the latent
        assert kernel is not None, "the kernels must build here (g++ is what Inductor uses too)"
    store, ref, gen = mla_store(16, dtype), Reference(), torch.Generator().manual_seed(0)
    assert (
        len(store.pool.cache.tensors) == 1 and store.pool.cache.k_cache is store.pool.cache.v_cache
    )
    a = request("a", list(range(1000, 1040)))  # 2 full pages and 8 tokens
    b = request("b", list(range(1000, 1016)) + list(range(2000, 2010)))  # a's first page
    c = request("c", list(range(3000, 3020)))
    admit(store, a, ref)
    run_step(store, [(a, 40)], kernel, ref, gen, dtype)
    assert admit(store, b, ref, source="a") == PS  # shares a's first page
    assert store.managers[0].tables["b"].pages[0] == store.managers[0].tables["a"].pages[0]
    run_step(store, [(b, 10), (a, 1)], kernel, ref, gen, dtype)
    admit(store, c, ref)
    run_step(store, [(a, 1), (b, 1), (c, 12)], kernel, ref, gen, dtype)
    run_step(store, [(a, 1), (b, 1), (c, 8)], kernel, ref, gen, dtype)
    for _ in range(6):  # a crosses into its 4th page, b into its 3rd
        run_step(store, [(a, 1), (b, 1), (c, 1)], kernel, ref, gen, dtype)
    assert [len(store.managers[0].tables[r].pages) for r in "abc"] == [4, 3, 2]


# --- what a token's KV costs ------------------------------------------------------------------

V3 = SimpleNamespace(
    kv_lora_rank=512, qk_rope_head_dim=64, num_heads=128, num_kv_heads=128, head_dim=192
)


def test_mla_kv_bytes_per_token_per_layer_are_the_latent_size() -> None:
    spec = mla.kv_spec(V3, 61, 64, torch.bfloat16)
    assert spec.kind == "mla" and spec.num_tensors == 1 and spec.num_heads == 1
    assert spec.token_bytes_per_layer == (512 + 64) * 2  # not heads x head_dim, not K and V
    assert spec.page_bytes == 61 * 64 * (512 + 64) * 2
    assert spec.page_shape == (61, 1, 64, 576)
    llama = SimpleNamespace(num_kv_heads=8, head_dim=128)
    grouped = gqa.kv_spec(llama, 32, 64, torch.bfloat16)
    assert grouped.kind == "gqa" and grouped.token_bytes_per_layer == 2 * 8 * 128 * 2
    int8 = gqa.kv_spec(llama, 32, 64, torch.bfloat16, "int8")
    assert int8.dtype == torch.int8 and int8.token_bytes_per_layer == 2 * 8 * (128 + 4)
    with pytest.raises(PyptoError, match="int8 is for grouped-query attention"):
        mla.kv_spec(V3, 61, 64, torch.bfloat16, "int8")


def test_the_store_and_its_tiers_hold_mla_pages_at_the_latent_size() -> None:
    cfg = SimpleNamespace(kv_lora_rank=32, qk_rope_head_dim=16, num_heads=4, num_kv_heads=4)
    model = SimpleNamespace(
        cfg=cfg,
        num_local_layers=LAYERS,
        local_layers=range(LAYERS),
        kv_layers=range(LAYERS),
        groups=ParallelGroups(),
        attention_kind=mla,
    )
    page = LAYERS * PS * E * 2  # bf16
    cache = CacheConfig(page_size=PS, num_kv_pages=5, kv_cpu_bytes=3 * page)
    store = build_kv_store(model, CPU, torch.bfloat16, cache, 0, "d", describe=False)  # type: ignore[arg-type]
    assert store.pool.cache.spec.kind == "mla" and store.pool.page_bytes == page
    assert [t.nbytes for t in store.pool.cache.tensors] == [5 * page]
    assert store.pool.cpu is not None and store.pool.cpu.capacity == 3
    assert [t.nbytes for t in store.pool.cpu.slots] == [3 * page]
    assert {s.name: s.page_bytes for s in store.tier_stats()} == {"device": page, "cpu": page}
    int8 = CacheConfig(page_size=PS, num_kv_pages=5, kv_cache_dtype="int8")
    with pytest.raises(PyptoError, match="int8 is for grouped-query attention"):
        build_kv_store(model, CPU, torch.bfloat16, int8, 0, "d", describe=False)  # type: ignore[arg-type]


# --- MLA pages through the CPU and SSD tiers ------------------------------------------------

TPS, TE = 4, 6  # small pages for the tier walk: entry (token, position, layer) x 2
A = list(range(10, 19))  # 2 full pages and 1 token
B = list(range(100, 109))


def slots(store: KVGroups, r: Request, positions: range) -> list[int]:
    pages = store.managers[0].tables[r.request_id].pages
    return [pages[p // TPS] * TPS + p % TPS for p in positions]


def fake_entries(r: Request, positions: range, layer: int) -> torch.Tensor:
    return torch.tensor([[r.token_ids[p], p, layer] * 2 for p in positions], dtype=torch.float32)


def compute(store: KVGroups, r: Request) -> int:
    """Claim the cached prefix, allocate, write the rest's fake entries, index full pages."""
    cached = store.num_cached_tokens(r)
    assert cached is not None
    r.num_computed_tokens = cached
    assert store.allocate(r, r.num_tokens - cached)
    new = range(cached, r.num_tokens)
    for layer in range(LAYERS):
        store.pool.cache.k_cache[layer, 0, slots(store, r, new)] = fake_entries(r, new, layer)
    store.cache_full_pages(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    return cached


def assert_entries(store: KVGroups, r: Request) -> None:
    context = range(r.num_computed_tokens)
    for layer in range(LAYERS):
        got = store.pool.cache.k_cache[layer, 0, slots(store, r, context)]
        assert torch.equal(got, fake_entries(r, context, layer))


def tier_store(tmp_path: Path, **options: object) -> KVGroups:
    return mla_store(3, page_size=TPS, entry=TE, ssd_dir=tmp_path, digest="m", **options)


def test_mla_pages_go_down_to_cpu_and_ssd_and_come_back(tmp_path: Path) -> None:
    store = tier_store(tmp_path, cpu_pages=1, ssd_pages=4)
    assert store.pool.cpu is not None and store.pool.ssd is not None
    a = request("a", A)
    compute(store, a)
    store.free(a)
    compute(store, request("b", B))  # a's pages: one to the CPU tier, the other on to SSD
    assert len(store.pool.cpu) == 1 and len(store.pool.ssd) == 1
    store.pool.ssd.flush()
    (page_file,) = store.pool.ssd.dir.glob("*" + SUFFIX)
    raw = page_file.read_bytes()
    (size,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    header = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + size])
    assert header["tensors"] == 1 and header["payload_bytes"] == LAYERS * TPS * TE * 4
    store.free(request("b", B))
    again = request("a2", A)
    assert compute(store, again) == 2 * TPS  # both pages loaded back, from the CPU and SSD
    assert_entries(store, again)
    loaded = {s.name: s.loaded for s in store.tier_stats()}
    assert loaded == {"device": 0, "cpu": 1, "ssd": 1}
    store.close()


def test_mla_pages_survive_a_restart_and_never_mix_with_gqa_pages(tmp_path: Path) -> None:
    store = tier_store(tmp_path, ssd_pages=4)
    a = request("a", A)
    compute(store, a)
    store.free(a)
    store.close()  # spills the cached pages to SSD
    again = tier_store(tmp_path, ssd_pages=4)
    assert again.pool.ssd is not None and again.pool.ssd.num_found == 2
    a2 = request("a2", A)
    assert compute(again, a2) == 2 * TPS
    assert_entries(again, a2)
    again.close()
    grouped = KVSpec("gqa", LAYERS, 1, TE // 2, TE // 2, TPS, torch.float32, num_tensors=2)
    assert grouped.page_bytes == again.pool.page_bytes  # same bytes a page
    other = one_group(PagedCache(grouped, 3, CPU), ssd_dir=tmp_path, ssd_pages=4, digest="m")
    assert other.pool.ssd is not None and other.pool.ssd.num_found == 0  # another folder, not a mix
    assert other.num_cached_tokens(request("a3", A)) == 0
    other.close()


def test_the_cpu_tier_refuses_a_page_of_the_other_kind() -> None:
    tier = HostTier(2, (1, 1, TPS, 2), torch.float32, num_tensors=1)
    page = torch.arange(8.0).view(1, 1, TPS, 2)
    tier.store(b"h" * 16, (1, 2, 3, 4), (page,))
    got = tier.load(b"h" * 16)
    assert got is not None and len(got) == 1 and torch.equal(got[0], page)
    with pytest.raises(ValueError, match="a page of 2 tensors for a tier of 1"):
        tier.store(b"k" * 16, (1, 2, 3, 4), (page, page))


# --- only the operators map slots -----------------------------------------------------------

OPERATOR_FILES = {"kv/paged_cache.py", "kv/paged_attention.py", "kv/native_attention.py"}
COMPUTES = re.compile(r"\b(block_table|slot_mapping)\s*(=[^=]|\()|\*\s*page\w*\s*\+\s*\w+\s*%")


def test_block_tables_and_slot_mappings_are_computed_only_by_the_attention_operators() -> None:
    """In the package and bench/, outside the operators' files, a block table or slot
    mapping may be passed on (the native decode step takes the operator's), never assigned,
    defined, called for, or computed with the slot arithmetic (page * page_size + position %
    page_size)."""
    root = Path(__file__).parent.parent
    package = root / "pypto_serving"
    offenders = []
    for path in sorted([*package.rglob("*.py"), *(root / "bench").rglob("*.py")]):
        name = path.relative_to(package if path.is_relative_to(package) else root).as_posix()
        if name in OPERATOR_FILES or name.startswith("kv/kinds/"):  # the kinds' operators
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if COMPUTES.search(code) and not code.lstrip().startswith(('"', "'")):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert offenders == []
    operator = (package / "kv/paged_cache.py").read_text()
    assert COMPUTES.search(operator), "the rule's pattern still finds the operator's mapping"
