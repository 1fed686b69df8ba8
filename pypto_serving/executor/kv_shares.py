"""Handoffs between prefill and decode servers under tensor and pipeline parallelism: every
rank's share of a prompt's pages.

Each rank holds its share of every page (its KV heads under TP, its stage's layers under PP)
under the same page ids; rank 0 decides. A handoff's buffer is every rank's share in rank
order, each packed as `kv.handoff.pack` lays out one rank's groups; both servers run the same
TP and PP (their layout digests say so), so a rank's share on one is its share on the other.
A rank carries a group's pages unless they are the same on every TP rank (MLA's latent) and
it is not its stage's first TP rank: those go once per stage, and the decode server copies
them to the stage's other TP ranks as it writes them (`kv/mirror.py`).

    prefill, rank 0:  KV_EXPORT (page ids) ──▶ rank r packs its share ──send──▶ rank 0 joins them
    decode,  rank 0:  KV_RECEIVE (keys, counts), then share r ──send──▶ rank r holds it
                      (`KVPool.received`) until the journal's "received" move writes it

Rank 0 learns every rank's bytes per page of each group once, at start-up
(`handoff_page_bytes`, gathered with the ranks' other start-up reports: `KVLayout`).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from pypto_serving.distributed import (
    KV_EXPORT,
    KV_RECEIVE,
    Control,
    ParallelGroups,
    broadcast_step,
    receive_bytes,
    send_bytes,
)
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.handoff import (
    Counts,
    GroupKV,
    KVLayout,
    counts,
    num_bytes,
    pack,
    packed,
    unpack,
)


def carries(kv: KVGroups, groups: ParallelGroups) -> list[bool]:
    """Whether this rank sends and receives each group's pages in handoffs."""
    later_tp = groups.tp.size > 1 and groups.tp.rank > 0
    return [not (m.pool.cache.spec.same_on_tp_ranks and later_tp) for m in kv.managers]


def handoff_page_bytes(kv: KVGroups, groups: ParallelGroups) -> list[int]:
    """This rank's bytes of one page of each group in a handoff (0 where it carries none)."""
    geometry = kv.geometry()
    return [g.page_bytes if c else 0 for g, c in zip(geometry, carries(kv, groups), strict=True)]


def _mine(shapes: Counts, carried: list[bool]) -> Counts:
    """The counts of what this rank carries (none of a group it does not)."""
    return [(n, t, r, c if keep else 0) for (n, t, r, c), keep in zip(shapes, carried, strict=True)]


# --- the prefill server ----------------------------------------------------------------------


def gather_export(
    groups: list[GroupKV],
    page_ids: list[list[int]],
    layout: KVLayout,
    device: torch.device,
) -> tuple[np.ndarray, list[GroupKV]]:
    """Rank 0: one buffer of every rank's share of the pages `page_ids` (per group; `groups`:
    rank 0's, read from them), and rank 0's groups again as views of it."""
    broadcast_step(Control(KV_EXPORT, json.dumps(page_ids).encode()), device)
    sizes = layout.share_sizes(counts(groups))
    buffer, views = packed(groups, room_after=sum(sizes[1:]))
    at = sizes[0]
    for rank, size in enumerate(sizes[1:], 1):
        receive_bytes(buffer[at : at + size], rank, device)
        at += size
    return buffer, views


def send_export(kv: KVGroups, groups: ParallelGroups, message: bytes, device: torch.device) -> None:
    """Ranks > 0, at rank 0's KV_EXPORT: send it this rank's share of the pages it names."""
    page_ids: list[list[int]] = json.loads(message)
    mine = [
        GroupKV(m.name, 0, 0, [m.pool.cache.read_page(p) for p in ids] if keep else [])
        for m, ids, keep in zip(kv.managers, page_ids, carries(kv, groups), strict=True)
    ]
    buffer = np.empty(num_bytes(counts(mine), kv.geometry()), dtype=np.uint8)
    pack(mine, buffer)
    send_bytes(buffer, 0, device)


# --- the decode server -----------------------------------------------------------------------


def send_received(
    keys: list[str], shapes: Counts, shares: list[np.ndarray], device: torch.device
) -> None:
    """Rank 0: hand every other rank its share of pages another server sent, to be held
    under `keys` (per group) until the journal writes them."""
    message = json.dumps({"keys": keys, "groups": shapes}).encode()
    broadcast_step(Control(KV_RECEIVE, message), device)
    for rank, share in enumerate(shares, 1):
        send_bytes(share, rank, device)


def hold_received(
    kv: KVGroups, groups: ParallelGroups, message: bytes, device: torch.device
) -> None:
    """Ranks > 0, at rank 0's KV_RECEIVE: take this rank's share and hold each group's
    pages in its pool (`KVPool.received`)."""
    msg = json.loads(message)
    shapes: Counts = [(str(n), int(t), int(r), int(c)) for n, t, r, c in msg["groups"]]
    geometry, carried = kv.geometry(), carries(kv, groups)
    mine = _mine(shapes, carried)
    buffer = np.empty(num_bytes(mine, geometry), dtype=np.uint8)
    receive_bytes(buffer, 0, device)
    got = unpack(buffer, mine, geometry)
    for m, key, group, keep in zip(kv.managers, msg["keys"], got, carried, strict=True):
        if keep:  # (the journal's "received" move takes it, or its "drop_received")
            m.pool.received[key] = group.pages
