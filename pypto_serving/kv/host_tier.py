"""The CPU tier: pages of KV in host memory, in fixed slots allocated once.

It holds two kinds of pages: cached pages (found by hash, least recently stored first out) and
the pages of requests preempted by swap (held under a key until it resumes; never evicted).
On a machine with a GPU the slots are pinned memory, so copies to and from the device run at
full speed.

A page can be stored later (`store_later`): its slot and its index entry are taken at once,
its bytes copied by a background thread; reading the slot back, or giving it up, waits for
the copy first. All bookkeeping stays on the caller's thread.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Executor, Future

import numpy as np
import torch

from pypto_serving.kv.tier import PageKV, PageTier, numpy_bits


class HostTier(PageTier):
    name = "cpu"

    def __init__(
        self,
        capacity: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool = False,
        num_tensors: int = 2,
    ) -> None:
        """capacity pages of `num_tensors` tensors (GQA: K and V; MLA: the latent), each of
        page_shape = (layers, heads, page_size, row)."""
        self.capacity = capacity
        self.slots = tuple(
            torch.empty((capacity, *page_shape), dtype=dtype, pin_memory=pin_memory)
            for _ in range(num_tensors)
        )
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self._cached: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._held: dict[str, list[int]] = {}
        self._copying: dict[int, Future[None]] = {}
        """Slots whose bytes a background copy is still writing (`store_later`)."""

    def __len__(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Pages held for swapped requests (not evictable)."""
        return sum(len(slots) for slots in self._held.values())

    def _put(self, kv: PageKV) -> int:
        if len(kv) != len(self.slots):
            raise ValueError(f"a page of {len(kv)} tensors for a tier of {len(self.slots)}")
        slot = self._free.pop()
        self._copy(slot, kv)
        return slot

    def _take(self, slot: int) -> PageKV:
        self._settle(slot)
        self._free.append(slot)
        return tuple(held[slot].clone() for held in self.slots)

    def _settle(self, slot: int) -> None:
        """Wait for a background copy into `slot`, if one is running."""
        copy = self._copying.pop(slot, None)
        if copy is not None:
            copy.result()

    def _copy(self, slot: int, kv: PageKV) -> None:
        for held, t in zip(self.slots, kv, strict=True):
            held[slot].copy_(t)

    def tokens(self, page_hash: bytes) -> tuple[int, ...] | None:
        entry = self._cached.get(page_hash)
        return None if entry is None else entry[1]

    def store(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        if page_hash in self._cached:
            raise ValueError("page already stored in the cpu tier")
        self._cached[page_hash] = (self._put(kv), token_ids)

    def store_later(
        self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV, copier: Executor
    ) -> Future[None]:
        """`store`, the bytes copied on `copier`'s thread: the caller keeps `kv` unchanged until
        the returned future is done."""
        if page_hash in self._cached:
            raise ValueError("page already stored in the cpu tier")
        if len(kv) != len(self.slots):
            raise ValueError(f"a page of {len(kv)} tensors for a tier of {len(self.slots)}")
        slot = self._free.pop()
        self._cached[page_hash] = (slot, token_ids)
        self._copying[slot] = copy = copier.submit(self._copy_serially, slot, kv)
        return copy

    def _copy_serially(self, slot: int, kv: PageKV) -> None:
        """`_copy` on a background thread: a CPU page through NumPy (`numpy_bits`: no OpenMP
        team beside the steps')."""
        for held, t in zip(self.slots, kv, strict=True):
            if t.device.type != "cpu":
                held[slot].copy_(t)  # a device's copy engine, no OpenMP team
                continue
            np.copyto(numpy_bits(held[slot]), numpy_bits(t))

    def load(self, page_hash: bytes) -> PageKV | None:
        slot, _ = self._cached.pop(page_hash)
        return self._take(slot)

    def lru_hash(self) -> bytes | None:
        return next(iter(self._cached), None)

    def discard(self, page_hash: bytes) -> bool:
        entry = self._cached.pop(page_hash, None)
        if entry is not None:
            self._settle(entry[0])
            self._free.append(entry[0])
        return entry is not None

    def hashes(self) -> list[bytes]:
        return list(self._cached)

    # --- swapped requests -----------------------------------------------------------------

    def hold(self, key: str, pages: list[PageKV]) -> None:
        """Keep copies of a swapped request's pages under `key` (needs len(pages) free)."""
        if key in self._held:
            raise ValueError(f"{key!r} already has pages held in the cpu tier")
        if len(pages) > len(self._free):
            raise ValueError(f"cannot hold {len(pages)} pages: {len(self._free)} free")
        self._held[key] = [self._put(kv) for kv in pages]

    def release(self, key: str) -> list[PageKV]:
        """Hand back (and stop holding) the pages held under `key`; [] if none."""
        return [self._take(slot) for slot in self._held.pop(key, [])]

    def held_keys(self) -> list[str]:
        return list(self._held)
