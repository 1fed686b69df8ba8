"""The remote tier: cached pages in a pool shared by every server and replica (Mooncake Store).

Unlike the CPU and SSD tiers it is shared, so it is not exclusive: a page computed on the
device is also written here (write-through, from a background thread), a hit copies the page
into the device and leaves it in the pool for the others, and the master, not this tier,
decides what the pool evicts. Pages pushed off the lower local tiers land here too, where
they are not already.

A page is stored under `pypto/<layout digest>/<page hash>`: the layout digest covers the
model's weights, quantization, the KV layout and dtype (as the SSD tier's folder name does),
the page hash the chain of its tokens and all before them, and the request's `cache_salt` (so
salted requests' pages sit under keys of their own, found only by requests of the same salt).
Its value is

    MAGIC | header length (u32, little-endian) | header (JSON) | payload (raw) | digest

(the header: layout digest, page hash, token ids, shapes, dtype; the digest a BLAKE2b-256
over the key and everything before it, keyed by the pool's secret: `mooncake_pool.pool_key`).
Mooncake lets anyone who reaches the master write, so a page signed without the secret (a
forgery: rebuilt key, zeroed KV, recomputed checksum), moved under another key, truncated,
damaged or another model's is a miss (counted in `rejected`, logged), never served. The digest
is checked first, so nothing else of an unsigned value is read.

A pool that stops answering (its master gone, a peer's segment unreachable) never fails a
step: each call the engine waits on has a time limit (`CALL_TIMEOUT_S`), and after a failure
the tier stays off for `RETRY_S` (every lookup a miss, writes dropped), then tries again.
The prompt recomputes what the pool would have given.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import json
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from pypto_serving.kv.mooncake_pool import Pool, leave
from pypto_serving.kv.tier import (
    PageKV,
    PageTier,
    background_priority,
    kv_bytes,
    page_bytes,
)
from pypto_serving.paths import DIGEST_BYTES, keyed_digest

log = logging.getLogger(__name__)

MAGIC = b"PYPTORK2"
CALL_TIMEOUT_S = 1.0
"""The longest the engine waits on one lookup or load (a Mooncake call to a dead master
takes ~4.5 s to fail)."""
RETRY_S = 5.0
"""How long the tier stays off after a failed or timed-out call."""
KNOWN_PAGES = 1 << 16
"""Page hashes remembered as present in the pool (so a page is not written twice)."""
MAX_PENDING_BYTES = 256 << 20
"""Page bytes queued for writing at most; beyond, new pages are not written (the pool is a
cache: a page missing there is recomputed where it is needed)."""

T = TypeVar("T")


class RemoteTier(PageTier):
    name = "remote"
    shared = True

    def __init__(
        self,
        pool: Pool,
        capacity: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        digest: str,
        num_tensors: int,
        secret: bytes,
    ) -> None:
        """pool: a Mooncake Store client (`mooncake_pool.join`; `close` leaves it); capacity:
        the pages this process lends to the pool (what its stats show: the pool's own size is
        the sum of every member's); digest: of the model and the KV layout (part of every key
        and header); secret: the key pages are signed and checked with (`pool_key`)."""
        self.pool, self.capacity, self.page_shape, self.dtype = pool, capacity, page_shape, dtype
        self.digest, self.num_tensors, self._secret = digest, num_tensors, secret
        self.payload_bytes = page_bytes(page_shape, dtype, num_tensors)
        self.num_rejected = 0
        """Pages found unsigned, truncated, corrupted or another model's (never served)."""
        self.num_errors = 0
        """Calls that failed or ran past CALL_TIMEOUT_S (each cost a page, never a step)."""
        self.num_written = 0
        self._known: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        """Pages believed present in the pool, with their tokens (written by us, or found by a
        probe), most recently seen last."""
        self._damaged: set[bytes] = set()
        """Pages found unusable in the pool: the next write replaces them (a plain put keeps
        an object that exists)."""
        self._down_until = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self._reader = concurrent.futures.ThreadPoolExecutor(1, "pypto-kv-remote-read")
        self._queue: queue.Queue[tuple[bytes, tuple[int, ...], PageKV] | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._write_loop, name="pypto-kv-remote", daemon=True
        )
        self._thread.start()

    def key(self, page_hash: bytes) -> str:
        return f"pypto/{self.digest[:32]}/{page_hash.hex()}"

    # --- calls with a time limit ------------------------------------------------------------

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, why: str) -> None:
        with self._lock:
            self.num_errors += 1
            first = self._down_until == 0.0 or self._up()
            self._down_until = time.monotonic() + RETRY_S
        if first:
            log.warning(
                "remote KV tier: %s failed (%s); serving on without it for %.0f s (pages "
                "recomputed; errors counted in pypto_kv_tier_errors_total)",
                what,
                why,
                RETRY_S,
            )

    def _call(self, what: str, fn: Callable[[], T]) -> T | None:
        """fn() on the reader thread, or None if the tier is off, fn raises, or it runs past
        CALL_TIMEOUT_S (the tier goes off; the call finishes on its own)."""
        if not self._up():
            return None
        future = self._reader.submit(fn)
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            self._failed(what, f"no answer within {CALL_TIMEOUT_S} s")
        except Exception as e:  # a binding error: a miss, the tier off for a while
            self._failed(what, repr(e))
        return None

    # --- the page format --------------------------------------------------------------------

    def _header(self, page_hash: bytes) -> dict[str, object]:
        return {
            "digest": self.digest,
            "hash": page_hash.hex(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.page_shape),
            "tensors": self.num_tensors,
            "payload_bytes": self.payload_bytes,
        }

    def _sign(self, page_hash: bytes, body: bytes | memoryview) -> bytes:
        """The page's digest: its key and its bytes, keyed by the pool's secret."""
        name = self.key(page_hash).encode()
        return keyed_digest(self._secret, struct.pack("<I", len(name)), name, body)

    def encode(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> bytes:
        header = self._header(page_hash) | {"token_ids": list(token_ids)}
        head = json.dumps(header, separators=(",", ":")).encode()
        head = MAGIC + struct.pack("<I", len(head)) + head
        payload = kv_bytes(kv)
        body = head + payload
        return body + self._sign(page_hash, body)

    def decode(self, page_hash: bytes, token_ids: tuple[int, ...], data: bytes) -> PageKV:
        """The page's KV from a stored value; ValueError saying what is wrong with it."""
        if len(data) < len(MAGIC) + 4 + DIGEST_BYTES or not data.startswith(MAGIC):
            raise ValueError("not a page (bad magic or too short)")
        body, digest = memoryview(data)[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if not hmac.compare_digest(self._sign(page_hash, body), digest):
            raise ValueError("its digest is not the pool's (forged, moved or damaged)")
        (size,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4 + size
        if start + self.payload_bytes + DIGEST_BYTES != len(data):
            raise ValueError(f"{len(data)} bytes, not a page of this layout")
        try:
            header = json.loads(data[len(MAGIC) + 4 : start])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"bad header: {e}") from None
        if not isinstance(header, dict):
            raise ValueError("bad header")
        for key, value in self._header(page_hash).items():
            if header.get(key) != value:
                raise ValueError(f"{key} is {header.get(key)!r}, expected {value!r}")
        if header.get("token_ids") != list(token_ids):
            raise ValueError("its token ids are not the prompt's")
        payload = bytearray(data[start : start + self.payload_bytes])
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
        return tuple(kv.view(self.num_tensors, *self.page_shape).unbind())

    # --- the tier interface -----------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)

    def probe(self, pages: list[tuple[bytes, tuple[int, ...]]]) -> None:
        """Ask the pool, in one call, which of a prompt's pages it holds (before `tokens`
        answers for them)."""
        with self._lock:
            ask = [(h, t) for h, t in pages if h not in self._known]
        if not ask:
            return
        found = self._call(
            "a lookup", lambda: self.pool.batch_is_exist([self.key(h) for h, _ in ask])
        )
        if found is None:
            return
        if any(f < 0 for f in found):
            self._failed("a lookup", f"error {min(found)}")
            return
        with self._lock:
            for (page_hash, token_ids), present in zip(ask, found, strict=True):
                if present == 1:
                    self._remember(page_hash, token_ids)

    def _remember(self, page_hash: bytes, token_ids: tuple[int, ...]) -> None:
        self._known[page_hash] = token_ids
        self._known.move_to_end(page_hash)
        if len(self._known) > KNOWN_PAGES:
            self._known.popitem(last=False)

    def tokens(self, page_hash: bytes) -> tuple[int, ...] | None:
        if not self._up():
            return None
        with self._lock:
            return self._known.get(page_hash)

    def store(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        """Queue a copy of the page for writing (nothing if the pool is known to hold it)."""
        with self._lock:
            if page_hash in self._known or not self._up():
                return
            if self._queue.qsize() >= max(MAX_PENDING_BYTES // self.payload_bytes, 1):
                return
            self._remember(page_hash, token_ids)
        self._queue.put((page_hash, token_ids, tuple(t.to("cpu", copy=True) for t in kv)))

    def load(self, page_hash: bytes) -> PageKV | None:
        """A copy of the page (it stays in the pool for the others), or None (a miss)."""
        with self._lock:
            token_ids = self._known.get(page_hash)
        if token_ids is None:
            return None
        data = self._call("a load", lambda: self.pool.get(self.key(page_hash)))
        if not data:  # gone (evicted, its holder left) or the tier is off
            self._forget(page_hash)
            return None
        try:
            return self.decode(page_hash, token_ids, data)
        except ValueError as e:
            log.warning("remote KV page %s is unusable (%s): a miss", self.key(page_hash), e)
            with self._lock:
                self.num_rejected += 1
                self._damaged.add(page_hash)
            self._forget(page_hash)
            return None

    def _forget(self, page_hash: bytes) -> None:
        with self._lock:
            self._known.pop(page_hash, None)

    def lru_hash(self) -> bytes | None:
        return None  # the master evicts

    def discard(self, page_hash: bytes) -> bool:
        return False  # shared: other servers may want it

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._known)

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and leave the pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10.0)
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self._up():
            leave(self.pool)
        else:  # a pool that stopped answering takes ~10 s to refuse the goodbye
            threading.Thread(target=leave, args=(self.pool,), daemon=True).start()

    # --- the writer thread --------------------------------------------------------------------

    def _write_loop(self) -> None:
        background_priority()  # its writes wait for the steps' cores to be free
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                page_hash, token_ids, kv = item
                if not self._up():
                    self._forget(page_hash)
                    continue
                with self._lock:
                    replace = page_hash in self._damaged
                    self._damaged.discard(page_hash)
                write = self.pool.upsert if replace else self.pool.put
                code = write(self.key(page_hash), self.encode(page_hash, token_ids, kv))
                if code == 0:
                    self.num_written += 1
                elif code != OBJECT_EXISTS:
                    self._forget(page_hash)
                    self._failed("a write", f"error {code}")
            except Exception as e:  # the engine must not lose the tier to one bad write
                self._forget(item[0]) if item is not None else None
                self._failed("a write", repr(e))
            finally:
                self._queue.task_done()


OBJECT_EXISTS = -704
"""Mooncake's OBJECT_ALREADY_EXISTS: another server wrote the page first."""
