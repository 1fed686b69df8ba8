"""The physical KV pool of one page geometry: device pages and their ref counts, the
content-addressed index, and the tiers below the device, moving pages by id.

It is what the KV manager degrades to (docs/architecture.md): it knows pages, hashes and
bytes, never requests, windows, layers or heads. The attention kinds' managers (`manager.py`)
decide which pages a request holds, which of them a prefix hit reuses and when a page leaves a
window; they ask this pool to allocate, free, find, load, index and hold pages. The page bytes
belong to the attention operator (`paged_cache.PagedCache`, from its kind's `KVSpec`); the pool
reads and writes a page only through it (`read_page`, `write_page`), so a page of any kind
moves between tiers alike.

Tiers (the Mooncake way): the device pages, then optionally CPU memory, then optionally SSD,
then optionally a pool shared with other servers (`remote_tier.py`, a Mooncake Store). The
lower local tiers hold a page hash in at most one place; the device may hold a page the CPU
tier holds too, its copy made when the page was freed. The shared pool is not exclusive: every
page indexed on the device is written to it too (write-through), and a hit there copies the
page and leaves it for others:

    device ──a cached page freed (no holder left): copied──▶ cpu ──cpu full: its LRU page──▶ ssd
       ▲                                                      │                          │
       └────────── a hit: read back (`read`), into pages the manager allocated ──────────┘

The founding notes' offload rule: a complete cached page no request holds any more is copied
to the CPU tier when it is freed, by a background thread (`_back_up`), so that when the device
later reuses the page for another (the LRU's eviction) nothing is left to copy and the step
that allocates pays nothing. Under TP/PP the copy is made at once (the other ranks replay rank
0's moves in order). A page reused before its copy is done waits for it. Such a copy takes
only a free CPU slot, and is the first to go when the tier needs room (the device has the page
still), so the copies never cost the hierarchy a page it would otherwise keep.

Device page lifecycle (prefix caching on):

    free (LRU) ──allocate──▶ held ──filled: `index`──▶ full page: hashed, indexed
        ▲                                                         │ a manager that hits it
        │  evicted lazily: when allocate reuses the page,         │ acquires it (ref > 1)
        │  its KV is demoted to the next tier                     ▼
        └───────────────── ref count reaches 0: back to the LRU tail, still indexed

A page held for a swap-out (`hold`) sits in CPU slots under a key the manager chooses, outside
the index, until it is taken back (`take_held`) or dropped (`drop_held`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from pypto_serving.device import pin_host_memory
from pypto_serving.kv.disk_tier import DiskTier
from pypto_serving.kv.events import KVEventLog
from pypto_serving.kv.host_tier import HostTier
from pypto_serving.kv.mirror import Journal, JournaledDiskTier, JournaledHostTier
from pypto_serving.kv.mooncake_pool import Pool, pool_key
from pypto_serving.kv.page_pool import PagePool
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.remote_tier import RemoteTier
from pypto_serving.kv.tier import PageKV, PageTier, TierStats, background_priority

log = logging.getLogger(__name__)

PRESSURE_LOG_INTERVAL_S = 10.0
RECENT = 9
"""Measurements each running cost estimate is the median of: one step or load stalled by the
machine's other work (a descheduled thread: tens of ms) moves no decision."""
REMEASURE_AFTER = 64
"""Lower-tier loads skipped as too slow in a row, after which one runs anyway: the load
estimate moves only when loads happen, so without it a slow spell would stop them for good."""
FORMAT_VERSION = "2"
"""Bumped when the KV layout of a page changes (old SSD pages then become foreign)."""


@dataclass(slots=True)
class Hit:
    """One page of a hash chain found in the pool: on the device (`page_id`), in a lower tier
    (`tier`), or neither (a gap: page_id -1, no tier)."""

    page_hash: bytes
    token_ids: tuple[int, ...]
    tier: PageTier | None
    page_id: int = -1

    @property
    def gap(self) -> bool:
        return self.page_id < 0 and self.tier is None


@dataclass(slots=True)
class Costs:
    """Running estimates to decide with: recompute time per token (measured by the executor
    on prefill-heavy steps) and load time per page from each lower tier, each the (lower)
    median of its last `RECENT` measurements, the first guess counted as one until pushed
    out."""

    recompute_s_per_token: float = 1e-3
    load_s_per_page: dict[str, float] = field(default_factory=dict)
    skipped: int = 0
    """Loads skipped in a row (`loads_pay`)."""
    _recent: dict[str, deque[float]] = field(default_factory=dict)

    def _median(self, key: str, first_guess: float, rate: float) -> float:
        recent = self._recent.setdefault(key, deque([first_guess], maxlen=RECENT))
        recent.append(rate)
        return statistics.median_low(recent)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        rate = seconds / max(num_tokens, 1)
        self.recompute_s_per_token = self._median("compute", self.recompute_s_per_token, rate)

    def observe_load(self, tier: str, num_pages: int, seconds: float) -> None:
        rate = seconds / max(num_pages, 1)
        self.load_s_per_page[tier] = self._median(tier, self.load_s_per_page[tier], rate)

    def loads_pay(self, tiers: list[str], tokens_per_page: int) -> bool:
        """Whether loading one page from each of `tiers` costs less than recomputing their
        tokens; every `REMEASURE_AFTER`-th refusal in a row says yes, to measure again."""
        load_s = sum(self.load_s_per_page[name] for name in tiers)
        if load_s <= len(tiers) * tokens_per_page * self.recompute_s_per_token:
            self.skipped = 0
            return True
        self.skipped += 1
        if self.skipped < REMEASURE_AFTER:
            return False
        self.skipped = 0
        return True


@dataclass(slots=True)
class Read:
    """Lower-tier pages read back (`KVPool.read`), waiting for the device pages to go to."""

    hits: list[Hit]
    kvs: list[PageKV]
    seconds: dict[str, float]


class KVPool:
    def __init__(
        self,
        cache: PagedCache,
        enable_prefix_caching: bool = True,
        cpu_pages: int = 0,
        ssd_dir: Path | None = None,
        ssd_pages: int = 0,
        digest: str = "",
        journal: Journal | None = None,
        follows: bool = False,
        remote: Pool | None = None,
        remote_pages: int = 0,
    ) -> None:
        """cache: the attention operator's KV, whose pages this pool hands out; cpu_pages /
        ssd_pages: capacities of the lower tiers (0: none); digest identifies the model and
        configuration whose KV this is (SSD pages of another digest or KV spec are ignored);
        journal: rank 0's under TP/PP, recording its page moves for the other ranks to
        mirror (`kv/mirror.py`); follows: a rank > 0's pool under TP/PP (it mirrors rank 0's
        moves, and never spills on its own); remote: the tier in a pool shared with other
        servers (a Mooncake Store client), below the others, of which this process lends
        `remote_pages` pages."""
        spec, num_pages = cache.spec, cache.num_pages
        self.cache, self.journal = cache, journal
        self.device = PagePool(num_pages, spec.page_size, enable_prefix_caching, self._demote)
        """The device pages: ids, ref counts, the LRU of free ones and the content index."""
        self.page_size = spec.page_size
        self.page_bytes = spec.page_bytes
        shape, n = spec.page_shape, spec.num_tensors
        pin = pin_host_memory(cache.device)
        self.cpu: HostTier | None = None
        if cpu_pages > 0 and journal is not None:
            self.cpu = JournaledHostTier(journal, cpu_pages, shape, spec.dtype, pin, n)
        elif cpu_pages > 0:
            self.cpu = HostTier(cpu_pages, shape, spec.dtype, pin, n)
        self.ssd = None
        layout = f"{FORMAT_VERSION}|{digest}|{spec.describe()}".encode()
        full_digest = hashlib.blake2b(layout, digest_size=16).hexdigest()
        self.layout_digest = full_digest
        """Identifies this KV's model, configuration and page layout: pages move only between
        pools of the same digest (the SSD tier's folder, the shared pool's keys, handoffs)."""
        if ssd_dir is not None and ssd_pages > 0:
            args = (ssd_dir, ssd_pages, shape, spec.dtype, full_digest, n)
            self.ssd = DiskTier(*args) if journal is None else JournaledDiskTier(journal, *args)
        self.remote = None
        if remote is not None:
            page = (shape, spec.dtype, full_digest, n)
            self.remote = RemoteTier(remote, remote_pages, *page, pool_key())
        tiers = (self.cpu, self.ssd, self.remote)
        self.lower: list[PageTier] = [t for t in tiers if t is not None]
        """The tiers below the device, fastest first."""
        self.stats = {"device": TierStats("device", num_pages, self.page_bytes)}
        for tier in self.lower:
            self.stats[tier.name] = TierStats(
                tier.name, tier.capacity, self.page_bytes, shared=tier.shared
            )
        # first guesses until measured: ~4 GB/s host copies, ~1 GB/s SSD reads
        # and ~1 GB/s plus a round trip from the shared pool
        self.costs = Costs(
            load_s_per_page={
                "cpu": self.page_bytes / 4e9,
                "ssd": self.page_bytes / 1e9,
                "remote": self.page_bytes / 1e9 + 5e-4,
            }
        )
        self.follows = follows
        self.agree: Callable[[list[bytes], int], int] | None = None
        """Under TP/PP, rank 0's: sends the SSD pages it read to every rank, returns how many
        leading ones every rank read (`kv/mirror.py`)."""
        self.agreed: dict[bytes, PageKV] = {}
        """Ranks > 0: the SSD pages agreed on, until the journal writes them into the device."""
        self.received: dict[str, list[PageKV]] = {}
        """Ranks > 0: their share of pages another server sent (a handoff, by key), until the
        journal writes them into the device (`executor/kv_shares.py`)."""
        self._spilled = False
        self._spilled_hashes: list[bytes] = []
        """The pages the spill queued for the SSD (close reports how many it kept)."""
        self.num_swap_ins = 0
        self.events: KVEventLog | None = None
        """Pages stored into and removed from each tier's index, when someone listens (the
        engine sets it where KV events are published: `kv/events.py`)."""
        self._pressure = dict.fromkeys(self.stats, 0)  # pages pushed out since last log
        self._pressure_logged = time.monotonic()
        self._copier = (
            ThreadPoolExecutor(1, "pypto-kv-offload", initializer=background_priority)
            if self.cpu is not None and journal is None
            else None
        )
        """Copies freed pages to the CPU tier in the background (`_back_up`)."""
        self._copies: dict[int, Future[None]] = {}
        """Device pages a background copy is still reading."""
        self._backups: dict[bytes, None] = {}
        """The CPU tier's copies of pages the device holds still (`_back_up`), in the order
        they were freed (the order the device will reuse them)."""
        self._closed = False

    @property
    def num_pages(self) -> int:
        return self.device.num_pages

    @property
    def num_free(self) -> int:
        return self.device.num_free

    @property
    def prefix_caching(self) -> bool:
        return self.device.enable_prefix_caching

    def usage(self) -> float:
        """Fraction of device pages held (cached free pages count as free)."""
        return 1.0 - self.device.num_free / max(self.device.num_pages, 1)

    def describe(self) -> str:
        """The tiers and their budgets, for the start-up log."""
        parts = [f"device {self.num_pages} pages x {self.page_size} tokens"]
        parts += [f"{t.name} {t.capacity} pages" for t in self.lower]
        if self.ssd is not None:
            parts[-1] += f" in {self.ssd.dir} ({self.ssd.num_found} from earlier runs)"
            if self.ssd.off is not None:
                parts[-1] += f", off: {self.ssd.off}"
        return f"{'; '.join(parts)}; {self.page_bytes / 2**20:.2f} MiB per page"

    def tier_stats(self) -> list[TierStats]:
        """A snapshot of every tier's counters, with its current occupancy."""
        used = {"device": self.device.num_pages - self.device.num_free}
        used |= {t.name: len(t) for t in self.lower}
        snapshot = {
            name: replace(s, used=used[name], load_buckets=list(s.load_buckets))
            for name, s in self.stats.items()
        }
        if self.ssd is not None:
            snapshot["ssd"].errors = self.ssd.num_errors
            snapshot["ssd"].rejected = self.ssd.num_unreadable
        if self.remote is not None:
            snapshot["remote"].errors = self.remote.num_errors
            snapshot["remote"].rejected = self.remote.num_rejected
            snapshot["remote"].stored = self.remote.num_written  # written through, not pushed
        return list(snapshot.values())

    def close(self) -> None:
        """Keep what the faster tiers cache on the SSD tier (`spill`), then let it finish its
        queued writes and say how many pages it kept. Called on a clean shutdown; idempotent."""
        self._closed = True
        self.keep_on_ssd()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        for tier in self.lower:
            tier.close()
        self._report_spill()

    def keep_on_ssd(self) -> None:
        """Spill once, on a clean shutdown (not on a rank that mirrors rank 0's moves: it
        replays rank 0's spill)."""
        if self.ssd is not None and not self._spilled and not self.follows:
            self.spill()
        self._spilled = True

    def spill(self) -> int:
        """Store the cached pages of the device and the CPU tier on the SSD tier, so a restart
        on the same directory finds them; returns how many were queued (their writes may
        fail: `close` reports what was kept). Least recently used first (the device's pages
        are the most recent), and only as many as the SSD budget holds: the SSD tier's own
        oldest pages make room for them."""
        assert self.ssd is not None
        pages: list[tuple[bytes, tuple[int, ...], PageTier | int]] = []
        if self.cpu is not None:
            pages += [(h, t, self.cpu) for h in self.cpu.hashes() if (t := self.cpu.tokens(h))]
        on_cpu = {h for h, _, _ in pages}  # a device page's copy there is the same page
        pages += [(h, t, p) for h, t, p in self.device.cached_pages() if h not in on_cpu]
        pages = pages[max(len(pages) - self.ssd.capacity, 0) :]
        for page_hash, token_ids, where in pages:
            kv = self._page_kv(where) if isinstance(where, int) else where.load(page_hash)
            if kv is not None and self.ssd.tokens(page_hash) is None:
                self._push(self.lower.index(self.ssd), page_hash, token_ids, kv)
        self._spilled_hashes = [page_hash for page_hash, _, _ in pages]
        return len(pages)

    def _report_spill(self) -> None:
        """Log how many of the pages `spill` queued are on the SSD now that its writes are
        done (a write that failed, e.g. a read-only disk, dropped its page), once."""
        spilled, self._spilled_hashes = self._spilled_hashes, []
        if not spilled or self.ssd is None:
            return
        kept = sum(self.ssd.tokens(h) is not None for h in spilled)
        if kept:
            log.info("kept %d cached KV pages on the SSD tier for the next start", kept)
        if kept < len(spilled):
            log.warning(
                "could not keep %d of %d cached KV pages on the SSD tier for the next start: "
                "writing them failed (%d SSD I/O errors in all)",
                len(spilled) - kept,
                len(spilled),
                self.ssd.num_errors,
            )

    # --- device pages: what the kinds' managers allocate and free ---------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` device pages from the LRU head (a cached one's KV demoted first), each held
        once; raises ValueError, changing nothing, if fewer are free."""
        page_ids = self.device.allocate(n)
        if n:
            self._log_pressure()
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Drop one reference to each page; those at 0 join the LRU tail in the order given,
        and a cached one is copied to the CPU tier (`_back_up`)."""
        page_ids = list(page_ids)
        self.device.free(page_ids)
        if self.cpu is None:
            return
        for page_id in page_ids:
            if self.device.ref_count(page_id) == 0:
                self._back_up(page_id)

    def acquire(self, page_ids: Iterable[int]) -> None:
        """One more reference to each (indexed) device page, as a hit shares it."""
        self.device.acquire(list(page_ids))

    # --- the content index, across the tiers ------------------------------------------------

    def locate(
        self, chain: Iterable[tuple[bytes, tuple[int, ...]]], gaps: bool = False
    ) -> tuple[list[Hit], Counter[tuple[str, str]]]:
        """Where each page of a hash chain is, tier by tier, stopping at the first page no
        tier holds (gaps: going on past it, a gap `Hit` in its place), and the hits and
        misses per tier (for `count`, once the claim they made stands). Changes nothing but
        the shared pool's probe cache."""
        hits: list[Hit] = []
        counts: Counter[tuple[str, str]] = Counter()
        if not self.prefix_caching:
            return hits, counts
        pages, probed = iter(chain), self.remote is None
        while (page := next(pages, None)) is not None:
            page_hash, token_ids = page
            page_id = self.device.get(page_hash, token_ids)
            if page_id is not None:
                hits.append(Hit(page_hash, token_ids, None, page_id))
                counts["device", "hits"] += 1
                continue
            counts["device", "misses"] += 1
            if not probed:  # one question to the shared pool for the rest of the chain
                assert self.remote is not None
                rest = [page, *pages]
                self.remote.probe(rest)
                pages, probed = iter(rest[1:]), True
            for tier in self.lower:
                if tier.tokens(page_hash) == token_ids:
                    hits.append(Hit(page_hash, token_ids, tier))
                    counts[tier.name, "hits"] += 1
                    break
                counts[tier.name, "misses"] += 1
            else:
                if not gaps:
                    break
                hits.append(Hit(page_hash, token_ids, None))
        return hits, counts

    def count(self, counts: Counter[tuple[str, str]]) -> None:
        """Add a lookup's hits and misses to the tiers' counters."""
        for (name, kind), n in counts.items():
            stats = self.stats[name]
            setattr(stats, kind, getattr(stats, kind) + n)

    def loads_pay(self, hits: list[Hit], tokens_per_page: int) -> bool:
        """Whether reading the lower-tier hits back costs less than recomputing their tokens
        (`tokens_per_page` each) at the measured rates."""
        lower = [h.tier.name for h in hits if h.tier is not None]
        return not lower or self.costs.loads_pay(lower, tokens_per_page)

    def read(self, hits: list[Hit]) -> Read:
        """Read the lower-tier hits back, in order, up to the first unreadable one (e.g. a
        corrupted SSD file); `write` then puts them in device pages. A read page leaves the
        tier (it moves up)."""
        read = Read([], [], dict.fromkeys(self.costs.load_s_per_page, 0.0))
        start = time.perf_counter()
        agreed = self._agree_ssd(hits) if self.agree is not None else None
        read.seconds["ssd"] = time.perf_counter() - start
        for h in hits:
            if (tier := h.tier) is None:
                continue
            name, start = tier.name, time.perf_counter()
            if agreed is not None and tier is self.ssd:  # read already, on every rank
                kv = agreed.pop(h.page_hash, None)
                if kv is not None and self.journal is not None:
                    self.journal.record("ssd_load", h.page_hash.hex())
                    self.journal.produced(kv)
            else:
                kv = tier.load(h.page_hash)
            read.seconds[name] += time.perf_counter() - start
            if self.events is not None:  # a load moves the page up (or drops a bad one)
                self.events.removed(name, h.page_hash)
            if kv is None:
                break
            read.hits.append(h)
            read.kvs.append(kv)
        return read

    def write(self, read: Read, page_ids: list[int], parents: dict[bytes, bytes]) -> None:
        """Put the pages `read` read into device pages `page_ids` (allocated by the manager,
        one each), indexed there (`parents`: each page's parent hash in its chain)."""
        if not read.hits:
            return
        start = time.perf_counter()
        for h, kv, page_id in zip(read.hits, read.kvs, page_ids, strict=True):
            self._write_page(page_id, kv)
            h.page_id = page_id
            self.index(page_id, h.page_hash, h.token_ids, parents.get(h.page_hash))
        copy_s_per_page = (time.perf_counter() - start) / len(read.hits)
        pages = Counter(h.tier.name for h in read.hits if h.tier is not None)
        for name, n in pages.items():
            total = read.seconds[name] + n * copy_s_per_page
            self.stats[name].loaded += n
            self.stats[name].observe_load(total)
            self.costs.observe_load(name, n, total)
        self.stats["device"].stored += len(read.hits)

    def _agree_ssd(self, hits: list[Hit]) -> dict[bytes, PageKV]:
        """Under TP/PP: read the SSD hits (up to the first unreadable one) and keep the
        leading ones every rank read too (the rest: misses)."""
        assert self.agree is not None and self.ssd is not None
        hashes = [h.page_hash for h in hits if h.tier is self.ssd]
        if not hashes:
            return {}
        kvs: list[tuple[bytes, PageKV]] = []
        for page_hash in hashes:
            kv = self.ssd.load(page_hash)
            if kv is None:
                break
            kvs.append((page_hash, kv))
        return dict(kvs[: self.agree(hashes, len(kvs))])

    def index(
        self, page_id: int, page_hash: bytes, token_ids: tuple[int, ...], parent: bytes | None
    ) -> None:
        """Index a held device page whose KV is complete under its chain hash (the first page
        indexed under a hash stays canonical); the copies below give way to it, and the shared
        pool gets it written through."""
        if not self.device.cache_page(page_id, page_hash, token_ids):
            return
        if self.events is not None:
            self.events.stored("device", page_hash, parent, token_ids)
        for tier in self.lower:  # the device copy is canonical now: one place per hash
            if tier.discard(page_hash) and self.events is not None:
                self.events.removed(tier.name, page_hash)
        if self.remote is not None:  # write-through (nothing if the pool holds it already)
            self.remote.store(page_hash, token_ids, self._page_kv(page_id))

    # --- swaps: device pages held in CPU slots under a key ----------------------------------

    def can_hold(self, num_pages: int) -> bool:
        """Whether the CPU tier has room to hold `num_pages` swapped-out pages."""
        return self.cpu is not None and self.cpu.capacity - self.cpu.num_held >= num_pages

    def swap_pays(self, num_pages: int, num_tokens: int) -> bool:
        """Whether moving `num_pages` out and back costs less than recomputing `num_tokens`."""
        out_and_back = 2 * num_pages * self.costs.load_s_per_page["cpu"]
        return out_and_back < num_tokens * self.costs.recompute_s_per_token

    def hold(self, key: str, page_ids: list[int]) -> None:
        """Copy device pages into CPU slots held under `key` (the caller checked `can_hold`),
        pushing the tier's cached pages down to make room."""
        assert self.cpu is not None
        self._make_room(0, len(page_ids))
        self.cpu.hold(key, [self._page_kv(p) for p in page_ids])
        self.stats["cpu"].stored += len(page_ids)

    def take_held(self, key: str) -> list[PageKV]:
        """The pages held under `key`, their slots given back (`write_held` puts them back)."""
        assert self.cpu is not None
        return self.cpu.release(key)

    def write_held(self, kvs: list[PageKV], page_ids: list[int], started: float) -> None:
        """Write pages taken back (`take_held` at `started`, a perf_counter time) into device
        pages `page_ids`."""
        for page_id, kv in zip(page_ids, kvs, strict=True):
            self._write_page(page_id, kv)
        seconds = time.perf_counter() - started
        self.stats["cpu"].loaded += len(kvs)
        self.stats["cpu"].observe_load(seconds)
        self.stats["device"].stored += len(kvs)
        self.costs.observe_load("cpu", len(kvs), seconds)
        self.num_swap_ins += 1

    def write_received(self, key: str, kvs: list[PageKV], page_ids: list[int]) -> None:
        """Write pages another server sent (a handoff, held under `key`) into device pages
        `page_ids` (under TP/PP every rank writes its share, held under the same key)."""
        if self.journal is not None:
            self.journal.record("received", key)
            for kv in kvs:
                self.journal.produced(kv)
        for page_id, kv in zip(page_ids, kvs, strict=True):
            self._write_page(page_id, kv)
        self.stats["device"].stored += len(kvs)

    def drop_received(self, key: str) -> None:
        """Forget pages another server sent that no device page took (the request went
        away, or recomputes): under TP/PP every rank forgets its share."""
        if self.journal is not None:
            self.journal.record("drop_received", key)

    def drop_held(self, key: str) -> None:
        """Forget the pages held under `key`."""
        assert self.cpu is not None
        self.cpu.release(key)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A prefill-heavy step computed `num_tokens` tokens in `seconds`: what recomputing
        costs, against which loads and swaps are weighed."""
        self.costs.observe_compute(num_tokens, seconds)

    # --- page data ------------------------------------------------------------------------

    def _page_kv(self, page_id: int) -> PageKV:
        """Views of one device page's tensors, read through the operator that owns them."""
        kv = self.cache.read_page(page_id)
        if self.journal is not None:
            self.journal.record("read", page_id)
            self.journal.produced(kv)
        return kv

    def _write_page(self, page_id: int, kv: PageKV) -> None:
        if self.journal is not None:
            self.journal.record("write", page_id, self.journal.handle(kv))
        self.cache.write_page(page_id, kv)

    # --- demotion: device -> cpu -> ssd -> dropped ------------------------------------------

    def _back_up(self, page_id: int) -> None:
        """A cached device page no request holds: copy it to the CPU tier now (in the
        background where no other rank mirrors this pool), unless a copy is there already."""
        page_hash, token_ids = self.device.page_hash(page_id), self.device.page_tokens(page_id)
        if page_hash is None or token_ids is None or self.cpu is None or self._closed:
            return
        if self.cpu.tokens(page_hash) is not None or self.cpu.num_free == 0:
            return
        if self._copier is None:
            self.cpu.store(page_hash, token_ids, self._page_kv(page_id))
        else:
            if len(self._copies) > 2 * self.num_pages:  # forget the finished ones
                self._copies = {p: c for p, c in self._copies.items() if not c.done()}
            kv = self.cache.read_page(page_id)
            self._copies[page_id] = self.cpu.store_later(page_hash, token_ids, kv, self._copier)
        self._backups[page_hash] = None
        self.stats["cpu"].stored += 1
        if self.events is not None:
            self.events.stored("cpu", page_hash, None, token_ids)

    def _demote(self, page_id: int, page_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """The device is reusing a cached page: its KV is kept in the first lower tier (the
        CPU tier has it already where it was copied when freed)."""
        self.stats["device"].evicted += 1
        self._pressure["device"] += 1
        if self.events is not None:
            self.events.removed("device", page_hash)
        copy = self._copies.pop(page_id, None)
        if copy is not None:  # the page is about to be overwritten: its copy must be done
            copy.result()
        backed_up = self._backups.pop(page_hash, 0) is None
        if backed_up and self.cpu is not None and self.cpu.tokens(page_hash) == token_ids:
            return  # the CPU tier's copy is the page now
        if self.lower:
            self._push(0, page_hash, token_ids, self._page_kv(page_id))

    def _push(self, level: int, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        """Store a cached page in lower tier `level`, pushing that tier's LRU pages one tier
        further down (or dropping them from the last) to make room."""
        tier = self.lower[level]
        if not self._make_room(level, 1):
            return  # every place is held by swapped pages: the page is dropped
        tier.store(page_hash, token_ids, kv)
        self.stats[tier.name].stored += 1
        if self.events is not None:
            self.events.stored(tier.name, page_hash, None, token_ids)

    def _make_room(self, level: int, num_pages: int) -> bool:
        """Free `num_pages` places in lower tier `level`: first dropping copies of pages the
        device still holds (the CPU tier's, `_back_up`), then pushing its LRU pages one tier
        down (dropped from the last); False if held pages fill it."""
        tier = self.lower[level]
        if tier is self.remote:
            return True  # the shared pool's master evicts
        while tier is self.cpu and tier.capacity - len(tier) < num_pages and self._backups:
            copy = next(reversed(self._backups))  # the device reuses it last: its copy goes
            del self._backups[copy]
            tier.discard(copy)
            if self.events is not None:
                self.events.removed(tier.name, copy)
        while tier.capacity - len(tier) < num_pages:
            victim = tier.lru_hash()
            if victim is None:
                return False
            self.stats[tier.name].evicted += 1
            self._pressure[tier.name] += 1
            if self.events is not None:
                self.events.removed(tier.name, victim)
            token_ids = tier.tokens(victim)
            if level + 1 == len(self.lower) or token_ids is None:
                tier.discard(victim)
                continue
            kv = tier.load(victim)
            if kv is not None:
                self._push(level + 1, victim, token_ids, kv)
        return True

    def _log_pressure(self) -> None:
        now = time.monotonic()
        if now - self._pressure_logged < PRESSURE_LOG_INTERVAL_S or not any(
            self._pressure.values()
        ):
            return
        moved = self._pressure
        names = ["device", *(t.name for t in self.lower)]
        steps = [f"{a}->{b} {moved[a]}" for a, b in itertools.pairwise(names)]
        steps.append(f"dropped from {names[-1]} {moved[names[-1]]}")
        occupancy = ", ".join(
            f"{s.name} {s.used} pages known" if s.usage is None else f"{s.name} {s.usage:.0%}"
            for s in self.tier_stats()
        )
        log.info(
            "KV tier pressure (last %.0fs), pages: %s; occupancy: %s",
            now - self._pressure_logged,
            ", ".join(steps),
            occupancy,
        )
        self._pressure = dict.fromkeys(moved, 0)
        self._pressure_logged = now
