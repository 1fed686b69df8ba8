"""KV events (issue 28, item 5): the KV store's pages stored into and removed from each tier's
prefix index, published on ZeroMQ in vLLM's format, decoded here with vLLM's own types (as its
kv_events_subscriber example declares them).

Ground truth: the events name exactly the pages the store indexed (their hashes, parents and
tokens), in order: a prompt's full pages stored on the device; evicted, removed from the device
and stored on the CPU tier; hit again, stored on the device and removed from the CPU tier.

Issue 42, item 4: a salted request's pages are told without their tokens, on every tier; a
socket other machines can reach is refused without CURVE keys, and with them admits only the
subscribers whose public keys it was given."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.auth
from live_server import free_port, generate_salted, tiny_llm

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"
PAGE = 16


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@contextmanager
def subscribed(endpoint: str, curve: tuple[bytes, Path] | None = None) -> Iterator[zmq.Socket]:
    """A SUB socket on `endpoint`, every topic, once it has joined (a subscriber sees only
    what is sent after it joined); curve: (the server's public key, a `.key_secret` file of
    the subscriber's key pair)."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    if curve is not None:
        sub.curve_serverkey = curve[0]
        sub.curve_publickey, sub.curve_secretkey = zmq.auth.load_certificate(curve[1])
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)
    try:
        yield sub
    finally:
        sub.close(linger=0)
        context.term()


def receive(sub: zmq.Socket, quiet_s: float = 0.5) -> list[tuple[int, Any]]:
    """(sequence number, event) of every message until none comes for quiet_s."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    out = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out += [(int.from_bytes(seq, "big"), e) for e in decoder.decode(payload).events]
    return out


def hashes(events: list[Any], kind: type, medium: str) -> list[bytes | int]:
    """The page hashes of the events of one kind on one medium, in order."""
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def prompt(i: int, n: int = 40) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 5 for j in range(n)]


def test_pages_stored_and_removed_per_tier_in_vllms_format(tiny_model):
    port = free_port()
    params = SamplingParams(max_tokens=1, temperature=0)
    knobs = dict(page_size=PAGE, num_kv_pages=8, kv_cpu_bytes=1 << 20)
    endpoint = f"tcp://127.0.0.1:{port}"
    with (
        tiny_llm(
            tiny_model(MODEL), kv_events_endpoint=endpoint, kv_events_topic="kv", **knobs
        ) as llm,
        subscribed(endpoint) as sub,
    ):
        a = prompt(0)
        llm.generate([a], params, use_tqdm=False)
        events = receive(sub)
        told = [e for _, e in events]
        stored = [e for e in told if e.medium == "GPU"]
        assert all(isinstance(e, BlockStored) for e in told)
        assert [e.token_ids for e in stored] == [a[:PAGE], a[PAGE : 2 * PAGE]]
        assert all(e.block_size == PAGE for e in stored)
        first, second = stored[0].block_hashes[0], stored[1].block_hashes[0]
        assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == first
        assert {first, second} <= set(llm.engine.executor.kv.pool.device.cached_hashes())
        # a finished: its full pages, freed, were copied to the CPU tier (the device keeps
        # them too until it reuses them)
        assert hashes(told, BlockStored, "CPU") == [second, first]

        for i in range(1, 5):  # other prompts take the device's pages: a's stay on the CPU
            llm.generate([prompt(i)], params, use_tqdm=False)
        moved = [e for _, e in receive(sub)]
        removed = hashes(moved, BlockRemoved, "GPU")
        assert {first, second} <= set(removed)
        assert not {first, second} & set(hashes(moved, BlockRemoved, "CPU"))

        out = llm.generate([a], params, use_tqdm=False)[0]
        assert out.cached_tokens_by_tier.get("cpu") == 2 * PAGE  # a hit on the CPU tier
        back = [e for _, e in receive(sub)]
        gpu, cpu_gone = hashes(back, BlockStored, "GPU"), set(hashes(back, BlockRemoved, "CPU"))
        assert gpu[:2] == [first, second] and {first, second} <= cpu_gone
        seqs = [s for s, _ in events]
        assert seqs == sorted(seqs) and seqs[0] == 0


def test_deepseek_v4_publishes_the_pages_it_keeps_whole(tiny_model):
    """A windowed store (DeepSeek-V4) tells the pages a prefix hit needs in full (its
    compressed entries'), under the same hash chain; the window's rows are not told."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    model = tiny_model("deepseekv4-swa-csa-hca-hash")
    knobs = {"page_size": PAGE, "kv_events_endpoint": endpoint, "kv_events_topic": "kv"}
    with tiny_llm(model, **knobs) as llm, subscribed(endpoint) as sub:
        a = prompt(0)
        llm.generate([a], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        told = [e for _, e in receive(sub)]
        stored = [e for e in told if e.medium == "GPU"]  # (a's, freed: on the CPU tier too)
        assert [e.token_ids for e in stored] == [a[:PAGE], a[PAGE : 2 * PAGE]]
        assert all(isinstance(e, BlockStored) for e in told)
        whole = llm.engine.executor.kv.pool.device.cached_hashes()  # the entries' group
        assert {e.block_hashes[0] for e in stored} == set(whole)


def test_a_busy_endpoint_is_a_clear_error(tiny_model):
    port = free_port()
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(PyptoError, match=r"cannot publish KV events on tcp://127\.0\.0\.1"):
            tiny_llm(tiny_model(MODEL), kv_events_endpoint=f"tcp://127.0.0.1:{port}")
    finally:
        taken.close(linger=0)
        context.term()


def test_each_data_parallel_replica_publishes_on_its_own_port(tiny_model):
    port = free_port()
    while True:  # the replica of rank 1 takes port + 1
        try:
            probe = zmq.Context().socket(zmq.PUB)
            probe.bind(f"tcp://127.0.0.1:{port + 1}")
            probe.close(linger=0)
            break
        except zmq.ZMQError:
            port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    knobs = dict(page_size=PAGE, data_parallel_size=2, kv_events_endpoint=endpoint)
    with tiny_llm(tiny_model(MODEL), **knobs) as llm:
        context = zmq.Context()
        subs = []
        for p in (port, port + 1):
            sub = context.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{p}")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            subs.append(sub)
        time.sleep(0.5)
        params = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([prompt(i) for i in range(4)], params, use_tqdm=False)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ranks = []
        for sub in subs:
            assert sub.poll(5000), "a replica published nothing"
            ranks.append(decoder.decode(sub.recv_multipart()[2]).data_parallel_rank)
            sub.close(linger=0)
        context.term()
    assert ranks == [0, 1]


def test_a_subscriber_gets_missed_batches_from_the_replay_socket(tiny_model):
    """vLLM's replay protocol: send the first sequence number wanted to the ROUTER socket,
    get every buffered batch from there as [seq, payload], then [-1, b""]."""
    port, replay_port = free_port(), free_port()
    params = SamplingParams(max_tokens=1, temperature=0)
    knobs = dict(page_size=PAGE, num_kv_pages=8, kv_cpu_bytes=1 << 20)
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    with tiny_llm(
        tiny_model(MODEL),
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay,
        kv_events_topic="kv",
        **knobs,
    ) as llm:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)
        for i in range(3):
            llm.generate([prompt(i)], params, use_tqdm=False)
        live = {}
        while sub.poll(500):
            _, seq, payload = sub.recv_multipart()
            live[int.from_bytes(seq, "big")] = payload
        assert len(live) >= 3
        first = min(live) + 1  # as if the first batch had been seen and the rest missed
        req = context.socket(zmq.REQ)  # as vLLM's example subscriber asks (it reads the first)
        req.connect(replay)
        req.send(first.to_bytes(8, "big"))
        assert req.poll(5000), "no replay answer"
        assert req.recv_multipart() == [first.to_bytes(8, "big"), live[first]]
        req.close(linger=0)
        replayed = {}  # a DEALER reads the whole stream
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed[int.from_bytes(seq, "big")] = payload
        assert replayed == {s: p for s, p in live.items() if s >= first}
        for s in (sub, dealer):
            s.close(linger=0)
        context.term()


def test_replay_needs_the_events_endpoint(tiny_model):
    with pytest.raises(PyptoError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        tiny_llm(tiny_model(MODEL), kv_events_replay_endpoint="tcp://127.0.0.1:1")


def test_a_salted_requests_pages_are_told_without_their_tokens_on_every_tier(tiny_model):
    """A salt keeps a prompt from other tenants: its pages' events carry no token ids (vLLM's
    schema allows an empty list), stored on the device, pushed to the CPU tier, loaded back;
    an unsalted prompt's pages keep theirs wherever they go."""
    port = free_port()
    params = SamplingParams(max_tokens=1, temperature=0)
    knobs = dict(page_size=PAGE, num_kv_pages=8, kv_cpu_bytes=1 << 20, kv_events_topic="kv")
    endpoint = f"tcp://127.0.0.1:{port}"
    with (
        tiny_llm(tiny_model(MODEL), kv_events_endpoint=endpoint, **knobs) as llm,
        subscribed(endpoint) as sub,
    ):
        a, b = prompt(0), prompt(1)
        generate_salted(llm, a, params, "tenant-a")
        llm.generate([b], params, use_tqdm=False)
        told = [e for _, e in receive(sub)]
        first = [e for e in told if e.medium == "GPU"]
        assert [e.token_ids for e in first] == [[], [], b[:PAGE], b[PAGE : 2 * PAGE]]
        secret = {h for e in first[:2] for h in e.block_hashes}
        for i in range(2, 6):  # a's and b's pages move to the CPU tier
            llm.generate([prompt(i)], params, use_tqdm=False)
        told += [e for _, e in receive(sub)]
        moved = [e for e in told if isinstance(e, BlockStored) and e.medium == "CPU"]
        on_cpu = {e.block_hashes[0]: e.token_ids for e in moved}
        assert secret <= set(on_cpu) and all(on_cpu[h] == [] for h in secret)
        assert on_cpu[first[2].block_hashes[0]] == b[:PAGE]
        out = generate_salted(llm, a, params, "tenant-a")
        assert out.cached_tokens_by_tier.get("cpu") == 2 * PAGE  # a hit on the CPU tier
        back = [e for _, e in receive(sub) if isinstance(e, BlockStored)]
        assert {e.block_hashes[0] for e in back} >= secret
        assert all(e.token_ids == [] for e in back if e.block_hashes[0] in secret)


@pytest.mark.parametrize(
    "knobs",
    [
        {"kv_events_endpoint": "tcp://*:{port}"},
        {"kv_events_endpoint": "tcp://0.0.0.0:{port}"},
        {"kv_events_endpoint": "tcp://127.0.0.1:{port}", "kv_events_replay_endpoint": "tcp://*:1"},
    ],
)
def test_a_socket_other_machines_can_reach_needs_curve_keys(tiny_model, knobs):
    port = free_port()
    knobs = {k: v.format(port=port) for k, v in knobs.items()}
    with pytest.raises(PyptoError, match=r"can be reached from other machines.*CURVE"):
        tiny_llm(tiny_model(MODEL), **knobs)


def certificates(folder: Path) -> dict[str, tuple[bytes, Path]]:
    """Key pairs of the server, an admitted subscriber and a stranger: name -> (public key,
    `.key_secret` file); the admitted subscriber's public key alone in `folder/clients`."""
    out = {}
    for name in ("server", "client", "stranger"):
        public_file, secret_file = zmq.auth.create_certificates(folder, name)
        out[name] = (zmq.auth.load_certificate(public_file)[0], Path(secret_file))
    (folder / "clients").mkdir()
    (folder / "client.key").rename(folder / "clients" / "client.key")
    return out


def test_with_curve_keys_only_admitted_subscribers_receive_events(tiny_model, tmp_path):
    certs = certificates(tmp_path)
    port, replay_port = free_port(), free_port()
    curve = {
        "kv_events_curve_key": str(certs["server"][1]),
        "kv_events_curve_clients": str(tmp_path / "clients"),
    }
    bind = {
        "kv_events_endpoint": f"tcp://0.0.0.0:{port}",
        "kv_events_replay_endpoint": f"tcp://0.0.0.0:{replay_port}",
    }
    endpoint, server_key = f"tcp://127.0.0.1:{port}", certs["server"][0]
    with (
        tiny_llm(tiny_model(MODEL), page_size=PAGE, kv_events_topic="kv", **bind, **curve) as llm,
        subscribed(endpoint, (server_key, certs["client"][1])) as admitted,
        subscribed(endpoint) as plain,
        subscribed(endpoint, (server_key, certs["stranger"][1])) as stranger,
    ):
        a = prompt(0)
        llm.generate([a], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        got = [e for _, e in receive(admitted) if e.medium == "GPU"]
        assert [e.token_ids for e in got] == [a[:PAGE], a[PAGE : 2 * PAGE]]
        assert receive(plain, 0.2) == [] and receive(stranger, 0.2) == []
        context = zmq.Context()
        for keys in ((server_key, certs["client"][1]), None):
            dealer = context.socket(zmq.DEALER)
            if keys is not None:
                dealer.curve_serverkey = keys[0]
                dealer.curve_publickey, dealer.curve_secretkey = zmq.auth.load_certificate(keys[1])
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert bool(dealer.poll(2000)) == (keys is not None)  # the stranger gets no replay
            dealer.close(linger=0)
        context.term()


def test_bad_curve_settings_are_clear_errors(tiny_model, tmp_path):
    certs = certificates(tmp_path)
    model, endpoint = tiny_model(MODEL), f"tcp://0.0.0.0:{free_port()}"
    with pytest.raises(PyptoError, match="kv_events_curve_key and kv_events_curve_clients go"):
        tiny_llm(model, kv_events_endpoint=endpoint, kv_events_curve_key=str(certs["server"][1]))
    public_only = str(tmp_path / "server.key")
    clients = str(tmp_path / "clients")
    with pytest.raises(PyptoError, match=r"server\.key holds no secret key"):
        tiny_llm(
            model,
            kv_events_endpoint=endpoint,
            kv_events_curve_key=public_only,
            kv_events_curve_clients=clients,
        )
    (tmp_path / "none").mkdir()
    with pytest.raises(PyptoError, match="holds no public key"):
        tiny_llm(
            model,
            kv_events_endpoint=endpoint,
            kv_events_curve_key=str(certs["server"][1]),
            kv_events_curve_clients=str(tmp_path / "none"),
        )
