"""The data-parallel router: which replica a new request goes to.

`least_pending_tokens` sends a request to the replica with the fewest pending tokens, less
the prompt tokens that replica probably holds in its prefix cache. A replica's pending
tokens are those of the requests routed to it and not yet finished: a request counts its
prompt until its first output token arrives, plus the output tokens it may still produce
(max_tokens, or the context left). Each request is counted once, from the moment it is
routed, so a burst of requests is spread before any replica has reported back.

The prefix estimate has two sources. What each replica was sent: the hash chain of every
routed prompt's full pages (the same hashes the KV store computes), in an LRU bounded by the
pages the replica's KV tiers hold together, known at once. And what each replica reports:
its KV events (pages stored into and removed from each tier's index, the ones it publishes
for outside routers), which arrive with its step results; a page removed from every tier of a
replica leaves its estimate, so evictions are seen. With a KV pool shared by the replicas
(`kv_remote`), a page any replica stored is written there too, and counts for every replica
(it loads from the pool instead of computing). A wrong guess costs a recompute, never a wrong
answer.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from pypto_serving.kv.events import PageChange
from pypto_serving.kv.page_pool import hash_page
from pypto_serving.request import Request


@dataclass(slots=True)
class _Routed:
    replica: int
    prompt: int
    max_output: int
    produced: int = 0

    @property
    def pending(self) -> int:
        """The prompt until the first output token, plus the output still to come."""
        return (self.prompt if self.produced == 0 else 0) + max(self.max_output - self.produced, 0)


class Router:
    def __init__(
        self,
        num_replicas: int,
        page_size: int,
        capacity_pages: list[int],
        policy: str = "least_pending_tokens",
        pool_pages: int = 0,
    ) -> None:
        """pool_pages: what a KV pool shared by the replicas holds (0: none)."""
        self.page_size, self.policy = page_size, policy
        self.capacity_pages = capacity_pages
        self.pending = [0] * num_replicas
        """Pending tokens per replica."""
        self._routed: dict[str, _Routed] = {}
        self._cached: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in capacity_pages]
        self._held: list[dict[bytes, set[str]]] = [{} for _ in capacity_pages]
        """Per replica, the tiers each page is in, as its KV events say."""
        self.pool_pages = pool_pages
        self._pool: OrderedDict[bytes, None] = OrderedDict()
        self._turn = itertools.cycle(range(num_replicas))
        self.live = set(range(num_replicas))
        """Replicas that take new requests."""
        self.num_routed = [0] * num_replicas
        """Requests routed to each replica and not finished."""

    def prompt_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the prompt's full pages, first page first."""
        ids, size, parent = request.prompt_token_ids, self.page_size, None
        hashes = []
        for start in range(0, len(ids) - size + 1, size):
            parent = hash_page(parent, ids[start : start + size], request.cache_salt)
            hashes.append(parent)
        return hashes

    def cached_tokens(self, replica: int, request: Request, hashes: list[bytes]) -> int:
        """Prompt tokens the replica likely has cached (capped so one is always computed)."""
        cached, held, pool = self._cached[replica], self._held[replica], self._pool
        pages = next(
            (
                i
                for i, h in enumerate(hashes)
                if h not in cached and h not in held and h not in pool
            ),
            len(hashes),
        )
        return min(pages * self.page_size, len(request.prompt_token_ids) - 1)

    def observe(self, replica: int, changes: list[PageChange]) -> None:
        """A replica's KV events: the pages its tiers stored and removed."""
        held, cached = self._held[replica], self._cached[replica]
        for stored, tier, page_hash in changes:
            if stored:
                held.setdefault(page_hash, set()).add(tier)
                if self.pool_pages and tier == "device":  # written through to the pool
                    self._pool[page_hash] = None
                    self._pool.move_to_end(page_hash)
                    if len(self._pool) > self.pool_pages:
                        self._pool.popitem(last=False)
                continue
            tiers = held.get(page_hash)
            if tiers is not None:
                tiers.discard(tier)
                if tiers:
                    continue
                del held[page_hash]
            cached.pop(page_hash, None)  # gone from the replica: the routed guess goes too

    def route(self, request: Request) -> int:
        """Pick the replica for a new request and count its tokens there."""
        if request.request_id in self._routed:
            raise ValueError(f"request {request.request_id!r} is already routed")
        hashes = self.prompt_hashes(request)
        if not self.live:
            raise RuntimeError("no data-parallel replica is left to take requests")
        replicas = sorted(self.live)
        if self.policy == "round_robin":
            choice = next(i for i in self._turn if i in self.live)
        else:
            choice = min(
                replicas,
                key=lambda i: (self.pending[i] - self.cached_tokens(i, request, hashes), i),
            )
        cached = self._cached[choice]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_pages[choice]:
            cached.popitem(last=False)
        n = len(request.prompt_token_ids)
        limit = request.max_model_len if request.max_model_len is not None else n + 1
        output = request.params.max_tokens if request.params.max_tokens is not None else limit - n
        routed = _Routed(choice, n, max(output, 0))
        self._routed[request.request_id] = routed
        self.pending[choice] += routed.pending
        self.num_routed[choice] += 1
        return choice

    def progress(self, request_id: str, num_output_tokens: int) -> None:
        """A routed request has produced `num_output_tokens` so far."""
        routed = self._routed[request_id]
        before = routed.pending
        routed.produced = num_output_tokens
        self.pending[routed.replica] -= before - routed.pending

    def finish(self, request_id: str) -> None:
        """A routed request finished or was aborted: its tokens stop counting."""
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            self.pending[routed.replica] -= routed.pending
            self.num_routed[routed.replica] -= 1

    def remove(self, replica: int) -> list[str]:
        """Take a replica out of rotation; returns the requests it had (no longer routed)."""
        self.live.discard(replica)
        lost = [rid for rid, r in self._routed.items() if r.replica == replica]
        for rid in lost:
            del self._routed[rid]
        self.pending[replica] = self.num_routed[replica] = 0
        self._cached[replica].clear()
        self._held[replica].clear()
        return lost

    def replica_of(self, request_id: str) -> int | None:
        routed = self._routed.get(request_id)
        return None if routed is None else routed.replica
