"""A prompt's KV handed from a prefill server to a decode server (disaggregated serving).

The prefill server computes a prompt and samples its first token; what the decode server
needs to go on as if it had done so itself is the `Handoff`: every KV group's pages of the
prompt (`GroupKV`, in the group's own page layout; a window's pages it had already given back
are not sent), the first token with its logprobs, and the sampler's random state after it.

On the wire the pages are one flat byte buffer (`pack`): group by group, page by page, each
stored tensor's bytes in turn. The receiver cuts it by its own groups' page geometry
(`unpack`), which must be the sender's: both compare the layout digest of their KV (the
model's weights, quantization, KV dtype and layout, page size) before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pypto_serving.kv.tier import PageKV, numpy_bits
from pypto_serving.ops.sampler import Sampled


@dataclass(slots=True)
class GroupKV:
    """One KV group's pages of a request's first `num_tokens` tokens: the `released` leading
    pages a window gave back are left out (the receiver holds -1 there, as the sender did)."""

    name: str
    num_tokens: int
    released: int
    pages: list[PageKV]


@dataclass(slots=True)
class Handoff:
    """What a decode server needs to continue a request a prefill server began."""

    groups: list[GroupKV]
    first: Sampled
    """The first output token, sampled by the prefill server (with its logprobs, if asked)."""
    generator_state: bytes | None = None
    """The request's seeded generator after that token (None: unseeded)."""
    buffer: np.ndarray | None = None
    """The groups' pages as one buffer (`packed`; the pages are views of it), ready to be
    sent as it is; under TP/PP every rank's share, rank 0's first
    (`executor/kv_shares.py`)."""
    shares: list[np.ndarray] = field(default_factory=list)
    """Received under TP/PP: the other ranks' shares, each rank's packed bytes in rank order
    (`groups` are rank 0's)."""


@dataclass(slots=True, frozen=True)
class PageGeometry:
    """How one group's page reads: its stored tensors' page shapes and dtype."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(int(np.prod(s)) for s in self.shapes) * item


Counts = list[tuple[str, int, int, int]]
"""Per group: (name, num_tokens, released, pages sent), how a packed buffer is cut."""


def counts(groups: list[GroupKV]) -> Counts:
    """What the receiver needs, beside its own geometry, to cut the groups' packed bytes."""
    return [(g.name, g.num_tokens, g.released, len(g.pages)) for g in groups]


def num_bytes(shapes: Counts, geometry: list[PageGeometry]) -> int:
    """The packed size of groups of these counts (by the receiver's geometry)."""
    return _pages_bytes(shapes, [geo.page_bytes for geo in geometry])


def _pages_bytes(shapes: Counts, page_bytes: list[int]) -> int:
    """The bytes of groups of these counts whose pages are `page_bytes` each (by group)."""
    return sum(c * b for (_, _, _, c), b in zip(shapes, page_bytes, strict=True))


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What a handoff between two servers must agree on, and how it is cut."""

    digest: str
    """Identifies the model, its configuration, the KV's page layouts and the TP and PP
    sizes (`EngineCore.kv_layout`): a handoff moves only between servers of one digest."""
    geometry: list[PageGeometry]
    """How each group's page reads on rank 0."""
    page_bytes: list[list[int]]
    """Every rank's bytes of one page of each group in a handoff (rank 0's first; 0 where a
    rank carries none of a group's pages)."""

    def share_sizes(self, shapes: Counts) -> list[int]:
        """Each rank's bytes of a handoff of these counts."""
        return [_pages_bytes(shapes, row) for row in self.page_bytes]

    def cut(self, buffer: np.ndarray, shapes: Counts) -> tuple[list[GroupKV], list[np.ndarray]]:
        """A handoff's buffer of these counts, as rank 0's groups (views of it) and the other
        ranks' shares (slices of it). ValueError where it is not their size."""
        sizes = self.share_sizes(shapes)
        if buffer.size != sum(sizes):
            raise ValueError(f"the KV sent is {buffer.size} bytes, its pages {sum(sizes)}")
        ends = np.cumsum(sizes).tolist()
        shares = [buffer[end - n : end] for n, end in zip(sizes[1:], ends[1:], strict=True)]
        return unpack(buffer[: sizes[0]], shapes, self.geometry), shares


def pack(groups: list[GroupKV], out: np.ndarray) -> None:
    """Write the groups' pages into `out` (uint8, exactly their size), as `unpack` reads."""
    at = 0
    for group in groups:
        for page in group.pages:
            for t in page:
                flat = numpy_bits(t.contiguous().cpu()).reshape(-1).view(np.uint8)
                out[at : at + flat.size] = flat
                at += flat.size
    assert at == out.size, f"packed {at} bytes into a buffer of {out.size}"


def packed(groups: list[GroupKV], room_after: int = 0) -> tuple[np.ndarray, list[GroupKV]]:
    """The groups' pages copied into one buffer (as `pack` lays them out; `room_after`
    bytes left after them, for the other ranks' shares), and the groups again with their
    pages as views of it: one copy, where the pages go on being read."""
    size = sum(t.numel() * t.element_size() for g in groups for p in g.pages for t in p)
    buffer = np.empty(size + room_after, dtype=np.uint8)
    pack(groups, buffer[:size])
    geometry = [  # a group that sends no page is cut by nothing
        PageGeometry(g.name, tuple(tuple(t.shape) for t in g.pages[0]), g.pages[0][0].dtype)
        if g.pages
        else PageGeometry(g.name, (), torch.uint8)
        for g in groups
    ]
    return buffer, unpack(buffer[:size], counts(groups), geometry)


def unpack(buffer: np.ndarray, shapes: Counts, geometry: list[PageGeometry]) -> list[GroupKV]:
    """The groups a sender packed into `buffer`; shapes: per group (name, num_tokens,
    released, pages sent), in the receiver's group order. The pages are views of `buffer`."""
    data = torch.from_numpy(buffer)
    groups, at = [], 0
    for (name, num_tokens, released, count), geo in zip(shapes, geometry, strict=True):
        if name != geo.name:
            raise ValueError(f"KV group {name!r} where this server has {geo.name!r}")
        pages = []
        for _ in range(count):
            page = []
            for shape in geo.shapes:
                size = int(np.prod(shape)) * torch.empty((), dtype=geo.dtype).element_size()
                page.append(data[at : at + size].view(geo.dtype).view(shape))
                at += size
            pages.append(tuple(page))
        groups.append(GroupKV(name, num_tokens, released, pages))
    if at != buffer.size:
        raise ValueError(f"the KV sent is {buffer.size} bytes, its groups' pages {at}")
    return groups
