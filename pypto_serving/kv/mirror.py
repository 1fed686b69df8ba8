"""The CPU tier under tensor and pipeline parallelism: rank 0 decides, the other ranks mirror.

Every rank's store holds its own share of each page (its KV heads under TP, its stage's
layers under PP) with the same page ids and the same CPU-tier capacity in pages. Rank 0's
store decides every move as with one rank (demote a reused cached page, load a prefix hit
back, swap a preempted request out and in) and records it in a `Journal`: the device pages it
reads and writes and the CPU tier's calls, in order, each page's KV named by the order it
was produced. A model with several KV groups (a pool each) has a journal per group; their
moves ride together on the next step (`StepInputs.moves`, JSON: one list per group,
`take_moves`) and every other rank replays each group's on its own store of that group before
that step's forward (`follow_moves`), so its tiers hold the same pages in the same slots:

    rank 0:  schedule ──moves recorded──▶ step + moves ──broadcast──▶ forward
    rank r:                               step + moves ──replay on its share──▶ forward

MLA's latent is the same on every TP rank, so only rank 0 keeps it in the CPU and SSD tiers;
the device pages a journal wrote are then broadcast from rank 0 once per step.

Pages another server sent (disaggregated serving) reach every rank when they arrive, each its
share (`executor/kv_shares.py`), held under a key; rank 0's journal says when they are
written into device pages ("received", then the writes) or forgotten ("drop_received").

The SSD tier: every rank keeps its share in its own folder (`<kv_ssd_dir>/rank<r>`), and its
stores and evictions are journaled like the CPU tier's (a rank whose index differs, after a
failed write or a damaged file found at start-up, replays them tolerantly). A read can fail
on one rank and not another, so SSD loads are agreed before rank 0 counts them: at
admission rank 0 reads its pages, then sends every rank a control message (`SSD_LOAD`: the
moves so far, the pages to load); each rank loads its share and a MIN all-reduce tells how
many leading pages every rank read. Rank 0 keeps only those (the rest: a miss, recomputed),
the other ranks keep theirs until the journal writes them into device pages. A clean
shutdown's spill rides on the stop message.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pypto_serving.distributed import engine_min, tp_broadcast
from pypto_serving.kv.disk_tier import DiskTier
from pypto_serving.kv.host_tier import HostTier
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.tier import PageKV

Op = list[Any]
"""A move: its kind, then its arguments (page ids, hashes in hex, token ids, handles)."""


class Journal:
    """Rank 0's page moves since the last step."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._kvs: list[PageKV] = []  # alive until taken, so their ids stay unique
        self._handles: dict[int, int] = {}

    def record(self, *op: object) -> None:
        self.ops.append(list(op))

    def produced(self, kv: PageKV) -> None:
        """A page's KV came out of the device or the tier (its handle: the order)."""
        self._handles[id(kv)] = len(self._kvs)
        self._kvs.append(kv)

    def handle(self, kv: PageKV) -> int:
        return self._handles[id(kv)]

    def take(self) -> list[Op]:
        """The moves recorded so far, and a fresh start."""
        ops = self.ops
        self.ops, self._kvs, self._handles = [], [], {}
        return ops


def take_moves(journals: list[Journal | None]) -> bytes:
    """Every KV group's moves since the last call (None: a group without a journal), as one
    message: a list of moves per group (b"" when there are none)."""
    ops = [[] if j is None else j.take() for j in journals]
    return json.dumps(ops, separators=(",", ":")).encode() if any(ops) else b""


def group_moves(moves: bytes, num_groups: int) -> list[list[Op]]:
    """`take_moves`' message: each group's moves."""
    groups: list[list[Op]] = json.loads(moves) if moves else [[] for _ in range(num_groups)]
    assert len(groups) == num_groups
    return groups


class JournaledHostTier(HostTier):
    """Rank 0's CPU tier: a HostTier that records its calls into a journal."""

    def __init__(self, journal: Journal, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal = journal

    def store(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        super().store(page_hash, token_ids, kv)
        self.journal.record("store", page_hash.hex(), list(token_ids), self.journal.handle(kv))

    def load(self, page_hash: bytes) -> PageKV | None:
        kv = super().load(page_hash)
        assert kv is not None  # the CPU tier always reads back
        self.journal.record("load", page_hash.hex())
        self.journal.produced(kv)
        return kv

    def discard(self, page_hash: bytes) -> bool:
        found = super().discard(page_hash)
        if found:
            self.journal.record("discard", page_hash.hex())
        return found

    def hold(self, key: str, pages: list[PageKV]) -> None:
        super().hold(key, pages)
        self.journal.record("hold", key, [self.journal.handle(kv) for kv in pages])

    def release(self, key: str) -> list[PageKV]:
        pages = super().release(key)
        self.journal.record("release", key)
        for kv in pages:
            self.journal.produced(kv)
        return pages


class JournaledDiskTier(DiskTier):
    """Rank 0's SSD tier: a DiskTier whose stores and evictions go into a journal (its loads
    are agreed instead: `agree_ssd_loads`)."""

    def __init__(self, journal: Journal, *args: Any, **kwargs: Any) -> None:
        self.journal = journal
        super().__init__(*args, **kwargs)

    def store(self, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
        super().store(page_hash, token_ids, kv)
        self.journal.record("ssd_store", page_hash.hex(), list(token_ids), self.journal.handle(kv))

    def discard(self, page_hash: bytes) -> bool:
        found = super().discard(page_hash)
        if found:
            self.journal.record("ssd_discard", page_hash.hex())
        return found


def _store_on_ssd(ssd: DiskTier, page_hash: bytes, token_ids: tuple[int, ...], kv: PageKV) -> None:
    """Rank 0's SSD store, on a rank whose index may differ from rank 0's (a failed write,
    a damaged file found at start-up): make room as needed; a rank with no room drops it."""
    ssd.discard(page_hash)
    while len(ssd) >= ssd.capacity and (victim := ssd.lru_hash()) is not None:
        ssd.discard(victim)
    if len(ssd) < ssd.capacity:
        ssd.store(page_hash, token_ids, kv)


def replay(
    ops: list[Op],
    cache: PagedCache,
    cpu: HostTier | None,
    ssd: DiskTier | None = None,
    agreed: dict[bytes, PageKV] | None = None,
    received: dict[str, list[PageKV]] | None = None,
) -> None:
    """Do rank 0's moves on this rank's share, in order (agreed: the SSD pages this rank
    loaded at rank 0's `SSD_LOAD`, taken as the moves write them into the device; received:
    this rank's share of pages another server sent, by key, taken likewise)."""
    kvs: list[PageKV] = []
    for kind, *args in ops:
        if kind.endswith("received"):
            assert received is not None
            if kind == "received":
                kvs.extend(received.pop(args[0]))
            else:  # drop_received
                received.pop(args[0], None)
            continue
        if kind.startswith("ssd_"):
            assert ssd is not None and agreed is not None
            if kind == "ssd_store":
                _store_on_ssd(ssd, bytes.fromhex(args[0]), tuple(args[1]), kvs[args[2]])
            elif kind == "ssd_discard":
                ssd.discard(bytes.fromhex(args[0]))
            else:  # ssd_load
                kvs.append(agreed.pop(bytes.fromhex(args[0])))
            continue
        if kind == "read":
            kvs.append(cache.read_page(args[0]))
            continue
        if kind == "write":
            cache.write_page(args[0], kvs[args[1]])
            continue
        assert cpu is not None
        if kind == "store":
            cpu.store(bytes.fromhex(args[0]), tuple(args[1]), kvs[args[2]])
        elif kind == "load":
            kv = cpu.load(bytes.fromhex(args[0]))
            assert kv is not None
            kvs.append(kv)
        elif kind == "discard":
            cpu.discard(bytes.fromhex(args[0]))
        elif kind == "hold":
            cpu.hold(args[0], [kvs[h] for h in args[1]])
        elif kind == "release":
            kvs.extend(cpu.release(args[0]))
        else:
            raise ValueError(f"unknown page move {kind!r}")


def follow_moves(
    ops: list[Op],
    cache: PagedCache,
    cpu: HostTier | None,
    rank: int,
    tp_rank: int,
    share_written: bool,
    ssd: DiskTier | None = None,
    agreed: dict[bytes, PageKV] | None = None,
    received: dict[str, list[PageKV]] | None = None,
) -> None:
    """Before a step's forward, on every rank: ranks > 0 replay rank 0's moves on their CPU
    and SSD tiers (if they keep them) and their shares of pages other servers sent (if they
    hold any); with `share_written` (a KV the same on every TP rank, MLA's: one copy, kept
    by each stage's first TP rank) the device pages the moves wrote go from that rank to the
    other TP ranks of its stage."""
    if rank > 0 and (cpu is not None or ssd is not None or received):
        replay(ops, cache, cpu, ssd, agreed, received)
    written = sorted({op[1] for op in ops if op[0] == "write"})
    if not share_written or not written:
        return
    shape = (len(written), cache.spec.num_tensors, *cache.spec.page_shape)
    pages = torch.empty(shape, dtype=cache.spec.dtype, device=cache.device)
    if tp_rank == 0:
        for i, page_id in enumerate(written):
            for j, t in enumerate(cache.read_page(page_id)):
                pages[i, j].copy_(t)
    tp_broadcast(pages)
    if tp_rank > 0:
        for i, page_id in enumerate(written):
            cache.write_page(page_id, tuple(pages[i]))


def ssd_load_message(group: int, ops: list[Op], hashes: list[bytes], loaded: int) -> bytes:
    """Rank 0's `SSD_LOAD` in KV group `group`: its moves there so far, the pages it read
    (each rank loads its share) and the one it could not (each rank drops it, as rank 0's
    tier did)."""
    message = {
        "group": group,
        "moves": ops,
        "load": [h.hex() for h in hashes[:loaded]],
        "drop": [h.hex() for h in hashes[loaded : loaded + 1]],
    }
    return json.dumps(message, separators=(",", ":")).encode()


def ssd_load_group(message: bytes) -> int:
    """The KV group an `SSD_LOAD` message is for."""
    group: int = json.loads(message)["group"]
    return group


def agree_ssd_loads(
    message: bytes,
    cache: PagedCache,
    cpu: HostTier | None,
    ssd: DiskTier | None,
    agreed: dict[bytes, PageKV],
    rank: int,
    tp_rank: int,
    share_written: bool,
    received: dict[str, list[PageKV]] | None = None,
) -> int:
    """On every rank, at rank 0's `SSD_LOAD`: mirror the moves so far, load this rank's share
    of the pages (ranks > 0; a rank without an SSD tier keeps none and agrees to all), and
    return how many leading pages every rank read (a MIN all-reduce over the world). Ranks
    > 0 keep those in `agreed` until the journal writes them into device pages."""
    msg = json.loads(message)
    if msg["moves"]:
        follow_moves(msg["moves"], cache, cpu, rank, tp_rank, share_written, ssd, agreed, received)
    hashes = [bytes.fromhex(h) for h in msg["load"]]
    count, mine = len(hashes), list[tuple[bytes, PageKV]]()
    if rank > 0 and ssd is not None:
        for page_hash in hashes:  # each load removes the page, as on rank 0
            kv = ssd.load(page_hash)
            if kv is None:
                count = min(count, len(mine))
            elif len(mine) < count:
                mine.append((page_hash, kv))
        for h in msg["drop"]:
            ssd.discard(bytes.fromhex(h))
    agreed_count = torch.tensor([count], dtype=torch.int64, device=cache.device)
    engine_min(agreed_count)
    n = int(agreed_count.item())
    agreed.update(mine[:n])
    return n
