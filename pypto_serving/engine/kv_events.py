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

The events tell which prompts are cached here (a salted request's pages without their tokens:
`kv/events.py`), so a socket other machines can reach must be a ZeroMQ CURVE server
(`EngineConfig` refuses it otherwise): with `kv_events_curve_key` (the server's key pair) and
`kv_events_curve_clients` (the public keys of the subscribers it admits, checked by a ZAP
handler thread) both sockets encrypt, and a subscriber must know the server's public key and
hold an admitted key pair. pyzmq's `zmq.auth.create_certificates` makes the key files.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pypto_serving.config import CacheConfig
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


BlockHash = bytes | int
"""A page's hash on the wire: bytes here (and in recent vLLM), an int in older vLLM."""


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    """The blocks' tokens, one after the other (empty: not told, a salted request's)."""
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(_Event):
    """Every block is gone (vLLM's, on a prefix-cache reset; never published here)."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
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


def key_pair(path: str, option: str) -> tuple[bytes, bytes]:
    """The (public, secret) CURVE keys in a `.key_secret` file (zmq.auth's format), given as
    `option`; PyptoError naming what is wrong."""
    from zmq.auth import load_certificate

    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as e:
        raise PyptoError(f"KV events' CURVE keys: {e}", option) from None
    if secret is None:
        raise PyptoError(
            f"{option} {path} holds no secret key (give the `.key_secret` file)", option
        )
    return public, secret


@dataclass(frozen=True, slots=True)
class Curve:
    """The KV event sockets' CURVE settings: the server's key pair and who it admits."""

    key_file: str
    """A `.key_secret` file (public and secret key, as zmq.auth.create_certificates writes)."""
    clients: str
    """A folder of the admitted subscribers' public keys (`.key` files)."""

    @staticmethod
    def of(cache: CacheConfig) -> Curve | None:
        """The cache config's CURVE settings (None: the sockets are plain)."""
        key_file, clients = cache.kv_events_curve_key, cache.kv_events_curve_clients
        return Curve(key_file, clients) if key_file is not None and clients is not None else None

    def keys(self) -> tuple[bytes, bytes]:
        """The server's (public key, secret key), the clients' folder checked to hold some;
        PyptoError naming what is wrong."""
        from zmq.auth import load_certificates

        public, secret = key_pair(self.key_file, "kv_events_curve_key")
        try:
            admitted = load_certificates(self.clients)
        except (OSError, ValueError) as e:
            raise PyptoError(f"KV events' CURVE keys: {e}", "kv_events_curve_clients") from None
        if not admitted:
            raise PyptoError(
                f"kv_events_curve_clients {self.clients} holds no public key (`.key` file): "
                "no subscriber could connect",
                "kv_events_curve_clients",
            )
        return public, secret


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        dp_rank: int | None,
        replay_endpoint: str | None = None,
        curve: Curve | None = None,
    ) -> None:
        """Bind the PUB socket on `endpoint` (and the replay ROUTER on `replay_endpoint`),
        both CURVE servers if `curve` is given; PyptoError if the keys cannot be read or a
        socket cannot be bound."""
        import zmq

        keys = curve.keys() if curve is not None else None
        self.block_size, self.dp_rank, self.topic = block_size, dp_rank, topic.encode()
        self.context = zmq.Context()
        self.auth = self._admit(curve.clients) if curve is not None else None
        self.replay: zmq.Socket[bytes] | None = None
        where = endpoint
        try:
            self.socket = self._bind(zmq.PUB, endpoint, keys)
            if replay_endpoint is not None:
                where = replay_endpoint
                self.replay = self._bind(zmq.ROUTER, replay_endpoint, keys)
        except zmq.ZMQError as e:
            if where != endpoint:
                self.socket.close(linger=0)
            self._stop()
            raise PyptoError(f"cannot publish KV events on {where}: {e}") from None
        self.endpoint = endpoint
        self.sent: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)
        self.queue: queue.Queue[bytes | None] = queue.Queue(QUEUE_BATCHES)
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="pypto-kv-events", daemon=True)
        self.thread.start()
        log.info("publishing KV events on %s%s", endpoint, " (CURVE)" if keys else "")

    def _admit(self, clients: str) -> Any:
        """A ZAP handler on the context that admits only the public keys in `clients`."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(self.context)
        auth.start()
        auth.configure_curve(domain="*", location=clients)
        return auth

    def _bind(self, kind: int, endpoint: str, keys: tuple[bytes, bytes] | None) -> Any:
        """A socket of `kind` bound to `endpoint` (a CURVE server with `keys`); ZMQError,
        the socket closed, if it cannot be bound."""
        import zmq

        sock = self.context.socket(kind)
        if keys is not None:
            sock.curve_publickey, sock.curve_secretkey = keys
            sock.curve_server = True
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _stop(self) -> None:
        """End the ZAP handler and the context (every socket closed)."""
        if self.auth is not None:
            self.auth.stop()
        self.context.term()

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
        self._stop()
