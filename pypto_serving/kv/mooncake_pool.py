"""Joining a Mooncake Store: the shared pool behind the remote KV tier (`kv/remote_tier.py`).

A Mooncake Store is a master (`mooncake_master`, which keeps the index of objects and evicts)
and its clients: every client lends a segment of its memory to the pool, and an object put by
one client may live in any client's segment; others read it over the transfer engine (TCP
here, RDMA where the hardware has it). Every `pypto serve` (and every data-parallel replica)
given the same master joins the same pool, so a page computed by one is found by all.

Start a master with `mooncake_master --rpc_port 50051` (the `mooncake-transfer-engine-non-cuda`
package ships it); point servers at it with `--kv-remote mooncake://HOST:50051`. Clients meet
each other peer to peer (Mooncake's P2PHANDSHAKE metadata), so nothing else needs running.

Mooncake authenticates no one: any process that reaches the master can join and write. So
every member signs the pages it writes, and checks the pages it reads, with a key derived from
the pool's secret (`PYPTO_POOL_SECRET`, the same on every member, as `PYPTO_NODE_SECRET` is
for nodes); a process without it is refused before it joins (`pool_key`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Protocol

from pypto_serving.config import remote_address
from pypto_serving.errors import PyptoError

log = logging.getLogger(__name__)

SECRET_ENV = "PYPTO_POOL_SECRET"
MIN_SECRET_CHARS = 16
CONNECT_TIMEOUT_S = 5.0
LOCAL_BUFFER_BYTES = 64 << 20
"""The client's staging buffer for transfers (a page at a time goes through it)."""


class Pool(Protocol):
    """What the remote tier needs of a Mooncake Store client (`MooncakeDistributedStore`)."""

    def put(self, key: str, value: bytes) -> int: ...

    def upsert(self, key: str, value: bytes) -> int: ...

    def get(self, key: str) -> bytes: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def remove(self, key: str) -> int: ...

    def close(self) -> int: ...


def pool_key() -> bytes:
    """The key this member signs and checks pool pages with (32 bytes, derived from
    PYPTO_POOL_SECRET); PyptoError if the secret is unset or short."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET_CHARS:
        raise PyptoError(
            f"kv_remote: the members of a shared KV pool sign its pages with a shared secret: "
            f"set {SECRET_ENV} to the same secret of at least {MIN_SECRET_CHARS} characters on "
            f"every member (e.g. `export {SECRET_ENV}=$(openssl rand -hex 16)`)",
            "kv_remote",
        )
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"pypto-kv-pool").digest()


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to the master: where other clients reach our
    segment. (A UDP socket's connect sends nothing; it only picks the route.)"""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError as e:
        raise PyptoError(f"no route to the Mooncake master {host}:{port} ({e})") from None


@dataclass(slots=True)
class _Membership:
    client: Pool
    users: int = 0


_joined: dict[str, _Membership] = {}
"""Master URL -> this process's client of it, and how many joined it and have not left."""
_joined_lock = threading.Lock()


def join(url: str, segment_bytes: int) -> Pool:
    """This process's client of the Mooncake Store whose master is at `url`: one per process
    and master, made on first use and shared by every KV store of the process; each `join`
    is paired with a `leave`. PyptoError without the pool's secret (`pool_key`)."""
    pool_key()
    with _joined_lock:
        if url not in _joined:
            _joined[url] = _Membership(connect(url, segment_bytes))
        membership = _joined[url]
        membership.users += 1
        return membership.client


def leave(client: Pool) -> None:
    """One user of the client is done; the last one closes it (its segment, and the pages
    the pool kept there, leave the pool)."""
    with _joined_lock:
        url = next((u for u, m in _joined.items() if m.client is client), None)
        if url is None:
            return
        _joined[url].users -= 1
        if _joined[url].users > 0:
            return
        del _joined[url]
    client.close()


def connect(url: str, segment_bytes: int, what: str = "kv_remote") -> Pool:
    """A client of the Mooncake Store whose master is at `url`, lending `segment_bytes` of
    this process's memory to the pool. PyptoError saying what to install or check when it
    cannot (naming the option `what`)."""
    host, port = remote_address(url, what)
    try:
        ipaddress.ip_address(host)
        address = host
    except ValueError:
        try:
            address = socket.gethostbyname(host)
        except OSError as e:
            raise PyptoError(f"{what}: cannot resolve {host!r} ({e})") from None
    try:  # Mooncake's own set-up retries an absent master for ~90 s: fail fast instead
        socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise PyptoError(
            f"{what}: the Mooncake master at {address}:{port} does not answer ({e}); start "
            f"one with `mooncake_master --rpc_port {port}`",
            what,
        ) from None
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # it logs every connection at INFO
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as e:
        hint = (
            "install Debian's libibverbs1 (apt-get install libibverbs1): Mooncake links it "
            "even for TCP"
            if "libibverbs" in str(e)
            else "pip install 'pypto-serving[remote]' (the mooncake-transfer-engine-non-cuda "
            "package)"
        )
        raise PyptoError(
            f"{what} needs Mooncake Store, which cannot be imported ({e}): {hint}"
        ) from None
    client = MooncakeDistributedStore()
    me = local_address(address, port)
    master = f"{address}:{port}"
    code = client.setup(me, "P2PHANDSHAKE", segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master)
    if code != 0:
        raise PyptoError(
            f"{what}: cannot join the Mooncake master at {address}:{port} (error {code}); "
            f"is `mooncake_master --rpc_port {port}` running there?",
            what,
        )
    log.info(
        "joined the Mooncake Store at %s as %s, lending it %d MiB", master, me, segment_bytes >> 20
    )
    return client
