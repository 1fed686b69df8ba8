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
"""Our tier names -> vLLM's medium names."""


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


@dataclass(slots=True)
class KVEventLog:
    """The events since the engine last took them (its step publishes them)."""

    events: list[KVEvent] = field(default_factory=list)

    def stored(
        self, tier: str, page_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]
    ) -> None:
        self.events.append(PageStored(tier, page_hash, parent, token_ids))

    def removed(self, tier: str, page_hash: bytes) -> None:
        self.events.append(PageRemoved(tier, page_hash))

    def take(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
