"""Publishes the KV store's events (`kv/events.py`) as vLLM does, so routers built for vLLM
(llm-d's, Dynamo's) can route to this server by where prefixes are cached.

The wire format is vLLM's: a ZeroMQ PUB socket, each batch one multipart message `[topic,
sequence number (8 bytes, big-endian), payload]`, the payload vLLM's `KVEventBatch` in msgpack
as msgspec writes it: `[ts, [event, ...], data_parallel_rank]`, each event a tagged array,
`["BlockStored", [hash], parent_hash, token_ids, block_size, lora_id, medium]` or
`["BlockRemoved", [hash], medium]` (hashes as bytes). A thread owns the socket; a step only
queues its events. Data-parallel replica r binds the endpoint's port + r (vLLM's rule).

A subscriber that missed batches (a gap in the sequence numbers) asks the replay socket, a
ROUTER, for them as vLLM's do: it sends the first sequence number it wants (8 bytes,
big-endian) and gets each batch still buffered from there (`[sequence number, payload]`, the
last REPLAY_BATCHES kept), then an end marker (sequence number -1, empty payload).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import re
import threading
import time

import msgspec

from pypto_serving.errors import PyptoError
from pypto_serving.kv.events import MEDIUM, KVEvent, PageStored

log = logging.getLogger(__name__)

REPLAY_BATCHES = 10_000
"""Batches kept for the replay socket (vLLM's buffer_steps default)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's end marker."""
QUEUE_BATCHES = 10_000
"""Batches that may wait for the publishing thread; past that the oldest are dropped (and
said): a step never waits for the socket."""


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's KVCacheEvent."""


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


def endpoint_for(endpoint: str, dp_rank: int) -> str:
    """The endpoint of data-parallel replica `dp_rank`: a tcp port moves up by the rank."""
    m = re.fullmatch(r"(tcp://.+):(\d+)", endpoint)
    if dp_rank == 0 or m is None:
        return endpoint
    return f"{m.group(1)}:{int(m.group(2)) + dp_rank}"


def wire_event(event: KVEvent, block_size: int) -> BlockStored | BlockRemoved:
    medium = MEDIUM.get(event.tier, event.tier.upper())
    if isinstance(event, PageStored):
        tokens = list(event.token_ids)
        return BlockStored([event.page_hash], event.parent_hash, tokens, block_size, None, medium)
    return BlockRemoved([event.page_hash], medium)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        dp_rank: int | None,
        replay_endpoint: str | None = None,
    ) -> None:
        import zmq

        self.block_size, self.dp_rank, self.topic = block_size, dp_rank, topic.encode()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.replay: zmq.Socket[bytes] | None = None
        try:
            self.socket.bind(endpoint)
            if replay_endpoint is not None:
                self.replay = self.context.socket(zmq.ROUTER)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            if self.replay is not None:
                self.replay.close(linger=0)
            self.context.term()
            where = endpoint if self.replay is None else replay_endpoint
            raise PyptoError(f"cannot publish KV events on {where}: {e}") from None
        self.endpoint = endpoint
        self.sent: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)
        self.queue: queue.Queue[bytes | None] = queue.Queue(QUEUE_BATCHES)
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="pypto-kv-events", daemon=True)
        self.thread.start()
        log.info("publishing KV events on %s", endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (a step's events) for the socket."""
        if not events:
            return
        batch = KVEventBatch(
            time.time(), [wire_event(e, self.block_size) for e in events], self.dp_rank
        )
        payload = msgspec.msgpack.encode(batch)
        while True:
            try:
                self.queue.put_nowait(payload)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.queue.get_nowait()
                    self.dropped += 1
                    log.warning("KV events: %d batches dropped (socket behind)", self.dropped)

    def _run(self) -> None:
        seq = 0
        while True:
            if self.replay is not None and self.replay.poll(0):
                self._replay()
            try:
                payload = self.queue.get(timeout=0.05 if self.replay is not None else None)
            except queue.Empty:
                continue
            if payload is None:
                break
            self.socket.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            if self.replay is not None:
                self.sent.append((seq, payload))
            seq += 1
        self.socket.close(linger=100)
        if self.replay is not None:
            self.replay.close(linger=0)

    def _replay(self) -> None:
        """Answer one replay request: the buffered batches from the sequence number asked."""
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, first = frames
        start = int.from_bytes(first, "big")
        for seq, payload in self.sent:
            if seq >= start:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(5.0)
        self.context.term()
