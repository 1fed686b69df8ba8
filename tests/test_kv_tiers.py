"""The KV tiers below the device: demotion, load-back, SSD files, swaps (no model).

Page size 4, one layer, one KV head of dim 2; the fake KV of a token at position p is
(token id, p), so a page loaded back from any tier is checked value by value. A fresh pool
hands out page ids in order; freed pages join the LRU tail (a request's pages in reverse).
"""

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from checkpoints import fake_kv_store, hash_chain

from pypto_serving.kv.disk_tier import MAGIC, SUFFIX, DiskTier
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.host_tier import HostTier
from pypto_serving.kv.pool import RECENT, REMEASURE_AFTER, Costs
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams

PS = 4
A = list(range(10, 19))  # 9 tokens: 2 full pages and 1 token
B = list(range(100, 109))
X, Y = list(range(300, 305)), list(range(400, 405))  # 1 full page and 1 token


def make_store(
    num_pages: int = 3,
    cpu_pages: int = 0,
    ssd_pages: int = 0,
    ssd_dir: Path | None = None,
    digest: str = "model-a",
) -> KVGroups:
    return fake_kv_store(
        num_pages, PS, cpu_pages=cpu_pages, ssd_dir=ssd_dir, ssd_pages=ssd_pages, digest=digest
    )


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True))


def slots(store: KVGroups, req: Request, positions: range) -> list[int]:
    pages = store.managers[0].tables[req.request_id].pages
    return [pages[p // PS] * PS + p % PS for p in positions]


def compute(store: KVGroups, req: Request) -> int:
    """Admit `req` like the scheduler and executor do: claim, allocate, write the KV of the
    tokens not cached, index full pages. Returns the number of tokens claimed from the cache."""
    cached = store.num_cached_tokens(req)
    assert cached is not None
    req.num_computed_tokens = cached
    assert store.allocate(req, req.num_tokens - cached)
    new = range(cached, req.num_tokens)
    values = torch.tensor([[req.token_ids[p], p] for p in new], dtype=torch.float32)
    store.pool.cache.k_cache[0, 0, slots(store, req, new)] = values
    store.pool.cache.v_cache[0, 0, slots(store, req, new)] = -values
    store.cache_full_pages(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    return cached


def assert_kv(store: KVGroups, req: Request) -> None:
    """The request's context holds exactly its tokens' KV."""
    context = range(req.num_computed_tokens)
    want = [[req.token_ids[p], p] for p in context]
    assert store.pool.cache.k_cache[0, 0, slots(store, req, context)].tolist() == want
    assert store.pool.cache.v_cache[0, 0, slots(store, req, context)].tolist() == [
        [-t, -p] for t, p in want
    ]


def stats(store: KVGroups) -> dict[str, dict[str, int]]:
    keys = ("hits", "misses", "stored", "loaded", "evicted", "used")
    return {s.name: {k: getattr(s, k) for k in keys} for s in store.tier_stats()}


def test_device_pages_demote_to_cpu_and_load_back_on_a_hit() -> None:
    store = make_store(num_pages=3, cpu_pages=2)
    ha, hb = hash_chain(A, PS), hash_chain(B, PS)
    a = request("a", A)
    assert compute(store, a) == 0
    assert store.managers[0].tables["a"].pages == [0, 1, 2]
    store.free(a)  # LRU: 2, 1, 0 (a's pages 0 and 1 stay cached on the device)
    b = request("b", B)
    assert compute(store, b) == 0
    # b took 2 (uncached), then 1 and 0, whose cached KV went to the CPU tier in that order
    assert store.managers[0].tables["b"].pages == [2, 1, 0]
    assert store.pool.cpu is not None and store.pool.cpu.hashes() == [ha[1], ha[0]]
    assert store.pool.device.cached_hashes() == {hb[0]: 2, hb[1]: 1}
    store.free(b)  # LRU: 0, 1, 2

    again = request("a2", A)
    assert compute(store, again) == 8  # both full pages, loaded from the CPU tier
    # loading took pages 0 (uncached) and 1 (b's second page: demoted), then the last
    # token's page took 2 (b's first page: demoted)
    assert store.managers[0].tables["a2"].pages == [0, 1, 2]
    assert store.cached_tokens_by_tier(again) == {"cpu": 8}
    assert_kv(store, again)
    assert store.pool.device.cached_hashes() == {ha[0]: 0, ha[1]: 1}
    assert store.pool.cpu.hashes() == [hb[1], hb[0]]  # exclusive: a's pages left the CPU tier
    s = stats(store)
    assert s["device"] == {
        "hits": 0,
        "misses": 4,  # a's first page, b's first page, a2's two pages
        "stored": 2,
        "loaded": 0,
        "evicted": 4,
        "used": 3,
    }
    assert s["cpu"] == {"hits": 2, "misses": 2, "stored": 4, "loaded": 2, "evicted": 0, "used": 2}
    cpu = next(t for t in store.tier_stats() if t.name == "cpu")
    assert sum(cpu.load_buckets) == 1 and cpu.load_seconds_sum > 0


def test_a_freed_page_is_copied_to_the_cpu_tier_in_the_background_and_its_eviction_copies_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The founding notes' offload rule: a finished request's full cached pages go to the
    CPU tier when freed (a background thread copies them), the device keeping them too; when
    the device reuses them, nothing is read from the device any more."""
    threads: list[str] = []
    copy = HostTier._copy_serially

    def copied(self: HostTier, slot: int, kv: tuple[torch.Tensor, ...]) -> None:
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        threads.append(f"{threading.current_thread().name} nice {niceness}")
        copy(self, slot, kv)

    monkeypatch.setattr(HostTier, "_copy_serially", copied)
    store = make_store(num_pages=3, cpu_pages=4)
    ha = hash_chain(A, PS)
    a = request("a", A)
    compute(store, a)
    store.free(a)  # pages 2 (partial), 1, 0: the two full ones copied, last page first
    assert store.pool.cpu is not None and store.pool.cpu.hashes() == [ha[1], ha[0]]
    assert store.pool.device.cached_hashes() == {ha[0]: 0, ha[1]: 1}  # still on the device
    again = request("a1", A)  # a device hit leaves the copies be
    assert compute(store, again) == 8 and store.cached_tokens_by_tier(again) == {"device": 8}
    store.free(again)
    assert stats(store)["cpu"]["stored"] == 2  # copied already: not again

    reads: list[int] = []
    read_page = store.pool.cache.read_page
    monkeypatch.setattr(store.pool.cache, "read_page", lambda p: reads.append(p) or read_page(p))
    b = request("b", B)
    compute(store, b)  # takes pages 2, 1, 0: a's cached pages evicted
    assert store.managers[0].tables["b"].pages == [2, 1, 0]
    assert reads == [], "an eviction read the device: the page was not copied when freed"
    s = stats(store)
    assert s["device"]["evicted"] == 2 and s["cpu"]["stored"] == 2
    store.free(b)  # b's pages are copied in their turn, into the two slots left
    assert store.pool.cpu.hashes() == [ha[1], ha[0], *reversed(hash_chain(B, PS))]

    a2 = request("a2", A)
    assert compute(store, a2) == 8 and store.cached_tokens_by_tier(a2) == {"cpu": 8}
    assert_kv(store, a2)  # reading the slots back waited for their copies
    assert len(threads) == 4 and all(t.startswith("pypto-kv-offload") for t in threads)
    assert all(t.endswith(" nice 19") for t in threads)  # its copies wait for idle cores


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here")
def test_a_background_copy_starts_no_openmp_team_and_keeps_every_bit() -> None:
    """A copy on the offload thread goes through NumPy: torch's copy_ of a page that large
    would start an OpenMP team for that thread beside the steps' own (one more OS thread per
    extra torch thread), which slowed every later decode step on a machine with as many
    threads as cores. The bits arrive unchanged (bf16, a strided view of the device's page)."""
    from concurrent.futures import ThreadPoolExecutor

    shape = (4, 2, 64, 128)  # [layers, heads, page, row]: 65,536 elements, past torch's grain
    tier = HostTier(2, shape, torch.bfloat16)
    device = torch.randn(2, 4, 3, 2, 64, 128).to(torch.bfloat16)  # [K/V, layers, pages, ...]
    kv = (device[0, :, 1], device[1, :, 1])  # page 1: strided views, as the cache hands them
    with ThreadPoolExecutor(1, thread_name_prefix="pypto-kv-offload") as copier:
        copier.submit(lambda: None).result()  # the copier's own thread is up
        before = os_threads()
        tier.store_later(b"h", (1, 2), kv, copier).result()
        assert os_threads() == before, "the copy started threads (an OpenMP team)"
    loaded = tier.load(b"h")
    assert loaded is not None
    for got, want in zip(loaded, kv, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_copies_made_on_free_give_way_first_and_take_only_free_slots() -> None:
    """A copy of a page the device holds still is the first thing dropped when the CPU tier
    needs room, and a freed page is copied only into a free slot: the hierarchy keeps every
    page it kept without the copies."""
    store = make_store(num_pages=5, cpu_pages=2)
    ha, hx = hash_chain(A, PS), hash_chain(X, PS)
    a = request("a", A)
    compute(store, a)  # pages 0, 1, 2
    store.free(a)  # LRU: 3, 4, 2, 1, 0; a's full pages copied: the CPU tier is full
    assert store.pool.cpu is not None and store.pool.cpu.hashes() == [ha[1], ha[0]]
    x, y = request("x", X), request("y", Y)
    compute(store, x)  # pages 3, 4
    compute(store, y)  # pages 2, 1: a's page 1 evicted, its copy the page now (no copy made)
    store.free(x)  # x's full page: no free slot, not copied
    assert store.pool.cpu.hashes() == [ha[1], ha[0]]
    z = request("z", A[:5])
    assert compute(store, z) == 4  # a's first page, on the device: held again (pages 0, 4)
    w = request("w", [1, 2, 3])
    compute(store, w)  # takes page 3: x's page goes to the CPU tier, a's copy of page 0 gives way
    assert store.pool.cpu.hashes() == [ha[1], hx[0]]
    assert store.pool.device.cached_hashes()[ha[0]] == 0
    for r in (z, y, w):
        store.free(r)
    a2 = request("a2", A)
    assert compute(store, a2) == 8
    assert store.cached_tokens_by_tier(a2) == {"device": 4, "cpu": 4}
    assert_kv(store, a2)


def test_cpu_pressure_pushes_lru_pages_to_ssd_and_an_ssd_hit_loads_back(tmp_path: Path) -> None:
    store = make_store(num_pages=3, cpu_pages=1, ssd_pages=4, ssd_dir=tmp_path)
    ha = hash_chain(A, PS)
    a, b = request("a", A), request("b", B)
    compute(store, a)
    store.free(a)
    compute(store, b)  # a's page 1 -> cpu, then page 0 -> cpu, page 1 -> ssd
    assert store.pool.cpu is not None and store.pool.ssd is not None
    assert store.pool.cpu.hashes() == [ha[0]]
    assert store.pool.ssd.hashes() == [ha[1]]
    store.pool.ssd.flush()
    page_file = store.pool.ssd.dir / (ha[1].hex() + SUFFIX)
    assert page_file.read_bytes().startswith(MAGIC)
    store.free(b)

    again = request("a2", A)
    assert compute(store, again) == 8
    assert store.cached_tokens_by_tier(again) == {"cpu": 4, "ssd": 4}
    assert_kv(store, again)
    assert not page_file.exists()  # the page moved up: one copy at a time
    hb = hash_chain(B, PS)  # a2's pages pushed b's down: page 1 to cpu and on to ssd, then 0
    assert store.pool.ssd.hashes() == [hb[1]] and store.pool.cpu.hashes() == [hb[0]]
    s = stats(store)
    assert (
        s["ssd"]["hits"] == 1 and s["ssd"]["loaded"] == 1 and s["cpu"]["misses"] == 3
    )  # a, b, a2 page 1


def _page_on_ssd(tmp_path: Path) -> tuple[KVGroups, Path]:
    """A store whose device and CPU tiers are gone, with a's first page on SSD (flushed)."""
    store = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    a = request("a", A)
    compute(store, a)
    store.free(a)
    b = request("b", B)
    compute(store, b)
    store.free(b)
    assert store.pool.ssd is not None
    store.pool.ssd.flush()
    assert len(store.pool.ssd) == 2
    return store, store.pool.ssd.dir / (hash_chain(A, PS)[0].hex() + SUFFIX)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


def _foreign(path: Path) -> None:
    """Replace the file with the same page written for another model (another digest)."""
    other_dir = path.parent.parent / "other"
    other = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=other_dir, digest="b")
    a = request("a", A)
    compute(other, a)
    other.free(a)
    compute(other, request("b", B))
    assert other.pool.ssd is not None
    other.pool.ssd.flush()
    shutil.copy(other.pool.ssd.dir / path.name, path)
    other.close()


@pytest.mark.parametrize(
    "damage", [_flip, _truncate, _foreign], ids=["flip", "truncate", "foreign"]
)
def test_a_damaged_or_foreign_ssd_page_is_a_miss_and_is_deleted(
    tmp_path: Path, damage: object
) -> None:
    store, page_file = _page_on_ssd(tmp_path)
    damage(page_file)  # type: ignore[operator]
    again = request("a2", A)
    assert compute(store, again) == 0  # page 0 unreadable: nothing after it is used either
    assert store.cached_tokens_by_tier(again) == {}
    assert not page_file.exists()
    assert store.pool.ssd is not None and store.pool.ssd.num_unreadable == 1
    assert_kv(store, again)  # recomputed
    store.close()


def test_ssd_pages_survive_a_restart_and_junk_is_cleaned_up(tmp_path: Path) -> None:
    store, page_file = _page_on_ssd(tmp_path)
    folder = page_file.parent
    store.close()
    (folder / "deadbeef.tmp").write_bytes(b"half a write")
    (folder / ("ab" * 16 + SUFFIX)).write_bytes(b"not a page")

    second = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    # a's pages were on SSD; close() kept b's (cached on the device) there too
    assert second.pool.ssd is not None and second.pool.ssd.num_found == 4
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        h.hex() + SUFFIX for h in hash_chain(A, PS) + hash_chain(B, PS)
    )
    assert "4 from earlier runs" in second.describe()
    again = request("a2", A)
    assert compute(second, again) == 8
    assert second.cached_tokens_by_tier(again) == {"ssd": 8}
    assert_kv(second, again)
    second.close()

    other_model = make_store(num_pages=3, ssd_pages=4, ssd_dir=tmp_path, digest="model-b")
    assert other_model.pool.ssd is not None and other_model.pool.ssd.num_found == 0
    other_model.close()


def test_restart_over_budget_keeps_the_newest_pages(tmp_path: Path) -> None:
    store, _ = _page_on_ssd(tmp_path)
    assert store.pool.ssd is not None
    folder, (old, new) = store.pool.ssd.dir, store.pool.ssd.hashes()
    store.close()
    os.utime(folder / (new.hex() + SUFFIX), ns=(2 * 10**18, 2 * 10**18))
    os.utime(folder / (old.hex() + SUFFIX), ns=(10**18, 10**18))
    smaller = make_store(num_pages=3, ssd_pages=1, ssd_dir=tmp_path)
    assert smaller.pool.ssd is not None and smaller.pool.ssd.hashes() == [new]
    assert [p.name for p in folder.iterdir()] == [new.hex() + SUFFIX]
    smaller.close()


def test_ssd_budget_evicts_the_least_recently_stored_page(tmp_path: Path) -> None:
    store = make_store(num_pages=3, cpu_pages=0, ssd_pages=1, ssd_dir=tmp_path)
    a = request("a", A)
    compute(store, a)
    store.free(a)
    compute(store, request("b", B))  # a's page 1, then page 0 (which pushes page 1 out)
    assert store.pool.ssd is not None and store.pool.ssd.hashes() == [hash_chain(A, PS)[0]]
    store.pool.ssd.flush()
    assert len(list(store.pool.ssd.dir.iterdir())) == 1
    assert stats(store)["ssd"]["evicted"] == 1
    store.close()


def test_a_page_loaded_before_its_write_is_served_from_memory(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 2, (1, 1, PS, 2), torch.float32, "d")
    go, write = threading.Event(), tier._write
    tier._write = lambda page_hash: (go.wait(), write(page_hash))  # type: ignore[method-assign]
    k, v = torch.arange(8.0).view(1, 1, PS, 2), -torch.arange(8.0).view(1, 1, PS, 2)
    tier.store(b"h" * 16, (1, 2, 3, 4), (k, v))
    got = tier.load(b"h" * 16)  # the writer is held back: the page is still queued
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    go.set()
    tier.flush()
    assert list(tier.dir.iterdir()) == []  # the write was skipped
    tier.close()


def test_preemption_swaps_to_cpu_and_resumes_with_the_same_kv() -> None:
    store = make_store(num_pages=4, cpu_pages=4)
    a = request("a", A)
    compute(store, a)
    assert store.preempt(a)
    a.num_computed_tokens = 0  # what the scheduler does
    assert store.pool.cpu is not None and store.pool.cpu.num_held == 3 and store.pool.num_free == 4
    b = request("b", list(range(200, 216)))  # all 4 device pages: a's cached pages demote
    compute(store, b)
    assert store.num_cached_tokens(a) is None  # no room for a's 3 pages yet
    store.free(b)
    assert store.num_cached_tokens(a) == 9
    a.num_computed_tokens = 9
    assert_kv(store, a)
    assert store.pool.cpu.num_held == 0 and store.managers[0].swapped == {}
    assert store.pool.num_swap_ins == 1
    assert store.allocate(a, 1)  # and it decodes on


def test_preemption_recomputes_when_swap_has_no_room_or_does_not_pay() -> None:
    small = make_store(num_pages=4, cpu_pages=2)  # a needs 3 CPU pages
    a = request("a", A)
    compute(small, a)
    assert not small.preempt(a)
    assert small.managers[0].swapped == {} and small.pool.num_free == 4

    cheap = make_store(num_pages=4, cpu_pages=4)
    cheap.pool.costs.recompute_s_per_token = 0.0  # recomputing is free: never swap
    a = request("a", A)
    compute(cheap, a)
    assert not cheap.preempt(a)


def test_a_finished_swapped_request_releases_its_cpu_pages() -> None:
    store = make_store(num_pages=4, cpu_pages=4)
    a = request("a", A)
    compute(store, a)
    assert store.preempt(a)
    a.finish("abort")
    store.free(a)
    assert (
        store.managers[0].swapped == {}
        and store.pool.cpu is not None
        and store.pool.cpu.num_held == 0
    )


def test_loading_slower_than_recompute_is_skipped() -> None:
    store = make_store(num_pages=3, cpu_pages=2)
    a, b = request("a", A), request("b", B)
    compute(store, a)
    store.free(a)
    compute(store, b)
    store.free(b)
    store.pool.costs.load_s_per_page["cpu"] = 1.0  # one page: a second to load, ~4 ms to compute
    again = request("a2", A)
    assert compute(store, again) == 0
    assert stats(store)["cpu"]["loaded"] == 0
    assert_kv(store, again)  # recomputed; its pages are the canonical copies now
    assert set(hash_chain(A, PS)) <= set(store.pool.device.cached_hashes())
    assert store.pool.cpu is not None and not set(hash_chain(A, PS)) & set(store.pool.cpu.hashes())


def test_one_stalled_load_moves_no_decision() -> None:
    """A load the machine's other work stalled (a descheduled thread) is one measurement of
    the last RECENT: the estimate is their median, and loads keep paying."""
    costs = Costs(recompute_s_per_token=1e-4, load_s_per_page={"cpu": 4e-6})
    costs.observe_load("cpu", 2, 2.0)  # a second per page
    assert costs.load_s_per_page["cpu"] == 4e-6  # the first guess and it: the lower
    assert costs.loads_pay(["cpu"], 16)
    costs.observe_load("cpu", 2, 2e-5)
    assert costs.load_s_per_page["cpu"] == 1e-5
    for _ in range(RECENT):
        costs.observe_load("cpu", 2, 4e-5)
    costs.observe_load("cpu", 2, 2.0)
    assert costs.load_s_per_page["cpu"] == 2e-5
    assert costs.loads_pay(["cpu"], 16)


def test_loads_skipped_for_a_slow_spell_are_measured_again() -> None:
    """The load estimate moves only when loads run: after REMEASURE_AFTER refusals in a row
    one runs anyway, and a load that pays again starts the count over."""
    costs = Costs(recompute_s_per_token=1e-4, load_s_per_page={"cpu": 1.0})
    answers = [costs.loads_pay(["cpu"], 16) for _ in range(2 * REMEASURE_AFTER)]
    assert [i for i, yes in enumerate(answers) if yes] == [
        REMEASURE_AFTER - 1,
        2 * REMEASURE_AFTER - 1,
    ]
    costs.loads_pay(["cpu"], 16)
    costs.load_s_per_page["cpu"] = 1e-6
    assert costs.loads_pay(["cpu"], 16) and costs.skipped == 0


def test_describe_reports_every_tier_budget(tmp_path: Path) -> None:
    store = make_store(num_pages=3, cpu_pages=5, ssd_pages=7, ssd_dir=tmp_path)
    text = store.describe()
    assert "device 3 pages x 4 tokens" in text
    assert "cpu 5 pages" in text
    assert f"ssd 7 pages in {tmp_path}" in text
    store.close()
