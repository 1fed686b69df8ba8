"""Prefill and decode on separate servers: a prompt's KV handed over Mooncake's Transfer Engine.

A prefill server (`--disaggregation-mode prefill`) computes a request's prompt and samples its
first token; the engine then hands off (`kv.handoff.Handoff`) every KV group's pages of the
prompt, copied once into one buffer before they are freed, that token and the sampler's state.
`KVTransfer.offer` registers the buffer with the Transfer Engine and answers with
`kv_transfer_params`: where the buffer is, how it is cut, and the token. The router passes
those to a decode server (`--disaggregation-mode decode`), whose `KVTransfer.pull` reads the
buffer from the prefill server's memory (TCP here, RDMA where the Transfer Engine finds a
device), marks it read (a write into the offer's read flag, which frees it there) and gives
the engine its handoff:
the request is then admitted as a swapped-out one is, its KV written into device pages, and it
decodes from the first token on.

    router ──1──▶ prefill: compute the prompt, sample token 1, keep its KV, answer params
           ──2──▶ decode:  read the KV (Transfer Engine), go on from token 1, stream

Under tensor or pipeline parallelism the buffer holds every rank's share of the pages, rank
0's first (`executor/kv_shares.py`); only rank 0 has a Transfer Engine.

Both ends check before any byte moves that they hold the same KV layout (model, weights,
quantization, KV dtype, page size, TP and PP sizes: `EngineCore.kv_layout`) and the same
prompt tokens. A
buffer no decode server reads within `timeout_s` is freed. A read that fails or takes longer
than `timeout_s` leaves the request to compute its prompt on the decode server: it never
decodes on partial KV, and never waits forever.

The Transfer Engine lets whoever reaches its port read what is registered (only these
buffers, never the KV cache itself): like vLLM's and SGLang's connectors, prefill and decode
servers belong on a private network.

The Mooncake Store is the other path (`store`, a master's mooncake://HOST:PORT): the prefill
server puts the packed pages under a random key (`pypto-handoff/<transfer id>`) into the pool
its members lend memory to, and the decode server gets them from there and removes them; the
prefill server removes what nobody got within `timeout_s`. The servers then need not reach
each other, only the master and the pool's members.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pypto_serving.errors import PyptoError
from pypto_serving.kv.handoff import Handoff, KVLayout, counts, packed
from pypto_serving.ops.sampler import Sampled

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
"""What a server does in disaggregated serving: prefill hands off, decode receives (both:
either, per request)."""
ACK_BYTES = 8
"""The flag after an offered buffer's pages that the decode server sets once it has read them."""
STORE_PREFIX = "pypto-handoff"
"""Keys of handoffs in a Mooncake Store: STORE_PREFIX/<transfer id>."""
STORE_SEGMENT_BYTES = 1 << 30
"""Memory a server lends the Mooncake Store it hands KV over (where handoffs may land)."""


def prompt_digest(prompt_token_ids: list[int]) -> str:
    """Identifies a prompt's tokens: a decode server takes a handoff only for the same ones."""
    data = np.asarray(prompt_token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def local_address() -> str:
    """This machine's address on the route out (no packet is sent); 127.0.0.1 without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


READ_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the histogram of handoff reads."""


@dataclass(slots=True)
class TransferStats:
    """What one server's KVTransfer has moved (its /metrics: `pypto_kv_transfer_*`)."""

    offered: int = 0
    """Handoffs a prefill server offered."""
    offered_bytes: int = 0
    pulled: int = 0
    """Handoffs a decode server read."""
    failed: int = 0
    """Handoffs a decode server could not take, for whatever reason (it computed those
    prompts)."""
    pulled_bytes: int = 0
    pulled_pages: int = 0
    no_room: int = 0
    """Handoffs a decode server read before it could reserve their device pages (its pool
    was full then): they waited for room as swapped requests do."""
    read_seconds: float = 0.0
    """Time in the Transfer Engine's reads, all together."""
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(READ_BUCKETS) + 1))
    """Reads per READ_BUCKETS bound (the last: longer)."""

    def read(self, seconds: float, size: int, pages: int) -> None:
        self.pulled += 1
        self.pulled_bytes += size
        self.pulled_pages += pages
        self.read_seconds += seconds
        self.read_buckets[bisect.bisect_left(READ_BUCKETS, seconds)] += 1


@dataclass(slots=True)
class _Offer:
    buffer: np.ndarray
    """The packed pages."""
    read: np.ndarray
    """ACK_BYTES the reader sets once it has read them."""
    expires: float


class TransferFailed(Exception):
    """A handoff could not be read: the decode server computes the prompt itself."""


class KVTransfer:
    """One server's end of KV handoffs: offers (a prefill server's) and pulls (a decode
    server's), over its own Transfer Engine or through a Mooncake Store."""

    def __init__(
        self,
        role: str,
        host: str | None = None,
        protocol: str = "tcp",
        timeout_s: float = 60.0,
        store: str | None = None,
    ) -> None:
        """store: a Mooncake master's mooncake://HOST:PORT to hand KV over its Store (None:
        peer to peer over this server's own Transfer Engine)."""
        if role not in ROLES:
            raise PyptoError(f"disaggregation mode must be one of {', '.join(ROLES)}", "role")
        self.role, self.timeout_s = role, timeout_s
        self.engine_id = uuid.uuid4().hex
        self._offers: dict[str, _Offer] = {}
        self._stored: dict[str, float] = {}
        """Store keys put and not yet known gone -> when to remove them."""
        self._lock = threading.Lock()
        self.stats = TransferStats()
        self.store_url = store
        """The Mooncake Store handoffs go through (None: this server's Transfer Engine)."""
        self.store: Any = None
        self.engine: Any = None
        if store is not None:
            from pypto_serving.kv.mooncake_pool import connect

            self.store = connect(store, STORE_SEGMENT_BYTES, "kv_transfer_store")
            self.host, self.port = store, 0
            log.info("KV transfer (%s): over the Mooncake Store at %s", role, store)
            return
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # it logs every connection at INFO
        try:
            from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError as e:
            raise PyptoError(
                "disaggregated serving needs Mooncake's Transfer Engine: pip install "
                "'pypto-serving[remote]' (the mooncake-transfer-engine-non-cuda package) and "
                f"Debian's libibverbs1, which it links even for TCP ({e})"
            ) from e
        self.host = host or local_address()
        self.engine = TransferEngine()
        if self.engine.initialize(self.host, "P2PHANDSHAKE", protocol, "") != 0:
            raise PyptoError(f"the Transfer Engine did not start on {self.host} ({protocol})")
        self.port = int(self.engine.get_rpc_port())
        self._read = np.ones(ACK_BYTES, dtype=np.uint8)
        """What a decode server writes into an offer's flag once read (registered once)."""
        self._register(self._read)
        log.info(
            "KV transfer (%s): Transfer Engine at %s:%d (%s)", role, self.host, self.port, protocol
        )

    @property
    def sends(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def receives(self) -> bool:
        return self.role in ("decode", "both")

    def _live(self) -> Any:
        """The Transfer Engine; TransferFailed once closed."""
        if self.engine is None:
            raise TransferFailed("the Transfer Engine is closed")
        return self.engine

    def _live_store(self) -> Any:
        """The Mooncake Store client; TransferFailed once closed."""
        if self.store is None:
            raise TransferFailed("the Mooncake Store client is closed")
        return self.store

    def _register(self, buffer: np.ndarray) -> None:
        if self.store_url is not None:
            rc = self._live_store().register_buffer(buffer.ctypes.data, buffer.nbytes)
        else:
            rc = self._live().register_memory(buffer.ctypes.data, buffer.nbytes)
        if rc != 0:
            raise TransferFailed(f"registering {buffer.nbytes} bytes for the transfer ({rc})")

    def _unregister(self, buffer: np.ndarray) -> None:
        if self.store is not None:
            self.store.unregister_buffer(buffer.ctypes.data)
        elif self.engine is not None:
            self.engine.unregister_memory(buffer.ctypes.data)

    @contextlib.contextmanager
    def _registered(self, buffer: np.ndarray) -> Iterator[int]:
        """The buffer registered for one transfer (its address), unregistered after."""
        self._register(buffer)
        try:
            yield buffer.ctypes.data
        finally:
            self._unregister(buffer)

    # --- the prefill server's side ---------------------------------------------------------

    def offer(self, handoff: Handoff, layout: str, prompt_token_ids: list[int]) -> dict[str, Any]:
        """Keep the handoff's pages where a decode server can read them (until it has, or
        for `timeout_s`); returns the `kv_transfer_params` that tell it how."""
        self.sweep()
        buffer = handoff.buffer
        if buffer is None:  # pages the engine did not pack
            buffer, _ = packed(handoff.groups)
        size = buffer.size
        transfer_id = uuid.uuid4().hex
        keep = self._put if self.store_url else self._keep
        where = keep(buffer, transfer_id)
        self.stats.offered += 1
        self.stats.offered_bytes += size
        first = handoff.first
        state = handoff.generator_state
        return where | {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "transfer_id": transfer_id,
            "num_bytes": size,
            "layout": layout,
            "prompt": prompt_digest(prompt_token_ids),
            "prompt_token_ids": list(prompt_token_ids),
            "groups": counts(handoff.groups),
            "first_token": {
                "token_id": first.token_id,
                "logprob": first.logprob,
                "top_logprobs": (
                    None if first.top_logprobs is None else list(first.top_logprobs.items())
                ),
            },
            "generator_state": None if state is None else base64.b64encode(state).decode(),
        }

    def _keep(self, buffer: np.ndarray, transfer_id: str) -> dict[str, Any]:
        """The buffer registered with the Transfer Engine for a decode server to read; where."""
        read = np.zeros(ACK_BYTES, dtype=np.uint8)
        self._register(buffer)
        self._register(read)
        with self._lock:
            self._offers[transfer_id] = _Offer(buffer, read, time.monotonic() + self.timeout_s)
        return {
            "remote_host": self.host,
            "remote_port": self.port,
            "buffer": int(buffer.ctypes.data),
            "read_flag": int(read.ctypes.data),
        }

    def _put(self, buffer: np.ndarray, transfer_id: str) -> dict[str, Any]:
        """The buffer put into the Mooncake Store under a key of its own; where."""
        key = f"{STORE_PREFIX}/{transfer_id}"
        store = self._live_store()
        with self._registered(buffer) as address:
            rc = store.put_from(key, address, buffer.size)
        if rc != 0:
            raise TransferFailed(f"putting {buffer.size} bytes into the Mooncake Store ({rc})")
        with self._lock:
            self._stored[key] = time.monotonic() + self.timeout_s
        return {"store_key": key}

    def sweep(self) -> None:
        """Free the offers a decode server has read, and those nobody read in time."""
        now = time.monotonic()
        with self._lock:
            done = [tid for tid, o in self._offers.items() if o.read.any() or now > o.expires]
            offers = [self._offers.pop(tid) for tid in done]
            expired = [key for key, expires in self._stored.items() if now > expires]
            for key in expired:
                del self._stored[key]
        for o in offers:
            self._unregister(o.buffer)
            self._unregister(o.read)
        for key in expired:  # (gone already where a decode server got it)
            if self.store is not None:
                self.store.remove(key, True)

    @property
    def num_offers(self) -> int:
        """Handoffs offered and not yet known read (or expired)."""
        with self._lock:
            return len(self._offers) + len(self._stored)

    # --- the decode server's side ----------------------------------------------------------

    def pull(
        self, params: dict[str, Any], layout: KVLayout, prompt_token_ids: list[int]
    ) -> Handoff:
        """Read the handoff `params` describe (on the calling thread: it blocks) from the
        prefill server that offered it, then mark it read there, or from the Mooncake Store,
        then remove it there. Raises TransferFailed."""
        try:
            size = int(params["num_bytes"])
            key = params.get("store_key")
            if key is None:
                host, port = str(params["remote_host"]), int(params["remote_port"])
                remote, flag = int(params["buffer"]), int(params["read_flag"])
            elif not isinstance(key, str) or not key.startswith(STORE_PREFIX + "/"):
                raise ValueError(f"store_key {key!r}")
            shapes = [(str(n), int(t), int(r), int(c)) for n, t, r, c in params["groups"]]
            first = params["first_token"]
            top = first.get("top_logprobs")
            sampled = Sampled(
                int(first["token_id"]),
                float(first["logprob"]),
                None if top is None else {int(k): float(v) for k, v in top},
            )
            state = params.get("generator_state")
            generator_state = None if state is None else base64.b64decode(state)
            theirs, prompt = str(params["layout"]), str(params["prompt"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransferFailed(f"malformed kv_transfer_params ({type(e).__name__}: {e})") from e
        if theirs != layout.digest:
            raise TransferFailed(
                "the prefill server's KV layout (model, dtype, pages, TP and PP sizes) differs"
            )
        if prompt != prompt_digest(prompt_token_ids):
            raise TransferFailed("the prefill server computed other prompt tokens")
        if len(shapes) != len(layout.geometry) or sum(layout.share_sizes(shapes)) != size:
            raise TransferFailed("the handoff's size does not match this server's KV pages")
        if (key is None) != (self.store_url is None):
            theirs_way = "the Transfer Engine" if key is None else "a Mooncake Store"
            ours_way = "the Transfer Engine" if self.store_url is None else "a Mooncake Store"
            raise TransferFailed(
                f"the prefill server hands KV over {theirs_way}, this server reads over "
                f"{ours_way} (start both with the same --kv-transfer-store, or neither)"
            )
        buffer = np.empty(size, dtype=np.uint8)
        start = time.perf_counter()
        if key is not None:
            self._get(key, buffer)
        else:
            self._read_remote(f"{host}:{port}", remote, flag, buffer)
        self.stats.read(time.perf_counter() - start, size, sum(c for *_, c in shapes))
        try:  # rank 0's share, and the other ranks' (under TP/PP) as they are
            groups, shares = layout.cut(buffer, shapes)
        except ValueError as e:
            raise TransferFailed(str(e)) from e
        return Handoff(groups, sampled, generator_state, shares=shares)

    def _read_remote(self, session: str, remote: int, flag: int, buffer: np.ndarray) -> None:
        """Read an offer over the Transfer Engine, then set its read flag there."""
        with self._registered(buffer) as address:
            rc = self._live().transfer_sync_read(session, address, remote, buffer.size)
        if rc != 0:
            raise TransferFailed(f"reading {buffer.size} bytes from {session} failed ({rc})")
        self._live().transfer_sync_write(session, self._read.ctypes.data, flag, ACK_BYTES)

    def _get(self, key: str, buffer: np.ndarray) -> None:
        """Get a handoff from the Mooncake Store, then remove it there."""
        store = self._live_store()
        with self._registered(buffer) as address:
            got = store.get_into(key, address, buffer.size)
        if got != buffer.size:
            raise TransferFailed(
                f"getting {key} from the Mooncake Store: {got} of {buffer.size} bytes"
            )
        store.remove(key, True)  # (force: a get leaves a lease on it for a while)

    def close(self) -> None:
        """Free every offer and stop the Transfer Engine (its listening sockets close with
        it); later offers and reads fail with TransferFailed."""
        with self._lock:
            offers, self._offers = list(self._offers.values()), {}
            stored, self._stored = list(self._stored), {}
        for o in offers:
            self._unregister(o.buffer)
            self._unregister(o.read)
        self.engine = None
        if self.store is not None:
            for key in stored:
                self.store.remove(key, True)
            self.store.close()
            self.store = None
