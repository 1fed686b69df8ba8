"""The router's prefix estimate (server/prefix_estimate.py) read from a server's KV events:
blocks of any size, stored one event each or several in one, give exactly the router pages
`page_chain` gives the same tokens; a block removed from every tier takes its pages with it;
a block told without tokens (salted), or whose parent the router never saw, counts for
nothing."""

from __future__ import annotations

import hashlib
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pypto_serving.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pypto_serving.server.prefix_estimate import ROUTER_PAGE, PrefixEstimate, page_chain


def server_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Any content hash: the server's own (the router never computes it)."""
    return hashlib.sha256(repr((parent, tokens)).encode()).digest()


def blocks_of(tokens: list[int], size: int) -> list[tuple[bytes, bytes | None, list[int]]]:
    """The server's full blocks of `tokens`: (hash, parent hash, tokens)."""
    out, parent = [], None
    for start in range(0, len(tokens) - size + 1, size):
        block = tokens[start : start + size]
        h = server_hash(parent, block)
        out.append((h, parent, block))
        parent = h
    return out


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=200),
    size=st.integers(1, 40),
    together=st.integers(1, 4),
)
def test_stored_blocks_give_the_pages_of_their_tokens(tokens, size, together) -> None:
    estimate = PrefixEstimate()
    blocks = blocks_of(tokens, size)
    for i in range(0, len(blocks), together):  # `together` blocks an event
        group = blocks[i : i + together]
        hashes = [h for h, _, _ in group]
        ids = [t for _, _, b in group for t in b]
        estimate.apply(BlockStored(hashes, group[0][1], ids, size, None, "GPU"))
    stored = tokens[: len(blocks) * size]
    want = page_chain(stored, None)
    assert list(estimate.pages) == want
    assert estimate.held(page_chain(tokens, None)) == len(want)
    # every block removed from its only tier: nothing is held
    estimate.apply(BlockRemoved([h for h, _, _ in blocks], "GPU"))
    assert len(estimate) == 0


def test_a_block_stays_while_any_tier_holds_it() -> None:
    estimate = PrefixEstimate()
    tokens = list(range(100, 164))  # 4 router pages in 2 blocks of 32
    (a, _, ta), (b, _, tb) = blocks_of(tokens, 32)
    estimate.apply(BlockStored([a], None, ta, 32, None, "GPU"))
    estimate.apply(BlockStored([b], a, tb, 32, None, "GPU"))
    chain = page_chain(tokens, None)
    assert estimate.held(chain) == 4
    estimate.apply(BlockStored([b], a, tb, 32, None, "CPU"))  # offloaded
    estimate.apply(BlockRemoved([b], "GPU"))
    assert estimate.held(chain) == 4
    estimate.apply(BlockRemoved([b], "CPU"))
    assert estimate.held(chain) == 2  # the second block's two pages are gone
    estimate.apply(BlockStored([b], a, tb, 32, None, "GPU"))  # computed again
    assert estimate.held(chain) == 4
    estimate.apply(AllBlocksCleared())
    assert len(estimate) == 0


def test_pages_straddling_blocks_are_completed_by_the_later_one() -> None:
    estimate = PrefixEstimate()
    tokens = list(range(7, 7 + 3 * 24))  # blocks of 24: router pages end at 16, 32, 48, 64
    (a, _, ta), (b, _, tb), (c, _, tc) = blocks_of(tokens, 24)
    estimate.apply(BlockStored([a], None, ta, 24, None, "GPU"))
    estimate.apply(BlockStored([b], a, tb, 24, None, "GPU"))
    chain = page_chain(tokens, None)
    assert estimate.held(chain) == 3  # 48 tokens: pages of 16, 32 and 48
    estimate.apply(BlockStored([c], b, tc, 24, None, "GPU"))
    assert estimate.held(chain) == 4  # the page ending at 64 (72 tokens: 4 full pages)
    estimate.apply(BlockRemoved([b], "GPU"))
    assert estimate.held(chain) == 1  # the page of 16-32 was completed in b


def test_salted_or_orphaned_blocks_count_for_nothing() -> None:
    estimate = PrefixEstimate()
    tokens = list(range(300, 332))
    (a, _, ta), (b, _, tb) = blocks_of(tokens, 16)
    estimate.apply(BlockStored([a], None, [], 16, None, "GPU"))  # told without tokens
    estimate.apply(BlockStored([b], a, tb, 16, None, "GPU"))  # its parent unknown
    estimate.apply(BlockStored([server_hash(None, [1])], b"?", ta, 16, None, "GPU"))
    assert len(estimate) == 0
    assert ROUTER_PAGE == 16


def test_what_the_router_sent_ages_out_oldest_first() -> None:
    estimate = PrefixEstimate(capacity=4)
    first, second = page_chain(list(range(48)), None), page_chain(list(range(100, 148)), None)
    estimate.sent(first)
    estimate.sent(second)
    assert estimate.held(second) == 3 and estimate.held(first) == 0  # its first pages aged out
    assert page_chain(list(range(48)), "tenant") != first  # a salt starts another chain


def test_the_router_follows_a_curve_publisher_only_with_an_admitted_key(tmp_path) -> None:
    """`follow` as a CURVE client: with an admitted key pair it applies the events, and a
    restarted publisher (sequence numbers from 0 again) resets the estimate; with a key the
    server does not admit it receives nothing."""
    import asyncio
    import shutil

    import zmq.auth
    from live_server import free_port
    from patience import patience

    from pypto_serving.engine.kv_events import Curve, KVEventPublisher
    from pypto_serving.kv.events import PageStored
    from pypto_serving.server.prefix_estimate import follow

    for name in ("server", "router", "stranger"):
        zmq.auth.create_certificates(tmp_path, name)
    (tmp_path / "clients").mkdir()
    shutil.copy(tmp_path / "router.key", tmp_path / "clients")
    server_public, _ = zmq.auth.load_certificate(tmp_path / "server.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    curve = Curve(str(tmp_path / "server.key_secret"), str(tmp_path / "clients"))
    tokens = list(range(40, 72))
    (a, _, ta), (b, _, tb) = blocks_of(tokens, 16)
    pages = [PageStored("device", a, None, tuple(ta)), PageStored("device", b, a, tuple(tb))]

    other = [9] * 16
    fresh = [PageStored("device", server_hash(None, other), None, tuple(other))]

    async def listen(key: str, rounds: list[list[PageStored]]) -> PrefixEstimate:
        """A publisher per round (the same server, restarted), each telling those pages."""
        public, secret = zmq.auth.load_certificate(tmp_path / f"{key}.key_secret")
        assert secret is not None
        estimate = PrefixEstimate()
        task = asyncio.create_task(follow(endpoint, estimate, (server_public, public, secret)))
        for told in rounds:
            publisher = KVEventPublisher(endpoint, "", 16, None, curve=curve)
            try:
                first = page_chain(list(told[0].token_ids), None)
                deadline = time.monotonic() + patience(5 if key == "stranger" else 30)
                while not estimate.held(first) and time.monotonic() < deadline:
                    publisher.publish(told[:1])  # until the subscription is up (or never)
                    await asyncio.sleep(0.05)
                publisher.publish(told[1:])
                whole = page_chain([t for p in told for t in p.token_ids], None)
                while estimate.held(whole) < len(whole) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)  # (the stranger's never comes: 5 s)
            finally:
                publisher.close()
            if key == "router" and told is pages:
                assert estimate.held(page_chain(tokens, None)) == 2
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return estimate

    admitted = asyncio.run(listen("router", [pages, fresh]))
    assert admitted.held(page_chain(other, None)) == 1
    assert admitted.held(page_chain(tokens, None)) == 0  # the restarted server holds none
    stranger = asyncio.run(listen("stranger", [pages]))
    assert len(stranger) == 0
