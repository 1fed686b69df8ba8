"""The real Scheduler over a small real KV (one group: a manager over a pool), driven by a fake
executor (no model).

The fake executor does what PagedExecutor does with the KV store, minus the model: it writes
each computed token's (token id, position) into the token's KV slot, checks that the context
it would attend to holds exactly the request's tokens, indexes the pages that became full, and
"samples" a token that is a deterministic function of the request's tokens; with speculative
drafts, a token for each row, kept while the drafts agree, the rest of the rows' pages given
back. So prompts that
share a prefix share cached pages, and a request's expected output is known in advance.
"""

import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import hypothesis.strategies as st
import torch
from checkpoints import fake_kv_store, hash_chain
from hypothesis import Phase, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kv_costs import fixed

from pypto_serving.config import SchedulerConfig, SpeculativeSpec
from pypto_serving.kv.groups import KVGroups
from pypto_serving.ops.sampler import Sampled
from pypto_serving.request import Request, RequestStatus
from pypto_serving.sampling import SamplingParams
from pypto_serving.scheduler import RowBlocks, Scheduler, SchedulerOutput
from pypto_serving.speculative import Speculator

PS = 4  # tokens per page
VOCAB = 64
MAX_STEPS = 10_000  # "run to completion" must finish within this many steps...
STEPS_PER_TOKEN = 20  # ...and within this many per token left (observed: under 1)
PREFIXES = (  # prompts are drawn partly from these, so prefix-cache hits happen
    (1, 2, 3, 4, 5, 6, 7, 8, 9),
    (1, 2, 3, 4, 10, 11, 12, 13),
    (20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31),
)


def next_token(token_ids: Sequence[int]) -> int:
    """The fake model: the next token depends on every token of the context and its position."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids)) * 31 + len(token_ids)) % VOCAB


def expected_output(prompt: Sequence[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def chain(token_ids: Sequence[int], salt: str | None) -> list[bytes]:
    return hash_chain(list(token_ids), PS, salt)


def make_store(
    num_pages: int,
    enable_prefix_caching: bool = True,
    cpu_pages: int = 0,
    ssd_pages: int = 0,
    ssd_dir: Path | None = None,
) -> KVGroups:
    store = fake_kv_store(
        num_pages,
        PS,
        enable_prefix_caching=enable_prefix_caching,
        cpu_pages=cpu_pages,
        ssd_dir=ssd_dir,
        ssd_pages=ssd_pages,
        digest="fake-model",
    )
    for m in store.managers:  # the first guesses, kept: a run must replay per seed
        m.pool.costs = fixed(m.pool.costs)
    return store


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    arrival: int,
    priority: int = 0,
    salt: str | None = None,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, priority=priority, arrival=arrival, cache_salt=salt)


class FakeExecutor:
    """PagedExecutor's side of the KV store contract, with `next_token` standing in for a model."""

    def __init__(self, store: KVGroups) -> None:
        self.store = store

    def _slots(self, pages: list[int], positions: range) -> torch.Tensor:
        return torch.tensor([pages[p // PS] * PS + p % PS for p in positions], dtype=torch.long)

    def execute(self, out: SchedulerOutput) -> dict[str, list[Sampled]]:
        store, pool = self.store, self.store.pool.device
        sampled: dict[str, list[Sampled]] = {}
        for s in out.scheduled:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            assert req.status is RequestStatus.RUNNING
            tokens = req.token_ids + s.draft  # the drafts follow its last token
            assert n >= 1 and start + n <= len(tokens)
            assert not s.draft or start + n - len(s.draft) == req.num_tokens
            pages = store.managers[0].tables[req.request_id].pages
            assert len(pages) * PS >= start + n, "scheduled tokens without KV slots"
            new = range(start, start + n)
            for page in {pages[p // PS] for p in new}:  # never overwrite shared or cached KV
                assert pool.ref_count(page) == 1 and pool.page_hash(page) is None
            values = torch.tensor(
                [[tokens[p], p] for p in new], dtype=store.pool.cache.k_cache.dtype
            )
            store.pool.cache.k_cache[0, 0, self._slots(pages, new), :] = values
            context = range(start + n)  # what attention would read: exactly this request's KV
            got = (
                store.pool.cache.k_cache[0, 0, self._slots(pages, context), :]
                .to(torch.long)
                .tolist()
            )
            assert got == [[tokens[p], p] for p in context], "wrong KV in the context"
            if start + n < req.num_tokens:
                store.cache_full_pages(req, start + n)
                continue
            kept = []  # each row's "sample", kept while the drafts before it agreed
            for row in range(req.num_tokens, start + n + 1):
                kept.append(Sampled(next_token(tokens[:row]), 0.0, None))
                if row == start + n or kept[-1].token_id != tokens[row]:
                    break
            if s.draft:
                event(f"a step with drafts kept {len(kept) - 1} of {len(s.draft)}")
            computed = req.num_tokens - 1 + len(kept)
            store.cache_full_pages(req, computed, tokens[:computed])
            store.trim(req, computed)
            sampled[req.request_id] = kept
        return sampled


@dataclass
class Harness:
    """A scheduler, its store and the fake executor, stepped the way EngineCore steps them."""

    scheduler: Scheduler
    store: KVGroups
    executor: FakeExecutor

    @classmethod
    def build(
        cls,
        config: SchedulerConfig,
        num_pages: int,
        prefix_caching: bool = True,
        cpu_pages: int = 0,
        ssd_pages: int = 0,
        ssd_dir: Path | None = None,
        speculate: bool = False,
    ) -> Self:
        """A harness over a store with `num_pages` device pages and optional lower tiers;
        speculate: n-gram drafts (up to 3 after a repeated 1- or 2-gram)."""
        config.validate()
        store = make_store(num_pages, prefix_caching, cpu_pages, ssd_pages, ssd_dir)
        spec = SpeculativeSpec("ngram", 3, 1, 2)
        speculator = Speculator(spec) if speculate else None
        return cls(Scheduler(config, store, speculator), store, FakeExecutor(store))

    def step(self) -> SchedulerOutput:
        """One engine step (schedule, execute, update), checking what the scheduler handed out."""
        scheduler, config = self.scheduler, self.scheduler.config
        out = scheduler.schedule()
        # Progress: with work left, every step computes something (an empty step computes
        # nothing, and a run of them is a livelock).
        assert out.scheduled, "a step with unfinished requests scheduled nothing"
        assert out.num_tokens <= config.max_num_batched_tokens
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        assert not {r.request_id for r in out.preempted} & set(ids)
        threshold = config.long_prefill_token_threshold
        if threshold:
            # (drafts are no prompt tokens: a verifying decode may pass it)
            assert all(s.num_new_tokens - len(s.draft) <= threshold for s in out.scheduled)
        finished = scheduler.update(out, self.executor.execute(out))
        for req in finished:
            assert req.finish_reason == "length"
            assert req.output_token_ids == expected_output(
                req.prompt_token_ids, req.params.max_tokens or 0
            )
            assert req.request_id not in self.store.managers[0].tables
        return out

    def run(self) -> int:
        """Step until nothing is left; returns the number of steps.

        Every step computes at least one token, so without preemption this takes at most as many
        steps as tokens are left; recompute after preemption adds some. The bound scales with the
        work so that a livelock fails fast on a small (shrunk) example.
        """
        work = sum(
            len(r.prompt_token_ids) + (r.params.max_tokens or 0)
            for r in self.scheduler.requests.values()
        )
        max_steps = min(MAX_STEPS, STEPS_PER_TOKEN * work + 100)
        steps = 0
        while self.scheduler.has_unfinished():
            assert steps < max_steps, f"livelock: unfinished after {max_steps} steps"
            self.step()
            steps += 1
        return steps


def check_invariants(h: Harness) -> None:
    scheduler, store, pool = h.scheduler, h.store, h.store.pool.device
    # Pages: free + held = all; ref counts = table memberships; the index is consistent.
    held = Counter(p for table in store.managers[0].tables.values() for p in table.pages)
    for table in store.managers[0].tables.values():
        assert len(table.pages) == len(set(table.pages))
    assert [pool.ref_count(p) for p in range(pool.num_pages)] == [
        held[p] for p in range(pool.num_pages)
    ]
    assert pool.num_free + len(held) == pool.num_pages
    assert set(pool.free_page_ids()) == set(range(pool.num_pages)) - set(held)
    for page_hash, page_id in pool.cached_hashes().items():
        assert pool.page_hash(page_id) == page_hash

    # Requests: the queues partition the live requests; only running ones hold pages.
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    assert len(running) == len(scheduler.running) and len(waiting) == len(scheduler.waiting)
    assert not running & waiting
    assert set(scheduler.requests) == running | waiting
    assert set(store.managers[0].tables) == running
    assert len(running) <= scheduler.config.max_num_seqs
    for req in scheduler.requests.values():
        assert not req.finished
        assert req.output_token_ids == expected_output(
            req.prompt_token_ids, req.num_tokens - len(req.prompt_token_ids)
        )
        assert len(req.output_token_ids) < (req.params.max_tokens or 0)
    for req in scheduler.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.num_computed_tokens == 0
    check_tier_invariants(h)
    for req in scheduler.running:
        assert req.status is RequestStatus.RUNNING
        assert 0 < req.num_computed_tokens <= req.num_tokens
        table = store.managers[0].tables[req.request_id]
        # exactly the pages its computed tokens need, and the cached chain of its full pages
        assert len(table.pages) == -(-req.num_computed_tokens // PS)
        full = req.num_computed_tokens // PS if pool.enable_prefix_caching else 0
        assert table.hashes == chain(req.token_ids[: full * PS], req.cache_salt)

    if not scheduler.has_unfinished():
        assert pool.num_free == pool.num_pages
        assert store.managers[0].tables == {}
        assert scheduler.requests == {}
        assert store.managers[0].swapped == {}
        assert store.pool.cpu is None or store.pool.cpu.num_held == 0


def check_tier_invariants(h: Harness) -> None:
    """Every tier's used + free = its capacity; every hash lives in one place, but for the
    CPU tier's copies of pages the device holds still (made when they were freed); the CPU
    tier holds exactly the swapped (waiting) requests' pages besides its cached ones."""
    store, pool = h.store, h.store.pool.device
    device, lower = set(pool.cached_hashes()), [set(t.hashes()) for t in store.pool.lower]
    assert sum(len(p) for p in lower) == len(set().union(*lower)), "a hash in two lower tiers"
    copies = set(store.pool._backups)
    assert copies <= device and copies <= set(store.pool.cpu.hashes() if store.pool.cpu else ())
    assert all(
        device & p == (copies if t is store.pool.cpu else set())
        for t, p in zip(store.pool.lower, lower, strict=True)
    ), "a copy not made on free"
    for tier in store.pool.lower:
        assert len(tier.hashes()) == len(set(tier.hashes()))
        assert len(tier) <= tier.capacity
        for page_hash in tier.hashes():
            assert tier.tokens(page_hash) is not None
    if store.pool.cpu is not None:
        cpu = store.pool.cpu
        assert len(cpu) + cpu.num_free == cpu.capacity
        assert len(cpu) == len(cpu.hashes()) + cpu.num_held
        swapped = store.managers[0].swapped
        assert sorted(cpu.held_keys()) == sorted(e.key for e in swapped.values())
        for request_id, entry in store.managers[0].swapped.items():
            req = h.scheduler.requests[request_id]
            assert req in h.scheduler.waiting and req.status is RequestStatus.PREEMPTED
            assert req.num_computed_tokens == 0 and entry.num_tokens <= req.num_tokens
    else:
        assert store.managers[0].swapped == {}
    if store.pool.ssd is not None:
        assert len(store.pool.ssd) == len(store.pool.ssd.hashes())
    used = {s.name: s.used for s in store.tier_stats()}
    assert used["device"] == pool.num_pages - pool.num_free


@dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int
    priority: int
    salt: str | None


request_specs = st.builds(
    RequestSpec,
    prompt=st.builds(
        lambda prefix, suffix: [*prefix, *suffix] or [0],
        st.sampled_from([(), *PREFIXES]),
        st.lists(st.integers(0, VOCAB - 1), max_size=16),
    ),
    max_tokens=st.integers(1, 24),
    priority=st.sampled_from([0, 0, 0, 1]),
    salt=st.sampled_from([None, None, None, "s"]),
)


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, steps run, requests are aborted; the invariants hold after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness.build(SchedulerConfig(), num_pages=1)
        self.arrival = 0
        self.ssd_dir: Path | None = None

    @initialize(
        num_pages=st.integers(6, 12),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 24),
        long_prefill_token_threshold=st.integers(0, 8),
        prefix_caching=st.sampled_from([True, True, True, False]),
        cpu_pages=st.sampled_from([0, 0, 2, 4, 8]),
        ssd_pages=st.sampled_from([0, 0, 3, 6]),
        speculate=st.booleans(),
    )
    def setup(
        self,
        num_pages: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int,
        prefix_caching: bool,
        cpu_pages: int,
        ssd_pages: int,
        speculate: bool,
    ) -> None:
        """A scheduler over device pages and, drawn too, a CPU tier, an SSD tier and
        speculative decoding's drafts."""
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold)
        self.ssd_dir = Path(tempfile.mkdtemp(prefix="pypto-ssd-")) if ssd_pages else None
        self.h = Harness.build(
            config, num_pages, prefix_caching, cpu_pages, ssd_pages, self.ssd_dir, speculate
        )

    def _step(self, count: int) -> None:
        for _ in range(count):
            if not self.h.scheduler.has_unfinished():
                return
            self.h.step()

    @rule(specs=st.lists(request_specs, min_size=1, max_size=4), steps=st.integers(0, 4))
    def add_requests(self, specs: list[RequestSpec], steps: int) -> None:
        """Requests arrive, then a few steps run (so later arrivals can hit cached prefixes)."""
        capacity = self.h.store.capacity_tokens
        for spec in specs:
            max_tokens = min(spec.max_tokens, capacity - 1)
            prompt = spec.prompt[: capacity - max_tokens]  # the whole request must fit the pool
            self.h.scheduler.add(
                make_request(
                    f"r{self.arrival}", prompt, max_tokens, self.arrival, spec.priority, spec.salt
                )
            )
            self.arrival += 1
        self._step(steps)

    @rule(count=st.integers(1, 8))
    def step(self, count: int) -> None:
        self._step(count)

    @rule(index=st.integers(0, 15))
    def abort(self, index: int) -> None:
        scheduler = self.h.scheduler
        if not scheduler.requests:
            return
        request_id = sorted(scheduler.requests)[index % len(scheduler.requests)]
        (req,) = scheduler.abort([request_id])
        assert req.finished and req.finish_reason == "abort"
        assert request_id not in self.h.store.managers[0].tables
        assert scheduler.abort([request_id]) == []  # a second abort is a no-op

    @rule()
    def run_to_completion(self) -> None:
        self.h.run()  # asserts that it ends, within a bounded number of steps

    @invariant()
    def invariants(self) -> None:
        check_invariants(self.h)

    def teardown(self) -> None:
        # Every example ends by draining: liveness and the all-free final state, every time.
        self.h.run()
        check_invariants(self.h)
        event(f"preemptions: {min(self.h.scheduler.num_preemptions, 3)}")
        event(f"swaps: {min(self.h.scheduler.num_swapped, 3)}")
        event(f"prefix hit: {self.h.scheduler.prefix_hits > 0}")
        for s in self.h.store.tier_stats():
            event(f"{s.name} hits: {min(s.hits, 3)}")
        self.h.store.close()
        if self.ssd_dir is not None:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    phases=[p for p in Phase if p is not Phase.explain],  # explaining a failure takes minutes
)
TestSchedulerMachine = SchedulerMachine.TestCase


# --- deterministic scenarios -------------------------------------------------------------


def workload() -> list[tuple[str, list[int], int]]:
    """Six requests of 9-13 prompt tokens and 10 outputs; half share PREFIXES[0]."""
    out = []
    for i in range(6):
        base = list(PREFIXES[0]) if i % 2 == 0 else [40 + i, 41, 42, 43, 44, 45, 46, 47, 48]
        out.append((f"w{i}", [*base, *range(i)][: 9 + i % 5], 10))
    return out


def run_workload(
    num_pages: int, config: SchedulerConfig, prefix_caching: bool = True
) -> tuple[Harness, dict[str, Request]]:
    h = Harness.build(config, num_pages, prefix_caching)
    requests = {}
    for arrival, (request_id, prompt, max_tokens) in enumerate(workload()):
        requests[request_id] = make_request(request_id, prompt, max_tokens, arrival)
        h.scheduler.add(requests[request_id])
        h.step()  # one arrival per step, so later prompts can hit earlier prompts' pages
    h.run()
    check_invariants(h)
    return h, requests


def test_tiny_pool_preempts_yet_every_request_finishes() -> None:
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64)
    h, requests = run_workload(num_pages=6, config=config)
    assert h.scheduler.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in requests.values())
    for req in requests.values():
        assert req.finish_reason == "length"
        assert len(req.output_token_ids) == 10
        assert req.output_token_ids == expected_output(req.prompt_token_ids, 10)


def test_preempted_request_resumes_to_the_same_output() -> None:
    for prefix_caching in (True, False):
        for config in (
            SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64),
            SchedulerConfig(
                max_num_seqs=3, max_num_batched_tokens=7, long_prefill_token_threshold=3
            ),
        ):
            big, big_requests = run_workload(64, config, prefix_caching)
            tiny, tiny_requests = run_workload(6, config, prefix_caching)
            assert big.scheduler.num_preemptions == 0
            assert tiny.scheduler.num_preemptions > 0
            assert {r: q.output_token_ids for r, q in tiny_requests.items()} == {
                r: q.output_token_ids for r, q in big_requests.items()
            }
            if prefix_caching:
                assert big.scheduler.prefix_hits > 0


def test_waiting_request_whose_allocation_fails_holds_no_pages() -> None:
    h = Harness.build(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), num_pages=4)
    a = make_request("a", list(range(1, 13)), max_tokens=4, arrival=0)  # 3 pages, then 4
    h.scheduler.add(a)
    h.step()
    assert h.store.managers[0].tables["a"].pages == [0, 1, 2]
    # b hits a's first page but needs 2 more pages with only 1 free: it must let go of the hit.
    b = make_request("b", [1, 2, 3, 4, 50, 51, 52, 53, 54], max_tokens=1, arrival=1)
    h.scheduler.add(b)
    h.step()
    assert "b" not in h.store.managers[0].tables
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING
    assert [h.store.pool.device.ref_count(p) for p in range(4)] == [
        1,
        1,
        1,
        1,
    ]  # a grew into page 3
    check_invariants(h)
    h.run()
    assert b.num_cached_tokens == 4  # b's hit, claimed when it was finally admitted
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 1)
    check_invariants(h)


def test_abort_frees_pages_at_every_stage() -> None:
    h = Harness.build(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), num_pages=8)
    reqs = [
        make_request(f"x{i}", list(range(i, i + 10)), max_tokens=4, arrival=i) for i in range(3)
    ]
    for req in reqs:
        h.scheduler.add(req)
    h.step()  # x0 mid-prefill, x1 and x2 waiting
    assert set(h.store.managers[0].tables) == {"x0"}
    h.scheduler.abort(["x1"])  # waiting
    h.step()
    h.scheduler.abort(["x0"])  # running
    check_invariants(h)
    h.run()
    assert reqs[2].output_token_ids == expected_output(reqs[2].prompt_token_ids, 4)
    assert [r.finish_reason for r in reqs] == ["abort", "abort", "length"]
    check_invariants(h)


def test_preemption_victim_is_the_lowest_priority_then_latest_arrival() -> None:
    for a_priority, victim in ((0, "b"), (1, "a")):
        h = Harness.build(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), num_pages=4)
        a = make_request("a", list(range(1, 8)), max_tokens=8, arrival=0, priority=a_priority)
        b = make_request("b", list(range(11, 18)), max_tokens=8, arrival=1)
        h.scheduler.add(a)
        h.scheduler.add(b)
        h.step()  # both prefill 7 tokens into 2 pages each: the pool is full
        h.step()  # both decode token 8 into their second page
        out = h.step()  # both need a third page: one of them must go
        assert [r.request_id for r in out.preempted] == [victim]
        assert [s.request.request_id for s in out.scheduled] == [({"a", "b"} - {victim}).pop()]
        assert h.scheduler.num_preemptions == 1
        assert [r.request_id for r in h.scheduler.waiting] == [victim]
        check_invariants(h)
        h.run()
        assert a.output_token_ids == expected_output(a.prompt_token_ids, 8)
        assert b.output_token_ids == expected_output(b.prompt_token_ids, 8)


def test_prefix_counters_count_each_request_once() -> None:
    """Retried admissions and resumptions after preemption are not counted again."""
    h = Harness.build(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), num_pages=4)
    h.scheduler.add(make_request("a", list(range(1, 13)), max_tokens=4, arrival=0))
    h.scheduler.add(make_request("b", [1, 2, 3, 4, 50, 51, 52, 53, 54], max_tokens=1, arrival=1))
    h.run()
    assert (h.scheduler.prefix_queries, h.scheduler.prefix_hits) == (12 + 9, 4)


class AskedFor:
    """A proposer that drafts as many copies of a request's last token as it may, and
    records how many each step asked for."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        self.asked.append([k for _, k in wanted])
        return {r.request_id: [r.token_ids[-1]] * k for r, k in wanted}

    def forget(self, request_id: str) -> None:
        pass


def test_drafts_fill_the_decodes_last_block_of_rows_and_never_start_another() -> None:
    blocks = RowBlocks(8, 10)  # AVX-512 VNNI's products: a last block of up to 10 rows
    rows = (1, 2, 8, 9, 10, 11, 16, 18, 19)
    assert [blocks.room(n) for n in rows] == [9, 8, 2, 1, 0, 7, 2, 0, 7]
    assert [RowBlocks(8, 8).room(n) for n in (1, 7, 8, 9, 16)] == [7, 1, 0, 7, 0]
    for decodes, room in ((1, 9), (8, 2), (11, 7)):
        proposer = AskedFor()
        speculator = Speculator(SpeculativeSpec("ngram", 16, 1, 2), proposer)
        config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
        store = make_store(64)
        scheduler = Scheduler(config, store, speculator, 256, blocks)
        h = Harness(scheduler, store, FakeExecutor(store))
        for i in range(decodes):
            h.scheduler.add(make_request(f"r{i}", [1 + i, 2, 3], max_tokens=40, arrival=i))
            for _ in range(3):
                speculator.observe(f"r{i}", 16, 16)  # drafts that held: its budget is k
        h.step()  # the prompts' prefill
        out = h.scheduler.schedule()  # their first decodes, with drafts
        assert sum(proposer.asked[-1]) == room
        assert sum(s.num_new_tokens for s in out.scheduled) == decodes + room
