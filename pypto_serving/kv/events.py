"""KV events: pages stored into and removed from each tier's prefix index, as the KV store
changes it, for routers outside the engine (llm-d, Dynamo) to route by where a prefix is
cached. The events are vLLM's (`BlockStored`, `BlockRemoved`), the tier named by vLLM's
`medium` (device: "GPU" as vLLM names its KV cache whatever the hardware, cpu: "CPU", ssd:
"DISK"); `engine/kv_events.py` publishes them.

A page is its content hash (the prefix cache's key: the chain of the page's tokens and all
before it, the cache salt included), its parent's hash (the page before it, where known) and
its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """The events since the engine last took them (its step publishes them)."""

    events: list[KVEvent] = field(default_factory=list)

    def stored(
        self, tier: str, page_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]
    ) -> None:
        if tier in MEDIUM:
            self.events.append(PageStored(tier, page_hash, parent, token_ids))

    def removed(self, tier: str, page_hash: bytes) -> None:
        if tier in MEDIUM:
            self.events.append(PageRemoved(tier, page_hash))

    def take(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
