"""Data-parallel replicas on other machines: the channel between node 0's front and them.

With `nnodes > 1` and `data_parallel_size > 1` every node hosts data_parallel_size / nnodes
replicas (each with all of its tensor/pipeline ranks). Node 0 serves HTTP and routes every
request (engine/dp.py); node r (`pypto serve --node-rank r [--headless]`) starts its replicas
as child processes, as node 0 does, and connects one channel per replica to node 0 at
`master_addr:master_port`. Over it the node relays the replica's messages both ways
(engine/replica.py's: Ready, StepResult, NewRequest, ...), so to node 0 a remote replica is a
replica like its own: the router counts its load and the KV events of its pages.

    node 0 (DPEngine) ◀─TCP: authenticated, one per replica─▶ node r (relay) ◀─pipe─▶ replica

The messages are pickles, so a channel is only opened to a peer that proves it knows the
nodes' shared secret (multiprocessing's HMAC challenge, both ways; `PYPTO_NODE_SECRET`, the
same on every node). A peer that fails the challenge or says nothing within HANDSHAKE_S is
dropped and logged. Its first message says what the node serves (`model_fingerprint`): a
node serving another model or token-changing options is refused, and node 0's start-up fails.

Times in the messages are each machine's monotonic clock. At connection the node measures
the offset between its clock and node 0's (half a round trip's accuracy) and the relay moves
a request's arrival time and a step's scheduled time across it.

Lifetimes: node 0 stops a replica by sending it None (the relay passes it on and closes the
channel once the replica has exited); node 0 losing a replica closes its channel, and the
relay kills the replica. A replica that exits closes its channel: node 0 loses it. A node
whose channels have all closed exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path

from pypto_serving.config import EngineConfig
from pypto_serving.engine.process import STOP_TIMEOUT_S, StartupDeadline
from pypto_serving.engine.replica import NewRequest, Ready, Replica, StepResult
from pypto_serving.errors import PyptoError

log = logging.getLogger(__name__)

SECRET_ENV = "PYPTO_NODE_SECRET"
MIN_SECRET_CHARS = 16
HANDSHAKE_S = 5.0
"""Longest a peer may take to answer the challenge and say who it is."""
RETRY_S = 0.5
"""How often a node retries reaching node 0 while it is not up yet."""
KEEPALIVE_S = 10
"""TCP keepalive: a channel whose peer vanished without closing it (a machine that lost
power, a cut network) fails after about KEEPALIVE_S + 3 x KEEPALIVE_S / 2."""


@dataclass(slots=True)
class Hello:
    """A node's first message on a channel: which replica it carries, and what it serves."""

    node_rank: int
    index: int
    pid: int
    serves: str
    """`model_fingerprint` of the node's model and engine options."""


@dataclass(slots=True)
class Clock:
    """Node 0's answer to Hello: its monotonic clock now."""

    now: float


@dataclass(slots=True)
class Refused:
    """Node 0's answer to a Hello it cannot take, and why."""

    why: str


MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")


def model_fingerprint(config: EngineConfig, model_dir: Path) -> str:
    """What the replicas of one engine must share, whatever node they run on: the model's
    architecture and tokenizer files, its weight files' names and sizes (their contents are
    not read: a checkpoint can be large), and the engine options that change a token (dtype,
    quantization, KV cache dtype, page size, max_model_len). A short digest, and a summary."""
    digest = hashlib.sha256()
    for name in MODEL_FILES:
        path = model_dir / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    for path in sorted(model_dir.rglob("*")):
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            digest.update(f"{path.relative_to(model_dir)}:{path.stat().st_size}".encode())
    options = (
        f"dtype {config.dtype}, quantization {config.quantization}, kv_cache_dtype "
        f"{config.cache.kv_cache_dtype}, page_size {config.cache.page_size}, max_model_len "
        f"{config.max_model_len}"
    )
    digest.update(options.encode())
    return f"{model_dir.name} ({options}; files {digest.hexdigest()[:12]})"


def node_secret() -> bytes:
    """The nodes' shared secret, from PYPTO_NODE_SECRET; PyptoError if it is unset or short."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET_CHARS:
        raise PyptoError(
            f"data-parallel replicas on several nodes talk over an authenticated channel: set "
            f"{SECRET_ENV} to the same secret of at least {MIN_SECRET_CHARS} characters on "
            f"every node (e.g. `export {SECRET_ENV}=$(openssl rand -hex 16)`)"
        )
    return secret.encode()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S // 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking read of the socket (0: no bound). The socket stays blocking, as
    multiprocessing's Connection needs."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


class RemoteReplica:
    """Node 0's handle on a replica another node hosts: what engine/dp.py uses of a local
    `Replica`, over the channel."""

    def __init__(self, index: int, node_rank: int, pid: int, sock: socket.socket) -> None:
        self.index, self.node_rank, self.pid = index, node_rank, pid
        self._peek = sock.dup()  # looks for the channel's end without reading a message
        self.conn = Connection(sock.detach())
        self.info: Ready | None = None
        self._closed = False

    @property
    def where(self) -> str:
        return f"node {self.node_rank} pid {self.pid}"

    def why_gone(self) -> str:
        return f"its channel to node {self.node_rank} closed"

    def send(self, message: object) -> None:
        self.conn.send(message)

    def poll(self) -> int | None:
        """1 once the channel has closed (the node or the replica went away), else None;
        reads nothing. The peer's end shows even behind messages nobody has read yet (a
        last heartbeat while the engine idles): POLLRDHUP, not a peek at the next byte."""
        if self._closed:
            return 1
        watch = select.poll()
        watch.register(self._peek, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return 1 if watch.poll(0) else None

    def request_stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the replica to finish and wait until its node closes the channel."""
        self.request_stop()
        deadline = time.monotonic() + timeout
        with contextlib.suppress(OSError, EOFError):
            while self.conn.poll(max(deadline - time.monotonic(), 0)):
                self.conn.recv()  # its last results: nobody waits for them now
        self.kill()

    def kill(self, grace: float = 0.0) -> None:
        """Close the channel: the node kills the replica."""
        if not self._closed:
            self._closed = True
            self.conn.close()
            self._peek.close()


class NodeListener:
    """Node 0's end: listens at master_addr:master_port for the other nodes' replicas."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        p = config.parallel
        self.address, self.port = p.master_addr, p.master_port or 0
        self.config = config
        self.serves = model_fingerprint(config, model_dir)
        self._secret = node_secret()
        self._sock = socket.create_server((self.address, self.port))
        self._mismatch: queue.Queue[str] = queue.Queue()
        """Nodes that serve another model (a configuration error: start-up fails at once)."""

    def close(self) -> None:
        self._sock.close()

    def accept(self, expected: list[int], deadline: StartupDeadline) -> list[RemoteReplica]:
        """The channels of the `expected` replicas, in that order; PyptoError naming the nodes
        whose replicas did not connect by the deadline. Each peer's handshake runs in a
        thread of its own: a silent one delays no other."""
        per_node = self.config.parallel.data_parallel_size // self.config.parallel.nnodes
        welcomed: queue.Queue[RemoteReplica] = queue.Queue()
        got: dict[int, RemoteReplica] = {}
        try:
            while len(got) < len(expected):
                with contextlib.suppress(queue.Empty):
                    raise PyptoError(self._mismatch.get_nowait())
                with contextlib.suppress(queue.Empty):
                    while True:
                        r = welcomed.get_nowait()
                        if r.index in got:  # a second channel for one replica
                            log.warning("refused a second channel for replica %d", r.index)
                            r.kill()
                        else:
                            got[r.index] = r
                if len(got) == len(expected):
                    break
                if deadline.left() <= 0:
                    missing = [i for i in expected if i not in got]
                    nodes = sorted({i // per_node for i in missing})
                    raise PyptoError(
                        f"node(s) {', '.join(map(str, nodes))} never arrived: data-parallel "
                        f"replica(s) {', '.join(map(str, missing))} did not connect to "
                        f"{self.address}:{self.port} within {deadline.limit_s:g} s "
                        "(startup_timeout_s); start `pypto serve --node-rank N` with the same "
                        "options and the same PYPTO_NODE_SECRET on each of them"
                    )
                readable, _, _ = select.select([self._sock], [], [], min(deadline.left(), 0.1))
                if readable:
                    sock, peer = self._sock.accept()
                    threading.Thread(
                        target=self._welcome,
                        args=(sock, f"{peer[0]}:{peer[1]}", expected, welcomed),
                        name="pypto-node-handshake",
                        daemon=True,
                    ).start()
        except BaseException:
            for r in got.values():
                r.kill()
            raise
        return [got[i] for i in expected]

    def _welcome(
        self,
        sock: socket.socket,
        peer: str,
        expected: list[int],
        welcomed: queue.Queue[RemoteReplica],
    ) -> None:
        _tune(sock)
        _receive_timeout(sock, HANDSHAKE_S)
        conn = Connection(os.dup(sock.fileno()))
        try:
            deliver_challenge(conn, self._secret)
            answer_challenge(conn, self._secret)
            hello = conn.recv()
            if not isinstance(hello, Hello) or hello.index not in expected:
                raise PyptoError(f"an unexpected first message {hello!r}")
            if hello.serves != self.serves:
                mismatch = (
                    f"node {hello.node_rank} serves {hello.serves}, node 0 serves {self.serves}: "
                    "start every node with the same model and options"
                )
                conn.send(Refused(mismatch))
                self._mismatch.put(mismatch)
                raise PyptoError(mismatch)
            conn.send(Clock(time.monotonic()))
        except (AuthenticationError, PyptoError, OSError, EOFError) as e:
            why = "it does not know PYPTO_NODE_SECRET" if isinstance(e, AuthenticationError) else e
            log.warning("refused a connection from %s: %s", peer, why)
            conn.close()
            sock.close()
            return
        conn.close()  # the handshake's own duplicate; the replica's channel takes the socket
        _receive_timeout(sock, 0)
        log.info(
            "data-parallel replica %d of node %d (pid %d) connected from %s",
            hello.index,
            hello.node_rank,
            hello.pid,
            peer,
        )
        welcomed.put(RemoteReplica(hello.index, hello.node_rank, hello.pid, sock))


def connect_to_front(
    config: EngineConfig, serves: str, index: int, pid: int, deadline: StartupDeadline
) -> tuple[Connection, float]:
    """Node r's end: a channel to node 0 for replica `index` (retried until node 0 answers
    or the deadline passes), and this machine's monotonic clock minus node 0's."""
    p = config.parallel
    secret = node_secret()
    where = f"{p.master_addr}:{p.master_port}"
    last = ""
    while True:
        try:
            sock = socket.create_connection((p.master_addr, p.master_port or 0), timeout=RETRY_S)
        except OSError as e:
            last = str(e)
            if deadline.left() <= 0:
                raise PyptoError(
                    f"node {p.node_rank} cannot reach node 0 at {where} within "
                    f"{deadline.limit_s:g} s ({last}): is `pypto serve --node-rank 0` running "
                    "there, with the same options?"
                ) from None
            time.sleep(min(RETRY_S, deadline.left()))
            continue
        break
    sock.settimeout(None)
    _tune(sock)
    _receive_timeout(sock, HANDSHAKE_S)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, secret)
        deliver_challenge(conn, secret)
        sent = time.monotonic()
        conn.send(Hello(p.node_rank, index, pid, serves))
        clock = conn.recv()
        back = time.monotonic()
        if isinstance(clock, Refused):
            why = clock.why
            raise PyptoError(f"node 0 at {where} refused data-parallel replica {index}: {why}")
    except AuthenticationError:
        conn.close()
        raise PyptoError(
            f"node 0 at {where} refused node {p.node_rank}: PYPTO_NODE_SECRET differs"
        ) from None
    except PyptoError:
        conn.close()
        raise
    except (OSError, EOFError) as e:
        conn.close()
        raise PyptoError(
            f"node 0 at {where} closed the channel of data-parallel replica {index} ({e}): "
            "does it expect this replica (the same data_parallel_size and nnodes)?"
        ) from None
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        _receive_timeout(s, 0)
    return conn, (sent + back) / 2 - clock.now


def relay(replica: Replica, front: Connection, offset: float) -> bool:
    """Pass messages between node 0 (`front`) and the local replica until either side ends;
    True if node 0 asked the replica to stop (a clean end)."""
    stopping = False
    try:
        while True:
            for conn in wait([replica.conn, front]):
                source, sink = (front, replica.conn) if conn is front else (replica.conn, front)
                try:
                    message = source.recv()
                except (EOFError, OSError):  # node 0 went away or lost the replica, or
                    return stopping  # the replica exited (closing `front` tells node 0)
                if isinstance(message, NewRequest):  # node 0's clock -> this one's
                    message.arrival_time += offset
                elif isinstance(message, StepResult):
                    for d in message.deltas:
                        if d.scheduled_time is not None:
                            d.scheduled_time -= offset
                stopping = stopping or (source is front and message is None)
                try:
                    sink.send(message)
                except OSError:
                    return stopping
    finally:
        front.close()
        if stopping:
            replica.stop()
        else:
            replica.kill()
