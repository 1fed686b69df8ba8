"""Page pool with a prefix cache: pure-Python bookkeeping for the paged KV cache.

The KV store owns the tensors; this module only decides which page ids hold what. The cache
is a hash chain over FULL pages: a page's hash covers its parent page's hash, its own token ids
and an optional salt, so equal hashes mean equal prefixes. A hit is also checked token by token,
so a hash collision can never serve the wrong KV.

Free pages (ref_count 0) sit in an LRU queue, least recently freed at the head. A freed cached
page keeps its hash and stays findable until `allocate` reuses it (lazy eviction); just before
its hash is dropped, `on_evict` is told, so the KV store can demote the page's KV to a lower
tier (its K/V are still intact: the caller overwrites them only after `allocate` returns).
"""

import hashlib
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

EvictHook = Callable[[int, bytes, tuple[int, ...]], None]
"""Called as on_evict(page_id, page_hash, token_ids) before a cached page is reused."""


def _field(data: bytes | None) -> bytes:
    """Encode an optional byte string unambiguously (presence flag + length prefix)."""
    if data is None:
        return b"\x00"
    return b"\x01" + struct.pack("<Q", len(data)) + data


def hash_page(parent: bytes | None, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """Stable 128-bit hash of a full page given its parent page's hash (None for the first page).

    Token ids are packed as little-endian int64, so the digest is the same on every machine and
    in every process (unlike Python's `hash`).
    """
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    h = hashlib.blake2b(digest_size=16)
    h.update(_field(parent))
    h.update(_field(tokens))
    h.update(_field(None if salt is None else salt.encode("utf-8")))
    return h.digest()


class _Page:
    """One KV page: its reference count, its prefix-cache entry, and its free-queue links."""

    __slots__ = ("hash", "next", "page_id", "prev", "ref_count", "token_ids")

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: _Page | None = None
        self.next: _Page | None = None


class _FreeQueue:
    """Doubly linked LRU list of free pages with O(1) append, pop-head and remove-from-middle."""

    def __init__(self) -> None:
        self._head = _Page(-1)  # sentinels: real pages sit strictly between them
        self._tail = _Page(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Page]:
        page = self._head.next
        while page is not self._tail:
            assert page is not None
            yield page
            page = page.next

    def append(self, page: _Page) -> None:
        """Put `page` at the tail (most recently freed)."""
        last = self._tail.prev
        assert last is not None and page.prev is None and page.next is None
        last.next = page
        page.prev = last
        page.next = self._tail
        self._tail.prev = page
        self._len += 1

    def remove(self, page: _Page) -> None:
        """Unlink `page`, wherever it is in the queue."""
        prev, nxt = page.prev, page.next
        assert prev is not None and nxt is not None, "page is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        page.prev = page.next = None
        self._len -= 1

    def popleft(self) -> _Page:
        """Remove and return the head (least recently freed) page."""
        page = self._head.next
        assert page is not None and page is not self._tail, "free queue is empty"
        self.remove(page)
        return page


class PagePool:
    """Fixed pool of `num_pages` KV pages of `page_size` tokens each, with a prefix cache.

    Invariant: a page has a hash iff the index maps that hash to it (the first page cached
    under a hash is canonical; a later duplicate stays uncached).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        on_evict: EvictHook | None = None,
    ) -> None:
        if num_pages < 0 or page_size < 1:
            raise ValueError(f"bad pool shape: num_pages={num_pages}, page_size={page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_evict = on_evict
        self.num_evictions = 0  # cached pages whose hash was dropped when they were reused
        self._pages = [_Page(i) for i in range(num_pages)]
        self._free = _FreeQueue()
        for page in self._pages:
            self._free.append(page)
        self._index: dict[bytes, _Page] = {}

    @property
    def num_free(self) -> int:
        """Number of pages with ref_count 0, cached or not (all of them can be allocated)."""
        return len(self._free)

    def _page(self, page_id: int) -> _Page:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"page id {page_id} out of range [0, {self.num_pages})")
        return self._pages[page_id]

    def _evict(self, page: _Page) -> None:
        """Drop `page`'s prefix-cache entry, if it has one."""
        if page.hash is None:
            return
        if self.on_evict is not None:
            assert page.token_ids is not None
            self.on_evict(page.page_id, page.hash, page.token_ids)
        del self._index[page.hash]
        page.hash = None
        page.token_ids = None
        self.num_evictions += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages from the LRU head, evicting their cached hashes; each gets ref_count 1.

        Raises ValueError (and changes nothing) if `n` is negative or more than `num_free`.
        """
        if not 0 <= n <= self.num_free:
            raise ValueError(f"cannot allocate {n} pages: {self.num_free} free")
        page_ids = []
        for _ in range(n):
            page = self._free.popleft()
            self._evict(page)
            page.ref_count = 1
            page_ids.append(page.page_id)
        return page_ids

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference to each page; pages reaching 0 join the LRU tail in the order given.

        Callers pass a request's pages in reverse so its tail pages are evicted first. Raises
        ValueError (and changes nothing) if a page would drop below 0 references.
        """
        for page_id, count in Counter(page_ids).items():
            if self._page(page_id).ref_count < count:
                raise ValueError(f"page {page_id} freed more times than it is referenced")
        for page_id in page_ids:
            page = self._pages[page_id]
            page.ref_count -= 1
            if page.ref_count == 0:
                self._free.append(page)

    def lookup(
        self, token_ids: Sequence[int], salt: str | None = None
    ) -> tuple[list[int], list[bytes]]:
        """Longest chain of cached full pages matching a prefix of `token_ids`; changes nothing.

        Page i matches if the hash chain (with `salt` in every page's hash) is indexed and the
        indexed page holds exactly the same tokens. Returns (page ids, their hashes); a partial
        last page never matches. Returns ([], []) when prefix caching is disabled.
        """
        page_ids: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return page_ids, hashes
        parent = None
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            chunk = tuple(token_ids[start : start + self.page_size])
            parent = hash_page(parent, chunk, salt)
            page_id = self.get(parent, chunk)
            if page_id is None:
                break
            page_ids.append(page_id)
            hashes.append(parent)
        return page_ids, hashes

    def get(self, page_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The page cached under `page_hash` if it holds exactly `token_ids`; changes nothing."""
        page = self._index.get(page_hash)
        return page.page_id if page is not None and page.token_ids == token_ids else None

    def acquire(self, page_ids: Sequence[int]) -> None:
        """Add one reference to each page (from `lookup`); a page at ref 0 leaves the free LRU."""
        pages = [self._page(page_id) for page_id in page_ids]
        for page in pages:
            if page.ref_count == 0:
                self._free.remove(page)
            page.ref_count += 1

    def cache_page(self, page_id: int, page_hash: bytes, token_ids: Sequence[int]) -> bool:
        """Register a just-filled, referenced full page under `page_hash`; True if it is now
        indexed there for the first time.

        If `page_hash` is already indexed for another page, that page stays canonical and this
        one stays uncached. Re-caching a page under its own hash is a no-op. No-op when prefix
        caching is disabled.
        """
        if not self.enable_prefix_caching:
            return False
        page = self._page(page_id)
        if len(token_ids) != self.page_size:
            raise ValueError(f"cache_page needs a full page of {self.page_size} tokens")
        if page.ref_count == 0:
            raise ValueError(f"cache_page on free page {page_id}")
        if page.hash is not None:
            if page.hash != page_hash:
                raise ValueError(f"page {page_id} is already cached under another hash")
            return False
        if page_hash in self._index:
            return False
        page.hash = page_hash
        page.token_ids = tuple(token_ids)
        self._index[page_hash] = page
        return True

    def page_hash(self, page_id: int) -> bytes | None:
        """The hash a page is cached under, or None if it is not in the prefix cache."""
        return self._page(page_id).hash

    def page_tokens(self, page_id: int) -> tuple[int, ...] | None:
        """The token ids a page is cached with, or None if it is not in the prefix cache."""
        return self._page(page_id).token_ids

    def ref_count(self, page_id: int) -> int:
        """Number of references currently held on a page."""
        return self._page(page_id).ref_count

    def free_page_ids(self) -> list[int]:
        """Free page ids in LRU order, head (next to be allocated) to tail."""
        return [page.page_id for page in self._free]

    def cached_hashes(self) -> dict[bytes, int]:
        """Copy of the prefix-cache index: hash -> page id."""
        return {page_hash: page.page_id for page_hash, page in self._index.items()}

    def cached_pages(self) -> list[tuple[bytes, tuple[int, ...], int]]:
        """(hash, token ids, page id) of every cached page, least recently used first: the
        free ones in LRU order, then those requests hold."""
        free = [page for page in self._free if page.hash is not None]
        held = [page for page in self._index.values() if page.ref_count > 0]
        return [(p.hash, p.token_ids, p.page_id) for p in [*free, *held]]  # type: ignore[misc]
