"""KV events: pages stored into and removed from each tier's prefix index, as the KV store
changes it, for routers outside the engine (llm-d, Dynamo) to route by where a prefix is
cached. The events are vLLM's (`BlockStored`, `BlockRemoved`), the tier named by vLLM's
`medium` (device: "GPU" as vLLM names its KV cache whatever the hardware, cpu: "CPU", ssd:
"DISK"); `engine/kv_events.py` publishes them.

A page is its content hash (the prefix cache's key: the chain of the page's tokens and all
before it, the cache salt included), its parent's hash (the page before it, where known) and
its tokens, unless a request with a `cache_salt` made it: a salt asks that the prompt be kept
from other tenants, so its pages are told without tokens (an empty list, as vLLM's schema
allows), on every tier they move to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pypto_serving.kv.page_pool import hash_page

MEDIUM = {"device": "GPU", "cpu": "CPU", "ssd": "DISK"}
"""Our tier names -> vLLM's medium names. The shared pool (the remote tier) has none: it is
not this server's, and its master can publish its own events."""


@dataclass(frozen=True, slots=True)
class PageStored:
    tier: str
    page_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PageRemoved:
    tier: str
    page_hash: bytes


KVEvent = PageStored | PageRemoved

PageChange = tuple[bool, str, bytes]
"""An event as the data-parallel router takes it: (stored, not removed; tier; page hash)."""


def page_change(event: KVEvent) -> PageChange:
    return isinstance(event, PageStored), event.tier, event.page_hash


@dataclass(slots=True)
class KVEventLog:
    """The events since the engine last took them (its step publishes them).

    Which pages' tokens may be told: a page is stored on the device first (computed there, or
    loaded back with its parent known), and its hash is the unsalted hash of its parent and
    tokens exactly when its request had no salt; the lower tiers it moves to follow what the
    device was told. A page the log has not seen on the device is told without tokens."""

    events: list[KVEvent] = field(default_factory=list)
    places: Counter[bytes] = field(default_factory=Counter)
    """Per page: the tiers whose index holds it, as the events said."""
    told: set[bytes] = field(default_factory=set)
    """The pages whose tokens may be told (unsalted, seen on the device)."""

    def stored(
        self, tier: str, page_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]
    ) -> None:
        if tier not in MEDIUM:
            return
        if tier == "device" and hash_page(parent, token_ids) == page_hash:  # no salt
            self.told.add(page_hash)
        self.places[page_hash] += 1
        tokens = token_ids if page_hash in self.told else ()
        self.events.append(PageStored(tier, page_hash, parent, tokens))

    def removed(self, tier: str, page_hash: bytes) -> None:
        if tier in MEDIUM:
            self.places[page_hash] -= 1
            self.events.append(PageRemoved(tier, page_hash))

    def take(self) -> list[KVEvent]:
        """The events, and forget the pages no tier holds any more (a page moving between
        tiers is removed from one and stored in the next within a step)."""
        gone = [h for h, n in self.places.items() if n <= 0]
        for page_hash in gone:
            del self.places[page_hash]
            self.told.discard(page_hash)
        out, self.events = self.events, []
        return out
