"""The SSD tier: one file per page under `kv_ssd_dir`, written by a background thread.

Files live in a folder named after the digest of the model and KV layout
(`<kv_ssd_dir>/<digest[:16]>/<page hash>.kvpage`), so two models can share a directory without
ever reading each other's pages. A file is

    MAGIC | header length (u32, little-endian) | header (JSON) | payload (raw) | digest

(payload: the page's tensors one after another, GQA's K then V or MLA's one latent tensor)
and its header carries the digest, page size, dtype, page shape, number of tensors, the
page's hash and token ids and the payload length. The last 32 bytes are a BLAKE2b digest of
everything before them, keyed by the directory's secret (`<kv_ssd_dir>/secret`, 0600, made
on first use): a file made without the secret (a forged page, one with a recomputed plain
checksum) is rejected like a truncated, corrupted or foreign one (any field disagreeing): a
miss, logged and deleted, never served. Folders are 0700 and files 0600, as their headers
hold prompts' token ids. At start-up the folder is scanned (headers only) so pages written by
an earlier run of the same model and configuration are found again; the oldest beyond the
budget are deleted.

An I/O error (a read-only or full disk, a failing read, write or delete) never fails a step:
the page concerned is a miss or is dropped (recomputed when needed), the error is counted
(`num_errors`) and the first of each kind logged. A folder or secret that cannot be used at
start-up turns the tier off (capacity 0, said in the log).

Writes never block the engine: `store` keeps the page in memory and queues it; the writer
thread writes `<name>.<pid>.tmp` and renames it into place. A page loaded while still queued is
served from memory. All index changes happen under one lock.
"""

from __future__ import annotations

import atexit
import hmac
import json
import logging
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import torch

from pypto_serving.kv.tier import (
    PageKV,
    PageTier,
    background_priority,
    kv_bytes,
    page_bytes,
)
from pypto_serving.paths import (
    DIGEST_BYTES,
    keyed_digest,
    private_dir,
    secret_key,
    write_atomically,
)

log = logging.getLogger(__name__)

MAGIC = b"PYPTOKV2"
SUFFIX = ".kvpage"
HEADER_BYTES = 4096
"""Bytes budgeted per file for the magic, header and digest (the payload is the page's KV)."""


class DiskTier(PageTier):
    name = "ssd"

    def __init__(
        self,
        directory: Path,
        capacity: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        digest: str,
        num_tensors: int = 2,
    ) -> None:
        """capacity pages of `num_tensors` tensors each of page_shape = (layers, heads,
        page_size, row); digest: the model's and the KV layout's (names the folder)."""
        self.capacity, self.page_shape, self.dtype = capacity, page_shape, dtype
        self.digest, self.num_tensors = digest, num_tensors
        self.dir = Path(directory) / digest[:16]
        self.payload_bytes = page_bytes(page_shape, dtype, num_tensors)
        self.num_unreadable = 0
        """Files found truncated, corrupted, foreign or forged (each deleted)."""
        self.num_errors = 0
        """I/O errors (reads, writes, deletes, the folder): each cost a page, never a step."""
        self.off: str | None = None
        """Why the tier is off (its folder or secret cannot be used), or None."""
        self._logged: set[str] = set()
        self._index: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._pending: dict[bytes, PageKV] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        Path(directory).mkdir(parents=True, exist_ok=True)  # cannot: a start-up error
        try:
            private_dir(self.dir)
            self._key = secret_key(Path(directory))
        except OSError as e:
            self._key, self.capacity, self.off = b"", 0, str(e)
            self._error("use", self.dir, e)
        self.num_found = 0 if self.off else self._scan()
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
            "tensors": self.num_tensors,
            "hash": page_hash.hex(),
            "payload_bytes": self.payload_bytes,
        }

    # --- file format ----------------------------------------------------------------------

    def _encode(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> bytes:
        payload = kv_bytes(kv)
        header = self._expected_header(page_hash) | {"token_ids": list(token_ids)}
        head = json.dumps(header, separators=(",", ":")).encode()
        head = MAGIC + struct.pack("<I", len(head)) + head
        return head + payload + keyed_digest(self._key, head, payload)

    def _read_header(self, f: BinaryIO, page_hash: bytes) -> tuple[dict[str, object], bytes]:
        """(header, the file's bytes up to the payload) of an open file; ValueError if it is
        not ours (its digest is checked with the payload, by `_read`)."""
        prefix = f.read(len(MAGIC) + 4)
        if len(prefix) != len(MAGIC) + 4 or prefix[: len(MAGIC)] != MAGIC:
            raise ValueError("bad magic")
        (size,) = struct.unpack("<I", prefix[len(MAGIC) :])
        if size > HEADER_BYTES + 64 * self.page_shape[2]:
            raise ValueError("header too long")
        raw = f.read(size)
        try:
            header = json.loads(raw)
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
        return header, prefix + raw

    def _read(self, page_hash: bytes, token_ids: tuple[int, ...]) -> PageKV:
        with open(self._path(page_hash), "rb") as f:
            header, head = self._read_header(f, page_hash)
            payload = bytearray(f.read(self.payload_bytes + DIGEST_BYTES + 1))
        if len(payload) != self.payload_bytes + DIGEST_BYTES:
            want = self.payload_bytes + DIGEST_BYTES
            raise ValueError(f"payload and digest are {len(payload)} bytes, expected {want}")
        digest = bytes(payload[self.payload_bytes :])
        del payload[self.payload_bytes :]
        if not hmac.compare_digest(digest, keyed_digest(self._key, head, payload)):
            raise ValueError("the keyed digest does not match (damaged, or not written here)")
        if tuple(header["token_ids"]) != token_ids:  # type: ignore[arg-type]
            raise ValueError("token ids differ from the index")
        if not payload:  # a pipeline stage without layers of this group: an empty page
            return tuple(torch.empty(self.num_tensors, *self.page_shape, dtype=self.dtype))
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
        return tuple(kv.view(self.num_tensors, *self.page_shape).unbind())

    def _error(self, what: str, path: Path, e: OSError) -> None:
        """Count an I/O error; log the first of each kind (what: read, write, delete, ...)."""
        with self._lock:
            self.num_errors += 1
            first = what not in self._logged
            self._logged.add(what)
        if first:
            log.warning(
                "SSD KV tier: cannot %s %s (%s); serving on without it (pages recomputed when "
                "needed; further such errors are counted in pypto_kv_tier_errors_total)",
                what,
                path,
                e,
            )

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # e.g. a read-only mount: the file stays, unindexed
            self._error("delete", path, e)

    def _drop_file(self, path: Path, why: str) -> None:
        log.warning("SSD KV page %s is unusable (%s): deleted", path.name, why)
        self.num_unreadable += 1
        self._unlink(path)

    def _scan(self) -> int:
        """Index the pages an earlier run left (oldest first); delete what is not ours."""
        files: list[tuple[int, bytes, tuple[int, ...]]] = []
        try:
            paths = list(self.dir.iterdir())
        except OSError as e:
            self._error("list", self.dir, e)
            return 0
        for path in paths:
            if path.suffix == ".tmp":  # a write cut short by a crash
                self._unlink(path)
                continue
            try:
                page_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
                if not path.name.endswith(SUFFIX) or len(page_hash) != 16:
                    raise ValueError("not a page file name")
                with open(path, "rb") as f:
                    header, head = self._read_header(f, page_hash)
                stat = path.stat()
            except OSError as e:
                self._error("read", path, e)
                continue
            except ValueError as e:
                self._drop_file(path, str(e))
                continue
            want = len(head) + self.payload_bytes + DIGEST_BYTES
            if stat.st_size != want:
                self._drop_file(path, f"{stat.st_size} bytes, expected {want}")
                continue
            files.append((stat.st_mtime_ns, page_hash, tuple(header["token_ids"])))  # type: ignore[arg-type]
        files.sort()
        over = max(len(files) - self.capacity, 0)
        for _, page_hash, _tokens in files[:over]:
            self._unlink(self._path(page_hash))  # over budget: the oldest go
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
        if len(kv) != self.num_tensors:
            raise ValueError(f"a page of {len(kv)} tensors for a tier of {self.num_tensors}")
        owned = tuple(t.to("cpu", copy=True) for t in kv)
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
        except OSError as e:  # a failing disk: a miss (the file is left alone)
            self._error("read", path, e)
            return None
        except ValueError as e:
            self._drop_file(path, str(e))
            return None
        self._unlink(path)  # the page moves up: one copy at a time
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
        background_priority()  # its writes wait for the steps' cores to be free
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
                    self._unlink(self._path(page_hash))
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
        except OSError as e:  # a read-only or full disk: the page is dropped
            self._error("write", path, e)
            with self._lock:
                if self._pending.get(page_hash) is kv:
                    del self._pending[page_hash]
                    del self._index[page_hash]
            return
        with self._lock:
            stale = False
            if self._pending.get(page_hash) is kv:
                del self._pending[page_hash]
            else:  # loaded or dropped while being written
                stale = page_hash not in self._index
        if stale:
            self._unlink(path)
