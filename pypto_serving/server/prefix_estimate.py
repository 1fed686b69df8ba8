"""What a prefill server probably caches, as `pypto router` estimates it: the router's own pages
of ROUTER_PAGE tokens, as hash chains (each page's hash covers its tokens, every token before it
and the cache salt), per server.

Two ways to know:
- from what the router sent (`PrefixEstimate.sent`): every prompt the server computed for
  this router, its pages kept until they age out of `capacity`;
- from the server's KV events (`follow`, the server started with `--kv-events-endpoint`): the
  pages its prefix index stores and removes on each tier, vLLM's `BlockStored` and
  `BlockRemoved`, so requests other clients sent count, and a page the server evicted stops
  counting. Each stored block's tokens extend its parent block's chain (blocks of any size: a
  router page may straddle two of them); a block told without tokens (a salted request's) or
  whose parent the router never saw is not counted.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from pypto_serving.engine.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireEvent,
)

log = logging.getLogger(__name__)

ROUTER_PAGE = 16
"""Tokens a page of the router's prefix estimate covers."""


def extend(
    parent: bytes, pending: tuple[int, ...], token_ids: list[int]
) -> tuple[list[bytes], bytes, tuple[int, ...]]:
    """The chain continued by `token_ids` after `parent` (the last full page's hash) and the
    `pending` tokens of a page not yet full: (the pages completed, the new parent, the tokens
    left over)."""
    tokens = [*pending, *token_ids]
    pages = []
    full = len(tokens) - len(tokens) % ROUTER_PAGE
    for start in range(0, full, ROUTER_PAGE):
        data = b"".join(
            t.to_bytes(4, "little", signed=True) for t in tokens[start : start + ROUTER_PAGE]
        )
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        pages.append(parent)
    return pages, parent, tuple(tokens[full:])


def page_chain(token_ids: list[int], salt: str | None) -> list[bytes]:
    """A prompt's full pages of ROUTER_PAGE tokens as a chain of hashes."""
    return extend((salt or "").encode(), (), token_ids)[0]


@dataclass(slots=True)
class _Block:
    """A server's block, as the router's chain reads it."""

    end: bytes
    """The chain's hash after the block's last full router page."""
    pending: tuple[int, ...]
    """Its tokens after that page (the start of a router page the next block completes)."""
    pages: list[bytes]
    """The router pages this block completed."""
    media: set[str | None] = field(default_factory=set)
    """The tiers holding it now (empty: gone)."""


@dataclass
class PrefixEstimate:
    """One server's pages, as far as the router knows (at most `capacity`, the oldest
    forgotten first)."""

    capacity: int = 1 << 16
    pages: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    blocks: OrderedDict[BlockHash, _Block] = field(default_factory=OrderedDict)
    """The server's blocks seen in its KV events (gone ones too: a child may follow)."""
    events: int = 0
    """Events applied."""

    def __len__(self) -> int:
        """Pages it probably holds."""
        return len(self.pages)

    def held(self, chain: list[bytes]) -> int:
        """How many leading pages of a prompt's chain the server probably caches."""
        n = 0
        while n < len(chain) and chain[n] in self.pages:
            n += 1
        return n

    def _add(self, pages: list[bytes]) -> None:
        for page in pages:
            self.pages[page] = None
            self.pages.move_to_end(page)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)

    def sent(self, chain: list[bytes]) -> None:
        """The server computed a prompt of these pages for the router."""
        self._add(chain)

    def apply(self, event: WireEvent) -> None:
        """One of the server's KV events."""
        self.events += 1
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                block = self.blocks.get(h)
                if block is not None and block.media:
                    block.media.discard(event.medium)
                    if not block.media:
                        for page in block.pages:
                            self.pages.pop(page, None)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def clear(self) -> None:
        """Nothing is known to be held."""
        self.pages.clear()
        self.blocks.clear()

    def _stored(self, event: BlockStored) -> None:
        hashes, tokens, size = event.block_hashes, event.token_ids, event.block_size
        if not tokens or len(tokens) != size * len(hashes):
            return  # told without its tokens (salted), or malformed
        pending: tuple[int, ...]
        if event.parent_block_hash is None:
            end, pending = b"", ()  # the chain of an unsalted prompt starts here
        elif (parent := self.blocks.get(event.parent_block_hash)) is not None:
            end, pending = parent.end, parent.pending
        else:
            return  # its parent came before the router listened
        for i, h in enumerate(hashes):
            block = self.blocks.get(h)
            if block is None:
                pages, end, pending = extend(end, pending, tokens[i * size : (i + 1) * size])
                block = self.blocks[h] = _Block(end, pending, pages)
                while len(self.blocks) > self.capacity:
                    self.blocks.popitem(last=False)
            self.blocks.move_to_end(h)
            block.media.add(event.medium)
            self._add(block.pages)
            end, pending = block.end, block.pending


async def follow(
    endpoint: str, estimate: PrefixEstimate, curve: tuple[bytes, bytes, bytes] | None
) -> None:
    """Apply a server's KV events (a ZeroMQ SUB socket on `endpoint`; a CURVE client with
    `curve` = (the server's public key, this router's public and secret keys)) to its
    estimate, until cancelled. The socket connecting again (the server restarted, or the
    network broke: either way what it caches is not known) or sequence numbers starting over
    reset the estimate; a gap (batches the socket dropped) is logged."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    sock = context.socket(zmq.SUB)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    sock.connect(endpoint)
    poller = zmq.asyncio.Poller()
    poller.register(monitor, zmq.POLLIN)
    poller.register(sock, zmq.POLLIN)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    last: int | None = None
    connects = 0
    try:
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                await monitor.recv_multipart()
                connects += 1
                if connects > 1:
                    log.info("KV events of %s: connected again, the estimate starts over", endpoint)
                    estimate.clear()
                    last = None
            if sock not in ready:
                continue
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if last is not None and seq <= last:
                log.info("KV events of %s start again: its cache is new", endpoint)
                estimate.clear()
            elif last is not None and seq > last + 1:
                log.warning("KV events of %s: %d batches missed", endpoint, seq - last - 1)
            last = seq
            try:
                batch = decoder.decode(frames[2])
            except msgspec.DecodeError as e:
                log.warning("KV events of %s: a batch not understood (%s)", endpoint, e)
                continue
            for event in batch.events:
                estimate.apply(event)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
