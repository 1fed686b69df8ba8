"""The SSD tier: one file per page under `kv_ssd_dir`, written by a background thread.

Files live in a folder named after the digest of the model and KV layout
(`<kv_ssd_dir>/<digest[:16]>/<page hash>.kvpage`), so two models can share a directory without
ever reading each other's pages. A file is

    MAGIC | header length (u32, little-endian) | header (JSON) | payload (K then V, raw)

and its header carries the digest, page size, dtype, page shape, the page's hash and token ids,
the payload length and its blake2b checksum. A file that is truncated, corrupted or foreign
(any field disagreeing) is a miss: it is logged and deleted, never served. At start-up the
folder is scanned (headers only) so pages written by an earlier run of the same model and
configuration are found again; the oldest beyond the budget are deleted.

Writes never block the engine: `store` keeps the page in memory and queues it; the writer
thread writes `<name>.<pid>.tmp` and renames it into place. A page loaded while still queued is
served from memory. All index changes happen under one lock.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import torch

from pypto_serving.kv.tier import PageKV, PageTier, page_bytes
from pypto_serving.paths import write_atomically

log = logging.getLogger(__name__)

MAGIC = b"PYPTOKV1"
SUFFIX = ".kvpage"
HEADER_BYTES = 4096
"""Bytes budgeted per file for the magic and header (the payload is the page's KV)."""


def _checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


class DiskTier(PageTier):
    name = "ssd"

    def __init__(
        self,
        directory: Path,
        capacity: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        digest: str,
    ) -> None:
        self.capacity, self.page_shape, self.dtype = capacity, page_shape, dtype
        self.digest = digest
        self.dir = Path(directory) / digest[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.payload_bytes = page_bytes(page_shape, dtype)
        self.num_unreadable = 0
        """Files found truncated, corrupted or foreign (each deleted)."""
        self.num_write_errors = 0
        self._index: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._pending: dict[bytes, PageKV] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self.num_found = self._scan()
        """Pages found on disk at start-up (written by an earlier run)."""
        self._thread = threading.Thread(target=self._write_loop, name="pypto-kv-ssd", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # queued writes reach the disk even without close()

    def _path(self, page_hash: bytes) -> Path:
        return self.dir / (page_hash.hex() + SUFFIX)

    def _expected_header(self, page_hash: bytes) -> dict[str, object]:
        return {
            "digest": self.digest,
            "page_size": self.page_shape[2],
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.page_shape),
            "hash": page_hash.hex(),
            "payload_bytes": self.payload_bytes,
        }

    # --- file format ----------------------------------------------------------------------

    def _encode(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> bytes:
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in kv)
        header = self._expected_header(page_hash)
        header |= {"token_ids": list(token_ids), "checksum": _checksum(payload)}
        head = json.dumps(header, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(head)) + head + payload

    def _read_header(self, f: BinaryIO, page_hash: bytes) -> tuple[dict[str, object], int]:
        """(header, payload offset) of an open file; ValueError if it is not ours."""
        prefix = f.read(len(MAGIC) + 4)
        if len(prefix) != len(MAGIC) + 4 or prefix[: len(MAGIC)] != MAGIC:
            raise ValueError("bad magic")
        (size,) = struct.unpack("<I", prefix[len(MAGIC) :])
        if size > HEADER_BYTES + 64 * self.page_shape[2]:
            raise ValueError("header too long")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"bad header: {e}") from None
        if not isinstance(header, dict):
            raise ValueError("bad header")
        for key, want in self._expected_header(page_hash).items():
            if header.get(key) != want:
                raise ValueError(f"{key} is {header.get(key)!r}, expected {want!r}")
        tokens = header.get("token_ids")
        if not (
            isinstance(tokens, list)
            and len(tokens) == self.page_shape[2]
            and all(isinstance(t, int) for t in tokens)
        ):
            raise ValueError("bad token ids")
        return header, len(MAGIC) + 4 + size

    def _read(self, page_hash: bytes, token_ids: tuple[int, ...]) -> PageKV:
        with open(self._path(page_hash), "rb") as f:
            header, _ = self._read_header(f, page_hash)
            payload = bytearray(f.read(self.payload_bytes + 1))
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload is {len(payload)} bytes, expected {self.payload_bytes}")
        if header["checksum"] != _checksum(payload):
            raise ValueError("checksum mismatch")
        if tuple(header["token_ids"]) != token_ids:  # type: ignore[arg-type]
            raise ValueError("token ids differ from the index")
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
        kv = kv.view(2, *self.page_shape)
        return kv[0], kv[1]

    def _drop_file(self, path: Path, why: str) -> None:
        log.warning("SSD KV page %s is unusable (%s): deleted", path.name, why)
        self.num_unreadable += 1
        path.unlink(missing_ok=True)

    def _scan(self) -> int:
        """Index the pages an earlier run left (oldest first); delete what is not ours."""
        files = []
        for path in self.dir.iterdir():
            if path.suffix == ".tmp":  # a write cut short by a crash
                path.unlink(missing_ok=True)
                continue
            try:
                page_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
                if not path.name.endswith(SUFFIX) or len(page_hash) != 16:
                    raise ValueError("not a page file name")
                with open(path, "rb") as f:
                    header, offset = self._read_header(f, page_hash)
                stat = path.stat()
                want = offset + self.payload_bytes
                if stat.st_size != want:
                    raise ValueError(f"{stat.st_size} bytes, expected {want}")
            except (OSError, ValueError) as e:
                self._drop_file(path, str(e))
                continue
            files.append((stat.st_mtime_ns, page_hash, tuple(header["token_ids"])))  # type: ignore[arg-type]
        files.sort()
        over = max(len(files) - self.capacity, 0)
        for _, page_hash, _tokens in files[:over]:
            self._path(page_hash).unlink(missing_ok=True)  # over budget: the oldest go
        for _, page_hash, tokens in files[over:]:
            self._index[page_hash] = tokens
        return len(self._index)

    # --- the tier interface ---------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def tokens(self, page_hash: bytes) -> tuple[int, ...] | None:
        with self._lock:
            return self._index.get(page_hash)

    def store(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        owned = (kv[0].to("cpu", copy=True), kv[1].to("cpu", copy=True))
        with self._lock:
            if page_hash in self._index:
                raise ValueError("page already stored in the ssd tier")
            if len(self._index) >= self.capacity:
                raise ValueError("the ssd tier is full")
            self._index[page_hash] = token_ids
            self._pending[page_hash] = owned
        self._queue.put(("write", page_hash))

    def load(self, page_hash: bytes) -> PageKV | None:
        with self._lock:
            token_ids = self._index.pop(page_hash, None)
            kv = self._pending.pop(page_hash, None)
        if token_ids is None:  # its write failed since it was looked up
            return None
        if kv is not None:  # still queued: served from memory, the write is skipped
            return kv
        path = self._path(page_hash)
        try:
            kv = self._read(page_hash, token_ids)
        except (OSError, ValueError) as e:
            self._drop_file(path, str(e))
            return None
        path.unlink(missing_ok=True)  # the page moves up: one copy at a time
        return kv

    def lru_hash(self) -> bytes | None:
        with self._lock:
            return next(iter(self._index), None)

    def discard(self, page_hash: bytes) -> bool:
        with self._lock:
            if self._index.pop(page_hash, None) is None:
                return False
            self._pending.pop(page_hash, None)
        self._queue.put(("delete", page_hash))
        return True

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        self._queue.join()

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # --- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, page_hash = item
                if op == "write":
                    self._write(page_hash)
                else:
                    with self._lock:
                        if page_hash in self._index:  # stored again since: keep the file
                            continue
                        self._path(page_hash).unlink(missing_ok=True)
            except Exception:  # the engine must not lose its SSD tier to one bad write
                log.exception("SSD KV tier: %s failed", item)
            finally:
                self._queue.task_done()

    def _write(self, page_hash: bytes) -> None:
        with self._lock:
            kv = self._pending.get(page_hash)
            token_ids = self._index.get(page_hash)
        if kv is None or token_ids is None:
            return  # loaded or dropped before its turn came
        path = self._path(page_hash)
        try:
            write_atomically(path, self._encode(page_hash, token_ids, kv))
        except OSError as e:
            log.warning("SSD KV tier: cannot write %s (%s); page dropped", path, e)
            self.num_write_errors += 1
            with self._lock:
                if self._pending.get(page_hash) is kv:
                    del self._pending[page_hash]
                    del self._index[page_hash]
            return
        with self._lock:
            if self._pending.get(page_hash) is kv:
                del self._pending[page_hash]
            elif page_hash not in self._index:  # loaded or dropped while being written
                path.unlink(missing_ok=True)
