"""The interface shared by the KV tiers below the device (CPU memory, SSD), and their counters.

A tier holds whole pages of KV, each under its page hash (the same hash chain the device's
prefix cache uses) together with the page's token ids, so a hit can be checked token by token.
The KV store moves pages between tiers; a tier only stores, finds, hands back and drops them,
and keeps them in least-recently-stored order (its LRU).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

TIER_NAMES = ("device", "cpu", "ssd", "remote")
"""Fastest first."""

PageKV = tuple[torch.Tensor, ...]
"""One page's stored tensors, each [layers, heads, page_size, row], as its attention kind
lays them out (`spec.KVSpec`): GQA its keys and values (row: head_dim values, or for an int8
cache head_dim int8 values and their 4-byte scale), MLA its one latent tensor."""


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numpy_bits(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's elements as integers of their size (NumPy has no
    bfloat16), its strides kept. The tiers' background threads copy and serialize pages
    through it: NumPy copies on the calling thread, where torch's copy_ would start an OpenMP
    team of its own beside the steps' (on a machine with as many threads as cores that slowed
    every later decode step: SmolLM2 single stream on 2 cores, 140-150 tok/s against 224)."""
    return t.view(_SAME_SIZE[t.element_size()]).numpy()


BACKGROUND_NICE = 19
"""The niceness of the tiers' background threads (Linux: per thread)."""


def background_priority() -> None:
    """Run the calling thread (a tier's copier or writer) at the lowest priority: its copies
    then take the cores when the steps' thread team leaves them, not in the middle of a step.
    At the default priority, on 2 cores, a finished request's pages copied to the CPU tier
    while the next request's prompt ran added ~5 ms to its time to first token (SmolLM2, 32
    tokens: 46 ms against 41). Best effort: where the system refuses, it stays as it is."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def kv_bytes(kv: PageKV) -> bytes:
    """A page's tensors' bytes, one after another, each in C order."""
    return b"".join(numpy_bits(t).tobytes() for t in kv)


def page_bytes(page_shape: tuple[int, ...], dtype: torch.dtype, num_tensors: int = 2) -> int:
    """Bytes of one page of `num_tensors` tensors, each of `page_shape`."""
    return num_tensors * torch.Size(page_shape).numel() * dtype.itemsize


LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds (seconds) of the load-latency histogram."""


@dataclass(slots=True)
class TierStats:
    """Running totals of one tier (device, cpu or ssd), all in pages unless named bytes."""

    name: str
    capacity: int
    """Pages the tier's byte budget holds."""
    page_bytes: int
    used: int = 0
    """Pages held now (cached pages, and on the CPU tier swapped requests' pages)."""
    hits: int = 0
    """Pages of an arriving prompt found in this tier."""
    misses: int = 0
    """Pages of an arriving prompt looked up in this tier and not found."""
    stored: int = 0
    """Pages written into this tier (loaded into the device, demoted, swapped out)."""
    loaded: int = 0
    """Pages read from this tier back into the device."""
    evicted: int = 0
    """Cached pages pushed out of this tier to make room (to the next tier, or dropped)."""
    load_seconds_sum: float = 0.0
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    """Loads per latency bucket (the last one is +Inf); not cumulative."""
    errors: int = 0
    """I/O errors (SSD: a read-only or full disk, a failing read, write or delete): each cost
    a page (a miss, or a page dropped), never a step."""
    rejected: int = 0
    """Pages found truncated, corrupted, foreign or forged (SSD), never served."""
    shared: bool = False
    """A pool that other processes fill too (the remote tier): `capacity` is what this
    process lends it, `used` the pages it knows are there, from any member; so `used` may
    pass `capacity`, and the tier has no fraction in use."""

    @property
    def usage(self) -> float | None:
        """The fraction of the tier's pages in use (0-1); None for a shared pool."""
        return None if self.shared else self.used / max(self.capacity, 1)

    def observe_load(self, seconds: float) -> None:
        self.load_buckets[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1
        self.load_seconds_sum += seconds


def merge_tier_stats(a: TierStats, b: TierStats) -> TierStats:
    """The totals of two tiers of the same kind (e.g. the CPU tiers of two DP replicas)."""
    return TierStats(
        a.name,
        a.capacity + b.capacity,
        a.page_bytes,
        max(a.used, b.used) if a.shared else a.used + b.used,  # shared: the same pages
        a.hits + b.hits,
        a.misses + b.misses,
        a.stored + b.stored,
        a.loaded + b.loaded,
        a.evicted + b.evicted,
        a.load_seconds_sum + b.load_seconds_sum,
        [x + y for x, y in zip(a.load_buckets, b.load_buckets, strict=True)],
        a.errors + b.errors,
        a.rejected + b.rejected,
        a.shared,
    )


class PageTier(ABC):
    """A store of cached pages below the device, with a byte budget and an LRU."""

    name: str
    capacity: int
    """Pages it can hold."""
    shared = False
    """Filled by other processes too (`TierStats.shared`)."""

    @abstractmethod
    def __len__(self) -> int:
        """Pages held now."""

    @abstractmethod
    def tokens(self, page_hash: bytes) -> tuple[int, ...] | None:
        """The token ids of the page stored under `page_hash`, or None; changes nothing."""

    @abstractmethod
    def store(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        """Keep a copy of a page as most recently used. Needs a free place (len < capacity)."""

    @abstractmethod
    def load(self, page_hash: bytes) -> PageKV | None:
        """Remove a stored page and return its KV (owned by the caller); None if the page
        could not be read back (it is dropped and counted as unreadable)."""

    @abstractmethod
    def lru_hash(self) -> bytes | None:
        """The least recently stored cached page, or None if there is none."""

    @abstractmethod
    def discard(self, page_hash: bytes) -> bool:
        """Drop a stored page if present; True if it was."""

    @abstractmethod
    def hashes(self) -> list[bytes]:
        """Every stored page hash, least recently stored first."""

    def close(self) -> None:  # noqa: B027 (optional: only the SSD tier has pending work)
        """Finish pending work (the SSD tier's writes)."""
