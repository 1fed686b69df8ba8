"""The paged KV store, the pool side of the KV: pages per request, prefix reuse across tiers,
swaps.

It knows pages, not layers or heads: which device pages each request holds (`tables`), the
prefix index over full pages, and the tiers below the device. The KV itself belongs to the
attention operator (`paged_cache.PagedCache`, allocated from its kind's `KVSpec`), which
computes its block tables and slot mappings from the page lists; the store reads and writes a
page's bytes only through it (`read_page`, `write_page`), so a page of any kind (GQA's K and
V, MLA's one latent tensor) moves between tiers alike. The scheduler asks it capacity
questions (`num_cached_tokens`, `allocate`, `free`, `preempt`).

Tiers (the Mooncake way): the device pool, then optionally CPU memory, then optionally SSD,
then optionally a pool shared with other servers (`remote_tier.py`, a Mooncake Store).
One index across the local tiers maps a page hash to exactly one place (placement is
exclusive among them); the shared pool is not exclusive: every page computed on the device is
written to it too (write-through), and a hit there copies the page and leaves it for others:

    device ──a cached page's slot is reused──▶ cpu ──cpu full: its LRU page──▶ ssd ──▶ dropped
       ▲                                          │                            │
       └────── prefix hit at admission: loaded back (and removed below) ──────┘

At admission the request's hash chain is looked up tier by tier, page by page. A device hit
is shared; a CPU or SSD hit is copied into fresh device pages before the request computes,
unless loading would take longer than recomputing (measured rates). A request preempted by
swap keeps its computed KV in held CPU slots and gets it back when it resumes.

Device page lifecycle (prefix caching on):

    free (LRU) ──allocate──▶ owned by a request ──filled──▶ full page: hashed, indexed
        ▲                                                         │ other requests with the
        │  evicted lazily: when allocate reuses the page,         │ same prefix acquire it
        │  its KV is demoted to the next tier                     ▼ (ref count > 1)
        └───────────────── ref count reaches 0: back to the LRU tail, still indexed
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from pypto_serving.device import pin_host_memory
from pypto_serving.kv.disk_tier import DiskTier
from pypto_serving.kv.events import KVEvent, KVEventLog
from pypto_serving.kv.host_tier import HostTier
from pypto_serving.kv.mirror import Journal, JournaledDiskTier, JournaledHostTier
from pypto_serving.kv.mooncake_pool import Pool, pool_key
from pypto_serving.kv.page_pool import PagePool, hash_page
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.remote_tier import RemoteTier
from pypto_serving.kv.tier import PageKV, PageTier, TierStats
from pypto_serving.request import Request

log = logging.getLogger(__name__)

PRESSURE_LOG_INTERVAL_S = 10.0
EMA = 0.2
"""Weight of the newest measurement in the running cost estimates."""
FORMAT_VERSION = "2"
"""Bumped when the KV layout of a page changes (old SSD pages then become foreign)."""


@dataclass(slots=True)
class PageTable:
    """A request's pages, and the hash chain of its leading full pages that are cached. A
    store that keeps only a window of recent tokens (`release_before`) leaves -1 in place of
    the leading pages it gave back (`released` of them)."""

    pages: list[int]
    hashes: list[bytes]
    released: int = 0
    sources: list[str] = field(default_factory=list, compare=False)
    """Where each page of the admission's prefix claim came from ("device", "cpu", "ssd";
    "" for a page left out)."""


@dataclass(slots=True)
class _Hit:
    """One page of a prefix found at admission: on the device (page_id) or in a lower tier."""

    page_hash: bytes
    token_ids: tuple[int, ...]
    tier: PageTier | None
    page_id: int = -1


@dataclass(slots=True)
class _Swapped:
    """A request preempted by swap: its computed tokens, full pages' hashes, and how many
    leading pages it had released (held as -1, not swapped)."""

    num_tokens: int
    hashes: list[bytes]
    released: int = 0


@dataclass(slots=True)
class Costs:
    """Running estimates the store decides with: recompute time per token (measured by the
    executor on prefill-heavy steps) and load time per page from each lower tier."""

    recompute_s_per_token: float = 1e-3
    load_s_per_page: dict[str, float] = field(default_factory=dict)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        rate = seconds / max(num_tokens, 1)
        self.recompute_s_per_token += EMA * (rate - self.recompute_s_per_token)

    def observe_load(self, tier: str, num_pages: int, seconds: float) -> None:
        rate, old = seconds / max(num_pages, 1), self.load_s_per_page[tier]
        self.load_s_per_page[tier] = old + EMA * (rate - old)


def _window_end(hits: list[_Hit], span: int) -> int:
    """The longest prefix of `hits` whose last `span` pages are all held somewhere (a gap is
    a hit with page_id -1 and no tier): what a sliding window needs of a prefix."""
    end = len(hits)
    while end > 0 and any(h.page_id < 0 and h.tier is None for h in hits[max(end - span, 0) : end]):
        end -= 1
    return end


class PagedKVStore:
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
        """cache: the attention operator's KV, whose pages this store hands out; cpu_pages /
        ssd_pages: capacities of the lower tiers (0: none); digest identifies the model and
        configuration whose KV this is (SSD pages of another digest or KV spec are ignored);
        journal: rank 0's under TP/PP, recording its page moves for the other ranks to
        mirror (`kv/mirror.py`); follows: a rank > 0's store under TP/PP (it mirrors rank 0's
        moves, and never spills on its own); remote: the tier in a pool shared with other
        servers (a Mooncake Store client), below the others, of which this process lends
        `remote_pages` pages."""
        spec, num_pages = cache.spec, cache.num_pages
        self.cache, self.journal = cache, journal
        self.pool = PagePool(num_pages, spec.page_size, enable_prefix_caching, self._demote)
        self.page_size = spec.page_size
        self.tables: dict[str, PageTable] = {}
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
        self.swapped: dict[str, _Swapped] = {}
        self.follows = follows
        self.agree: Callable[[list[bytes], int], int] | None = None
        """Under TP/PP, rank 0's: sends the SSD pages it read to every rank, returns how many
        leading ones every rank read (`kv/mirror.py`)."""
        self.agreed: dict[bytes, PageKV] = {}
        """Ranks > 0: the SSD pages agreed on, until the journal writes them into the device."""
        self._spilled = False
        self._spilled_hashes: list[bytes] = []
        """The pages the spill queued for the SSD (close reports how many it kept)."""
        self._closed = False
        self._lookups: dict[str, Counter[tuple[str, str]]] = {}
        """Hits and misses of a claim, counted once its request is admitted (allocate)."""
        self.num_swap_ins = 0
        self.events: KVEventLog | None = None
        """Pages stored into and removed from each tier's index, when someone listens (the
        engine sets it where KV events are published: `kv/events.py`)."""
        self._pressure = dict.fromkeys(self.stats, 0)  # pages pushed out since last log
        self._pressure_logged = time.monotonic()

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def usage(self) -> float:
        """Fraction of device pages held by requests (cached-free pages count as free)."""
        return 1.0 - self.pool.num_free / max(self.pool.num_pages, 1)

    def describe(self) -> str:
        """The tiers and their budgets, for the start-up log."""
        parts = [f"device {self.num_pages} pages x {self.page_size} tokens"]
        parts += [f"{t.name} {t.capacity} pages" for t in self.lower]
        if self.ssd is not None:
            parts[-1] += f" in {self.ssd.dir} ({self.ssd.num_found} from earlier runs)"
            if self.ssd.off is not None:
                parts[-1] += f", off: {self.ssd.off}"
        return f"KV tiers: {'; '.join(parts)}; {self.page_bytes / 2**20:.2f} MiB per page"

    def tier_stats(self) -> list[TierStats]:
        """A snapshot of every tier's counters, with its current occupancy."""
        used = {"device": self.pool.num_pages - self.pool.num_free}
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
        self.keep_on_ssd()
        self._closed = True
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
        pages += [(h, t, page_id) for h, t, page_id in self.pool.cached_pages()]
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

    def _demote(self, page_id: int, page_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """The pool is reusing a cached page: keep its KV in the first lower tier."""
        self.stats["device"].evicted += 1
        self._pressure["device"] += 1
        if self.events is not None:
            self.events.removed("device", page_hash)
        if self.lower:
            self._push(0, page_hash, token_ids, self._page_kv(page_id))

    def _push(self, level: int, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        """Store a cached page in lower tier `level`, pushing that tier's LRU pages one tier
        further down (or dropping them from the last) to make room."""
        tier = self.lower[level]
        if not self._make_room(level, 1):
            return  # every place is held by swapped requests: the page is dropped
        tier.store(page_hash, token_ids, kv)
        self.stats[tier.name].stored += 1
        if self.events is not None:
            self.events.stored(tier.name, page_hash, None, token_ids)

    def _make_room(self, level: int, num_pages: int) -> bool:
        tier = self.lower[level]
        if tier is self.remote:
            return True  # the shared pool's master evicts
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

    def _cache_on_device(
        self, page_id: int, page_hash: bytes, token_ids: tuple[int, ...], parent: bytes | None
    ) -> None:
        if not self.pool.cache_page(page_id, page_hash, token_ids):
            return
        if self.events is not None:
            self.events.stored("device", page_hash, parent, token_ids)
        for tier in self.lower:  # the device copy is canonical now: one place per hash
            if tier.discard(page_hash) and self.events is not None:
                self.events.removed(tier.name, page_hash)
        if self.remote is not None:  # write-through (nothing if the pool holds it already)
            self.remote.store(page_hash, token_ids, self._page_kv(page_id))

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

    # --- capacity questions from the scheduler -------------------------------------------

    def num_cached_tokens(
        self, request: Request, limit: int | None = None, window: int | None = None
    ) -> int | None:
        """Claim the longest prefix of the request's tokens whose KV any tier holds (loading
        lower-tier pages into the device), leaving at least the last token to compute (its
        logits are needed), and at most `limit` tokens (for a request that wants prompt
        logprobs, none past the positions scored so far); a request preempted by swap gets its
        KV back. With `window`, only the pages holding the prefix's last `window` tokens need
        to be cached, and only they are claimed (the ones before are left out, -1). Returns
        the tokens covered, or None when a swapped request's KV does not fit the device yet."""
        if request.request_id in self.swapped:
            return self._swap_in(request)
        if request.params.prompt_logprobs is not None:  # no hit past the positions scored
            scored = len(request.prompt_logprobs)
            limit = scored if limit is None else min(limit, scored)
        span = None if window is None else -(-window // self.page_size)
        hits = self._lookup(request, limit, gaps=span is not None)
        if span is not None:  # the window's pages, and gaps (page_id -1, no tier) before it
            end = _window_end(hits, span)
            gaps = [_Hit(h.page_hash, h.token_ids, None) for h in hits[: max(end - span, 0)]]
            hits = gaps + hits[len(gaps) : end]
        hits = self._affordable(hits)
        self.pool.acquire([h.page_id for h in hits if h.tier is None and h.page_id >= 0])
        lower = [i for i, h in enumerate(hits) if h.tier is not None]
        if len(lower) > self.pool.num_free:  # no room to load them all: keep what fits
            hits = self._cut(hits, lower[self.pool.num_free])
        hits = self._load(hits)
        if span is not None:  # a cut above may have left a gap inside the window
            end = _window_end(hits, span)
            self.pool.free([h.page_id for h in reversed(hits[end:]) if h.page_id >= 0])
            hits = hits[:end]
        released = sum(h.page_id < 0 and h.tier is None for h in hits)
        sources = [""] * released + [
            h.tier.name if h.tier is not None else "device" for h in hits[released:]
        ]
        table = PageTable([h.page_id for h in hits], [h.page_hash for h in hits], released, sources)
        self.tables[request.request_id] = table
        if request.num_preemptions == 0:  # the first admission's breakdown is what users see
            request.cached_tokens_by_tier = self._by_tier(sources)
        self._log_pressure()
        return len(hits) * self.page_size

    def _by_tier(self, sources: list[str]) -> dict[str, int]:
        """Tokens of a claim per tier it came from."""
        counts = Counter(name for name in sources if name)
        return {name: n * self.page_size for name, n in counts.items()}

    def _lookup(self, request: Request, limit: int | None = None, gaps: bool = False) -> list[_Hit]:
        """The cached pages of the request's prefix, tier by tier, and the hits and misses
        (counted into the tiers' stats if the request is admitted). gaps: go on past a page
        no tier holds (a `_Hit` with page_id -1 and no tier stands for it)."""
        hits: list[_Hit] = []
        counts: Counter[tuple[str, str]] = Counter()
        self._lookups[request.request_id] = counts
        if not self.pool.enable_prefix_caching:
            return hits
        tokens, ps = request.token_ids, self.page_size
        end = len(tokens) - ps if limit is None else min(len(tokens) - ps, limit - ps + 1)

        def hashed() -> Iterator[tuple[bytes, tuple[int, ...]]]:
            """The prompt's full pages and their chain hashes, hashed as the walk asks."""
            parent = None
            for start in range(0, end, ps):  # `- ps`: the last token stays out
                chunk = tuple(tokens[start : start + ps])
                parent = hash_page(parent, chunk, request.cache_salt)
                yield parent, chunk

        chain, probed = hashed(), self.remote is None
        while (page := next(chain, None)) is not None:
            parent, chunk = page
            page_id = self.pool.get(parent, chunk)
            if page_id is not None:
                hits.append(_Hit(parent, chunk, None, page_id))
                counts["device", "hits"] += 1
                continue
            counts["device", "misses"] += 1
            if not probed:  # one question to the shared pool for the rest of the prompt
                assert self.remote is not None
                rest = [page, *chain]
                self.remote.probe(rest)
                chain, probed = iter(rest[1:]), True
            for tier in self.lower:
                if tier.tokens(parent) == chunk:
                    hits.append(_Hit(parent, chunk, tier))
                    counts[tier.name, "hits"] += 1
                    break
                counts[tier.name, "misses"] += 1
            else:
                if not gaps:
                    break
                hits.append(_Hit(parent, chunk, None))
        return hits

    def _affordable(self, hits: list[_Hit]) -> list[_Hit]:
        """The hits, cut before the first lower-tier page if loading them all would take
        longer than recomputing them."""
        lower = [h for h in hits if h.tier is not None]
        load_s = sum(self.costs.load_s_per_page[h.tier.name] for h in lower if h.tier)
        if load_s <= len(lower) * self.page_size * self.costs.recompute_s_per_token:
            return hits
        first = next(i for i, h in enumerate(hits) if h.tier is not None)
        return hits[:first]

    def _cut(self, hits: list[_Hit], end: int) -> list[_Hit]:
        """Keep hits[:end]; release the device pages acquired beyond it."""
        self.pool.free(
            [h.page_id for h in reversed(hits[end:]) if h.tier is None and h.page_id >= 0]
        )
        return hits[:end]

    def _load(self, hits: list[_Hit]) -> list[_Hit]:
        """Copy the lower-tier hits into fresh device pages (stopping at an unreadable page)."""
        loaded: list[tuple[_Hit, PageKV]] = []
        seconds: dict[str, float] = dict.fromkeys(self.costs.load_s_per_page, 0.0)
        start = time.perf_counter()
        agreed = self._agree_ssd(hits) if self.agree is not None else None
        seconds["ssd"] = time.perf_counter() - start
        for i, h in enumerate(hits):
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
            seconds[name] += time.perf_counter() - start
            if self.events is not None:  # a load moves the page up (or drops a bad one)
                self.events.removed(name, h.page_hash)
            if kv is None:  # e.g. a corrupted SSD file: a miss from here on
                hits = self._cut(hits, i)
                break
            loaded.append((h, kv))
        if not loaded:
            return hits
        start = time.perf_counter()
        parents = {h.page_hash: p.page_hash for p, h in itertools.pairwise(hits)}
        for (h, kv), page_id in zip(loaded, self.pool.allocate(len(loaded)), strict=True):
            self._write_page(page_id, kv)
            h.page_id = page_id
            self._cache_on_device(page_id, h.page_hash, h.token_ids, parents.get(h.page_hash))
        copy_s_per_page = (time.perf_counter() - start) / len(loaded)
        pages = Counter(h.tier.name for h, _ in loaded)  # type: ignore[union-attr]
        for name, n in pages.items():
            total = seconds[name] + n * copy_s_per_page
            self.stats[name].loaded += n
            self.stats[name].observe_load(total)
            self.costs.observe_load(name, n, total)
        self.stats["device"].stored += len(loaded)
        return hits

    def _agree_ssd(self, hits: list[_Hit]) -> dict[bytes, PageKV]:
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

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        """Device pages `allocate(request, num_new_tokens)` would take."""
        table = self.tables.get(request.request_id)
        total = request.num_computed_tokens + num_new_tokens
        return max(-(-total // self.page_size) - (len(table.pages) if table else 0), 0)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request pages for `num_new_tokens` more tokens; False if there are too few."""
        table = self.tables.get(request.request_id) or PageTable([], [])
        needed = self.pages_needed(request, num_new_tokens)
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            table.pages += self.pool.allocate(needed)
            self._log_pressure()
        self.tables[request.request_id] = table
        for (name, kind), n in self._lookups.pop(request.request_id, Counter()).items():
            stats = self.stats[name]
            setattr(stats, kind, getattr(stats, kind) + n)
        return True

    def free(self, request: Request) -> None:
        """Release the request's device pages; a finished request's swapped KV goes too."""
        self._lookups.pop(request.request_id, None)
        table = self.tables.pop(request.request_id, None)
        if table is not None:  # tail pages first into the LRU, so they are evicted first
            self.pool.free(table.pages[table.released :][::-1])
        if request.finished:
            self.drop_swap(request)

    def drop_swap(self, request: Request) -> None:
        """Forget the request's swapped KV (if any): it recomputes instead."""
        if self.swapped.pop(request.request_id, None) is not None:
            assert self.cpu is not None
            self.cpu.release(request.request_id)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the claimed pages that cover the request's first `num_tokens` tokens (a
        claim cut back to what another store of the same KV holds)."""
        table = self.tables[request.request_id]
        keep = num_tokens // self.page_size
        self.pool.free([p for p in table.pages[keep:][::-1] if p >= 0])
        del table.pages[keep:], table.hashes[keep:]
        del table.sources[keep:]
        if request.num_preemptions == 0:
            request.cached_tokens_by_tier = self._by_tier(table.sources)

    def release_before(self, request: Request, num_tokens: int) -> None:
        """Give back the request's full pages that lie wholly before token `num_tokens` (a
        sliding window moved past them): they stay cached, to the LRU like a freed page's."""
        table = self.tables.get(request.request_id)
        end = min(num_tokens // self.page_size, len(table.pages)) if table else 0
        if table is None or end <= table.released:
            return
        self.pool.free(table.pages[table.released : end])
        table.pages[table.released : end] = [-1] * (end - table.released)
        table.released = end

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A prefill-heavy step computed `num_tokens` tokens in `seconds`: what recomputing
        costs, against which loads from the lower tiers are weighed."""
        self.costs.observe_compute(num_tokens, seconds)

    # --- preemption by swap -----------------------------------------------------------------

    def preempt(self, request: Request) -> bool:
        """Release a preempted request's device pages. Its computed KV moves to the CPU tier
        (swap) when that tier has room and moving it out and back costs less than recomputing
        it; returns True if it did."""
        table = self.tables.get(request.request_id)
        num_tokens = request.num_computed_tokens
        released = table.released if table is not None else 0
        num_pages = -(-num_tokens // self.page_size) - released
        swap = (
            self.cpu is not None
            and table is not None
            and num_tokens > 0
            and self.cpu.capacity - self.cpu.num_held >= num_pages
            and 2 * num_pages * self.costs.load_s_per_page["cpu"]
            < num_tokens * self.costs.recompute_s_per_token
        )
        if swap:
            assert self.cpu is not None and table is not None
            self._make_room(0, num_pages)
            held = table.pages[released : released + num_pages]
            self.cpu.hold(request.request_id, [self._page_kv(p) for p in held])
            full = num_tokens // self.page_size
            self.swapped[request.request_id] = _Swapped(num_tokens, table.hashes[:full], released)
            self.stats["cpu"].stored += num_pages
        self.free(request)
        return swap

    def swap_in_fits(self, request: Request) -> bool:
        """Whether a swapped request's KV and its next token fit the device now."""
        entry = self.swapped[request.request_id]
        return -(-(entry.num_tokens + 1) // self.page_size) - entry.released <= self.pool.num_free

    def _swap_in(self, request: Request) -> int | None:
        entry = self.swapped[request.request_id]
        num_pages = -(-entry.num_tokens // self.page_size) - entry.released
        if not self.swap_in_fits(request):
            return None  # wait until it and its next token fit
        assert self.cpu is not None
        start = time.perf_counter()
        del self.swapped[request.request_id]
        held = self.cpu.release(request.request_id)
        page_ids = [-1] * entry.released + self.pool.allocate(num_pages)
        for page_id, kv in zip(page_ids[entry.released :], held, strict=True):
            self._write_page(page_id, kv)
        tokens = request.token_ids
        for i, page_hash in enumerate(entry.hashes[entry.released :], entry.released):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            parent = entry.hashes[i - 1] if i > 0 else None
            self._cache_on_device(page_ids[i], page_hash, chunk, parent)
        table = PageTable(page_ids, list(entry.hashes), entry.released)
        self.tables[request.request_id] = table
        seconds = time.perf_counter() - start
        self.stats["cpu"].loaded += num_pages
        self.stats["cpu"].observe_load(seconds)
        self.stats["device"].stored += num_pages
        self.costs.observe_load("cpu", num_pages, seconds)
        self.num_swap_ins += 1
        self._log_pressure()
        return entry.num_tokens

    # --- the executor's side ---------------------------------------------------------------

    def cache_full_pages(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's pages that became full (their K/V are now written)."""
        table = self.tables[request.request_id]
        num_full = num_computed_tokens // self.page_size
        if not self.pool.enable_prefix_caching or len(table.hashes) >= num_full:
            return
        tokens = request.token_ids
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), num_full):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            page_hash = hash_page(parent, chunk, request.cache_salt)
            if table.pages[i] >= 0:
                self._cache_on_device(table.pages[i], page_hash, chunk, parent)
            table.hashes.append(page_hash)
            parent = page_hash

    def events_taken(self) -> list[KVEvent]:
        """The KV events since the last call (none where nobody listens)."""
        return self.events.take() if self.events is not None else []

    def pages(self, request_ids: list[str]) -> list[list[int]]:
        """The requests' page lists: what the attention operator computes its block table and
        slot mapping from."""
        return [self.tables[r].pages for r in request_ids]
