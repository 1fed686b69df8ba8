"""torch.distributed for tensor, pipeline and expert parallelism: rendezvous, group metadata,
collectives and point-to-point transfers.

Model code learns its place from `ParallelGroups` (its rank and size in the TP, PP, DP and EP
groups) and calls the collectives below, which are custom ops (or run inside one, as the
experts' token exchange does in ops/moe.py): torch.compile treats them as opaque calls
(like the paged attention op), so one compiled graph per shape serves every step. Partial
sums are reduced in float32 (the residual stream's dtype), so TP does not add rounding.

Under DP attention + EP the torch.distributed world of a replica process is the replicas
themselves (tensor_parallel_size 1): its MoE layers exchange tokens over it, and the
replicas agree on every step with `all_ranks_max` (engine/replica.py); replicas on several
machines meet by env:// at node 0's master_port + 1 (`network_rendezvous`).

The group is one engine's ranks: rank 0 runs the scheduler and broadcasts each step's
inputs as int64 tensors (never pickled objects); the other ranks follow. On one machine the
ranks meet through a file (a FileStore in a private directory) and gloo's connections stay
on the loopback device, so nothing listens on the network. Across machines they rendezvous
through torch.distributed's environment method: MASTER_ADDR / MASTER_PORT, RANK and
WORLD_SIZE, set by `pypto serve` on each node; gloo on CPUs and nccl on GPUs.

The transport of the collectives is chosen once, here, when the group starts: on CPUs, when
every rank is on this machine (they can share one /dev/shm segment), all-reduce, all-gather
and broadcast go through shared memory (`shm_collectives.py`: microseconds, where gloo over
loopback takes a millisecond); across machines through gloo; on GPUs through nccl.
PYPTO_TP_COLLECTIVES=gloo keeps gloo (=shm: shared memory or an error). The rest (point to
point, all-to-all, reduce-scatter, the KV tiers' agreements) stays on torch.distributed.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pypto_serving.errors import PyptoError
from pypto_serving.shm_collectives import ShmGroup, open_group

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0
"""After start-up, how long rank 0 waits in a collective of a step. (Start-up has its own
limit, `startup_timeout_s`; ranks > 0 wait for rank 0's next step without one, since an idle
engine sends none.)"""
WAIT_FOREVER_S = 10 * 365 * 86400.0
COLLECTIVES_ENV = "PYPTO_TP_COLLECTIVES"
"""auto (default): shared memory when every rank is on this machine, else gloo; gloo: always
gloo; shm: shared memory, or an error at start-up."""


@dataclass(frozen=True, slots=True)
class Group:
    """This process's rank and the size of one parallel group (TP, PP, DP or EP)."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    """This process's rank and size in every parallel group, what model code consumes.
    Ranks of one engine are numbered pipeline stage-major: rank = pp.rank * tp.size + tp.rank."""

    tp: Group = Group()
    pp: Group = Group()
    dp: Group = Group()
    """This replica's index and the number of data-parallel replicas (they share no
    collective, except the MoE layers' under DP attention + EP)."""
    ep: Group = Group()
    """Expert parallelism: the TP ranks when enabled, or under DP attention + EP every
    replica's ranks (replica-major: rank dp.rank * tp.size + tp.rank), each holding some
    whole experts."""
    expert_placement: str = "linear"
    all2all_backend: str = "all_to_all"
    """How tokens reach experts held by other replicas (DP attention + EP only)."""

    @property
    def expert_exchange(self) -> str:
        """How a MoE layer reaches the experts it does not hold: "none" (it holds them all),
        "all_reduce" (EP over TP: every rank has every token, the partial sums are added) or,
        EP over the DP replicas (each its own tokens), the all2all_backend: each rank then
        exchanges with the other replicas' ranks of its TP index (its "column"), for the
        experts held in that column, and with TP > 1 the columns' sums are all-reduced."""
        if self.ep.size == 1:
            return "none"
        return "all_reduce" if self.ep == self.tp else self.all2all_backend

    @property
    def rank(self) -> int:
        """This process's rank in its engine's torch.distributed world."""
        return self.pp.rank * self.tp.size + self.tp.rank

    @property
    def world_size(self) -> int:
        return self.tp.size * self.pp.size


def resolve_groups(
    rank: int,
    tp_size: int,
    pp_size: int,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    dp: Group = Group(),
    all2all_backend: str = "all_to_all",
) -> ParallelGroups:
    """The groups of engine rank `rank` in an engine of pp_size stages x tp_size ranks, in
    replica `dp`; with expert parallelism the experts are spread over the TP group, or with
    several replicas (DP attention + EP) over every replica's ranks, replica-major."""
    tp = Group(rank % tp_size, tp_size)
    ep = Group()
    if expert_parallel:
        ep = Group(dp.rank * tp_size + tp.rank, dp.size * tp_size) if dp.size > 1 else tp
    pp = Group(rank // tp_size, pp_size)
    return ParallelGroups(tp, pp, dp, ep, expert_placement, all2all_backend)


STORE_FILE_ENV = "PYPTO_RENDEZVOUS_FILE"
"""Set (by whoever starts the ranks) when all of them are on this machine: they rendezvous
through this file instead of a listening TCP store."""


def local_rendezvous() -> None:
    """Make the ranks started from here (they inherit the environment) meet without the
    network: a FileStore in a private directory, and gloo's pairs on the loopback device."""
    global _made_store_dir
    _made_store_dir = Path(tempfile.mkdtemp(prefix="pypto-rendezvous-"))
    use_rendezvous(str(_made_store_dir / "store"))


def use_rendezvous(store_file: str) -> None:
    """Meet the other ranks through `store_file` (made in a private directory by whoever
    started them), gloo's pairs on the loopback device."""
    os.environ[STORE_FILE_ENV] = store_file
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def network_rendezvous(master_addr: str, master_port: int, per_node: int) -> None:
    """Make this process (and the ranks it starts, which inherit the environment) meet
    ranks on other machines by env:// (`env_store`): node 0 listens at master_addr:port,
    `per_node` ranks on each node; gloo's pairs on the interface routed towards node 0."""
    os.environ.pop(STORE_FILE_ENV, None)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # ranks per node (torchrun's name)
    interface = interface_towards(master_addr)
    if interface is not None and os.environ.get("GLOO_SOCKET_IFNAME") in (None, "lo"):
        # else gloo goes by the hostname's address (often wrong), or by the loopback
        # device a group of this machine's ranks set in this process
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def interface_towards(address: str) -> str | None:
    """The name of this machine's network interface on the route to `address` (whose own
    address the route leaves from; node 0's own address gives its own interface), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # picks the route; sends nothing
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                with contextlib.suppress(OSError):
                    got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
                    if socket.inet_ntoa(got[20:24]) == local:
                        return name
    except OSError:
        pass
    return None


SIOCGIFADDR = 0x8915


_made_store_dir: Path | None = None


def check_no_group() -> None:
    """Raise PyptoError if this process is still in another engine's group (a process holds
    one multi-rank engine at a time; its close() leaves the group)."""
    if dist.is_initialized():
        raise PyptoError(
            "this process still holds another multi-rank engine (tensor or pipeline "
            "parallel): close it first (LLM.close(), or a `with LLM(...)` block)"
        )


def init_distributed(
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    tp_size: int | None = None,
    engine_size: int | None = None,
) -> None:
    """Join the world of torch.distributed: through the rendezvous file when the ranks share
    this machine, else MASTER_ADDR / MASTER_PORT from the environment (env://). `timeout_s`
    bounds the rendezvous and every collective until `set_collective_timeout`.

    The world's ranks are numbered engine-major, an engine's stage-major. The tensor-parallel
    collectives run over consecutive blocks of `tp_size` ranks (a pipeline stage's ranks;
    None: the world), rank 0's steps go to consecutive blocks of `engine_size` (an engine's
    ranks; None: the world is one engine). Where the world holds several engines (DP
    attention + EP), the experts' exchange runs over the ranks with the same index in every
    engine (a "column": the world when engines have one rank each)."""
    if world_size == 1:
        return
    check_no_group()
    timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
    store_file = os.environ.get(STORE_FILE_ENV)
    store: dist.Store = (
        dist.FileStore(store_file, world_size)
        if store_file
        else env_store(rank, world_size, timeout_s)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _choose_transport(backend, rank, world_size, timeout_s, tp_size or world_size, engine_size)


@dataclass(slots=True)
class _Comm:
    """A group this process collects over: its torch.distributed group (None: the world),
    its shared-memory transport if it has one, its size and its first rank in the world."""

    group: dist.ProcessGroup | None = None
    shm: ShmGroup | None = None
    size: int = 1
    first: int = 0


_world = _Comm()
_tp = _Comm()
_engine = _Comm()
_ep = _Comm()
"""The world, this rank's TP group, its engine (whose rank 0 broadcasts the steps) and its
experts' exchange group; each a view of the world where it is the world."""


def _choose_transport(
    backend: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    tp_size: int,
    engine_size: int | None,
) -> None:
    """Shared memory for the CPU collectives when every rank of a group can share it (all on
    this machine), else torch.distributed's backend; every rank of a group makes the same
    choice. Each group smaller than the world is a sub-group with a segment of its own."""
    global _world, _tp, _engine, _ep
    choice = os.environ.get(COLLECTIVES_ENV, "auto")
    if choice not in ("auto", "gloo", "shm"):
        raise PyptoError(f"{COLLECTIVES_ENV} must be auto, gloo or shm, not {choice!r}")
    wanted = backend == "gloo" and choice != "gloo"
    store = dist.distributed_c10d._get_default_store()
    _world = _Comm(None, open_group(store, rank, world_size, wanted), world_size, 0)
    engine = engine_size or world_size
    blocks = {"tp": tp_size, "engine": engine}
    mine = {
        name: [[b * n + i for i in range(n)] for b in range(world_size // n)]
        for name, n in blocks.items()
    }
    # the experts' exchange: each column of several engines (one engine: the world)
    columns = [list(range(i, world_size, engine)) for i in range(engine)]
    mine["ep"] = columns if engine < world_size else [list(range(world_size))]
    made: dict[str, _Comm] = {}
    for name, lists in mine.items():  # every rank makes every group, in the same order
        if name == "engine" and engine == tp_size:
            made[name] = made["tp"]  # an engine of one stage: its TP group
            continue
        if len(lists[0]) in (1, world_size):
            made[name] = _world if len(lists[0]) == world_size else _Comm(first=rank)
            continue
        for i, ranks in enumerate(lists):
            group = dist.new_group(ranks)
            if rank in ranks:
                prefix = dist.PrefixStore(f"pypto-{name}{i}/", store)
                shm = open_group(prefix, ranks.index(rank), len(ranks), wanted)
                made[name] = _Comm(group, shm, len(ranks), ranks[0])
    _tp, _engine, _ep = made["tp"], made["engine"], made["ep"]
    for comm in _comms():
        if comm.shm is not None:
            comm.shm.timeout_s = max(timeout_s, 1.0)
    if _world.shm is None and choice == "shm":
        shutdown_distributed()
        raise PyptoError(
            f"{COLLECTIVES_ENV}=shm: the ranks cannot share memory (backend {backend}, not "
            "all on this machine, or no C++ compiler); see the log"
        )
    if rank == 0:
        log.info("collectives: %s", "shared memory" if _world.shm is not None else backend)


def _comms() -> list[_Comm]:
    """Each distinct group of this process, the world first."""
    seen: list[_Comm] = []
    for comm in (_world, _tp, _engine, _ep):
        if all(comm is not other for other in seen):
            seen.append(comm)
    return seen


def shm_group() -> ShmGroup | None:
    """The shared-memory transport of the tensor-parallel group, when it has one (the
    native decode step calls its collectives itself)."""
    return _tp.shm


def collectives_transport() -> str:
    """How this process's collectives travel: "shm", torch.distributed's backend, or "none"
    outside a group."""
    if _world.shm is not None:
        return "shm"
    return dist.get_backend() if dist.is_initialized() else "none"


def env_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The rendezvous of torch.distributed's env:// method (MASTER_ADDR, MASTER_PORT; rank 0
    listens there), made here so that a rank that never arrives is named: each rank checks
    in under its own key, and rank 0 waits for all of them within `timeout_s`. Ranks are
    numbered node by node, LOCAL_WORLD_SIZE on each (torchrun's convention)."""
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    per_node = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
            wait_for_workers=False,
        )
        store.set(f"pypto/arrived/{rank}", "1")
    except (RuntimeError, OSError) as e:  # torch's DistError subclasses RuntimeError
        where = "listen on" if rank == 0 else "reach node 0 at"
        raise PyptoError(
            f"rank {rank} (node {rank // per_node}) cannot {where} {addr}:{port} within "
            f"{timeout_s:.0f} s: {str(e).splitlines()[0][:200]}"
        ) from None
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, world_size))
        while True:
            missing = [r for r in missing if not store.check([f"pypto/arrived/{r}"])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if missing:
            nodes = sorted({r // per_node for r in missing})
            raise PyptoError(
                f"node(s) {', '.join(map(str, nodes))} never arrived: rank(s) "
                f"{', '.join(map(str, missing))} did not join the rendezvous at {addr}:{port} "
                f"within {timeout_s:.0f} s (startup_timeout_s); start `pypto serve "
                f"--node-rank N` with the same options on each of them"
            )
    return store


def set_collective_timeout(seconds: float) -> None:
    """Once started: how long a collective may wait for the other ranks (WAIT_FOREVER_S: a
    rank > 0 waiting, however long the engine stays idle, for rank 0's next step)."""
    for comm in _comms():
        if dist.is_initialized() and (comm.group is not None or comm is _world):
            # torch has no public setter for a group's timeout
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), comm.group)
        if comm.shm is not None:
            comm.shm.timeout_s = seconds


def shutdown_distributed() -> None:
    """Leave the group; the process that made the rendezvous file removes it."""
    global _made_store_dir, _world, _tp, _engine, _ep
    for comm in _comms():
        if comm.shm is not None:
            comm.shm.close()
    _world, _tp, _engine, _ep = _Comm(), _Comm(), _Comm(), _Comm()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _made_store_dir is not None:
        os.environ.pop(STORE_FILE_ENV, None)
        shutil.rmtree(_made_store_dir, ignore_errors=True)
        _made_store_dir = None


def exchange_ranks() -> int:
    """Ranks of the experts' exchange group (1 outside one): under DP attention + EP the
    replicas, one rank of each (the ranks with this one's TP index)."""
    return _ep.size


@torch.library.custom_op("pypto::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the tensor-parallel group of every rank's `x` (float32)."""
    if _tp.shm is not None and x.device.type == "cpu":
        return _tp.shm.all_reduce(x.float())
    out = x.float().clone()
    dist.all_reduce(out, group=_tp.group)
    return out


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("pypto::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every TP rank's `x` [N, d] side by side along the last dimension: [N, tp * d]."""
    if _tp.shm is not None and x.device.type == "cpu":
        return _tp.shm.all_gather(x)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x, group=_tp.group)
    return torch.cat(parts, dim=-1)


@tp_all_gather.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * _tp.size)


def _broadcast_in(comm: _Comm, t: torch.Tensor) -> None:
    """The group's first rank's `t` into every other rank's of the group (in place)."""
    if comm.size == 1:
        return
    if comm.shm is not None and t.device.type == "cpu":
        comm.shm.broadcast(t)
    else:
        dist.broadcast(t, comm.first, group=comm.group)


def tp_broadcast(t: torch.Tensor) -> None:
    """The TP group's first rank's `t` into every other TP rank's (in place)."""
    _broadcast_in(_tp, t)


def engine_min(t: torch.Tensor) -> None:
    """The minimum over the engine's ranks of every rank's int64 `t` (in place)."""
    if _engine.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_engine.group)


def engine_gather(values: list[int]) -> list[list[int]]:
    """Every rank of this engine's `values`, in engine rank order (a collective of the
    engine's ranks: each calls it once, at start-up)."""
    if _engine.size == 1:
        return [values]
    out: list[list[int]] = [[] for _ in range(_engine.size)]
    dist.all_gather_object(out, values, group=_engine.group)
    return out


def all_ranks_max(values: list[int]) -> list[int]:
    """Each value's maximum over the experts' exchange group (DP attention + EP, called by
    each replica's rank 0: whether any replica has work, or is stopping)."""
    t = torch.tensor(values, dtype=torch.int64)
    if _ep.shm is not None:
        return [int(v) for v in _ep.shm.all_gather_rows(t).view(-1, len(values)).amax(0).tolist()]
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_ep.group)
    return [int(v) for v in t.tolist()]


def all_to_all_rows(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Rows of `x` to every rank: the first send_counts[0] to rank 0, the next to rank 1, ...
    Returns the rows received (rank 0's first) and how many came from each rank (exchanged
    first, unless `recv_counts` already says)."""
    if recv_counts is None:
        counts = torch.tensor(send_counts, dtype=torch.int64)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=_ep.group)
        recv_counts = [int(n) for n in got.tolist()]
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=_ep.group)
    return out, recv_counts


def all_to_all_back(
    y: torch.Tensor, recv_counts: list[int], send_counts: list[int]
) -> torch.Tensor:
    """The reverse of `all_to_all_rows`: rows computed for the ranks that sent them go back,
    each rank getting its rows in the order it sent them."""
    out = y.new_empty(sum(send_counts), *y.shape[1:])
    dist.all_to_all_single(out, y.contiguous(), send_counts, recv_counts, group=_ep.group)
    return out


def all_gather_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's `x` [rows, ...] (each padded to the same `rows`), rank 0's first."""
    if _ep.shm is not None and x.device.type == "cpu":
        return _ep.shm.all_gather_rows(x)
    out = x.new_empty(_ep.size * rows, *x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=_ep.group)
    return out


def reduce_scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of `x` [world * rows, ...]; this rank's block of rows."""
    out = x.new_empty(len(x) // _ep.size, *x.shape[1:])
    dist.reduce_scatter_single(out, x.contiguous(), group=_ep.group)
    return out


def send_to(tensor: torch.Tensor, rank: int) -> None:
    """Point-to-point: hand a pipeline stage's activations (or logits) to `rank`."""
    dist.send(tensor.contiguous(), rank)


def receive_from(shape: tuple[int, ...], rank: int, device: torch.device) -> torch.Tensor:
    """Point-to-point: the float32 tensor of `shape` that `rank` sends next."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(out, rank)
    return out


def send_bytes(data: np.ndarray, rank: int, device: torch.device) -> None:
    """Point-to-point: bytes to `rank` (which knows how many: `receive_bytes`), through
    the device where the backend needs it there."""
    dist.send(torch.from_numpy(data).to(device), rank)


def receive_bytes(out: np.ndarray, rank: int, device: torch.device) -> None:
    """Point-to-point: the bytes `rank` sends next, into `out` (exactly their size)."""
    if device.type == "cpu":
        dist.recv(torch.from_numpy(out), rank)
        return
    got = torch.empty(out.size, dtype=torch.uint8, device=device)
    dist.recv(got, rank)
    out[:] = got.cpu().numpy()


HEADER = 8
"""Ints in a step header: tokens, sequences, pages (every KV group's, all sequences'), decodes,
longest query, logits rows, the message kind (0: a step, else a `Control`'s), bytes of the
page moves (or of the control's data)."""
STOP, SSD_LOAD, JOIN_EXPERTS, KV_EXPORT, KV_RECEIVE = 1, 2, 3, 4, 5
"""`Control` kinds: stop (after the last page moves), an SSD load to agree on (`kv/mirror.py`),
a step with no tokens that joins the experts' exchange (DP attention + EP, an idle replica),
and a handoff between prefill and decode servers: every rank sends rank 0 its share of a
prompt's pages (export), or takes its share of pages another server sent (receive;
`executor/kv_shares.py`)."""


@dataclass(slots=True)
class Control:
    """A message from rank 0 that is not a step: its kind and its bytes."""

    kind: int
    data: bytes = b""


@dataclass(slots=True)
class StepInputs:
    """What every rank needs to run one step's forward (rank 0 builds it and broadcasts)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    pages: list[list[list[int]]]
    """Per KV group (in the order the model's kind declares them), each sequence's page ids:
    each rank's attention operator maps its slots from them."""
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    logits_index: torch.Tensor
    num_decodes: int
    max_q: int
    moves: bytes = b""
    """Rank 0's page moves since the last step, for the other ranks to mirror (`kv/mirror.py`)."""

    def parts(self) -> list[torch.Tensor]:
        return [
            self.input_ids,
            self.positions,
            torch.tensor([len(p) for group in self.pages for p in group]),
            torch.tensor([i for group in self.pages for p in group for i in p]),
            self.q_lens,
            self.ctx_lens,
            self.logits_index,
        ]


def _broadcast(t: torch.Tensor) -> None:
    """The engine's rank 0's `t` into its other ranks' (in place)."""
    _broadcast_in(_engine, t)


def broadcast_step(step: StepInputs | Control, device: torch.device) -> None:
    """Rank 0: send a step's inputs, or a control message, to the other ranks."""
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    if isinstance(step, Control):
        header[6], header[7] = step.kind, len(step.data)
        _broadcast(header)
        if step.data:
            _broadcast(torch.frombuffer(bytearray(step.data), dtype=torch.uint8).to(device))
        return
    t, b = len(step.input_ids), len(step.q_lens)
    p = sum(len(x) for group in step.pages for x in group)
    header[:6] = torch.tensor(
        [t, b, p, step.num_decodes, step.max_q, len(step.logits_index)], device=device
    )
    header[7] = len(step.moves)
    _broadcast(header)
    _broadcast(torch.cat([p.to(device, torch.int64) for p in step.parts()]))
    if step.moves:
        _broadcast(torch.frombuffer(bytearray(step.moves), dtype=torch.uint8).to(device))


def _receive_bytes(num_bytes: int, device: torch.device) -> bytes:
    if not num_bytes:
        return b""
    raw = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    _broadcast(raw)
    return raw.cpu().numpy().tobytes()


def receive_step(device: torch.device, num_groups: int = 1) -> StepInputs | Control:
    """Ranks > 0: the next step's inputs from rank 0 (page lists for `num_groups` KV groups),
    or a control message."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    _broadcast(header)
    t, b, p, num_decodes, max_q, n, kind, num_bytes = header.tolist()
    if kind:
        return Control(kind, _receive_bytes(num_bytes, device))
    lens = num_groups * b
    payload = torch.empty(2 * t + lens + p + 2 * b + n, dtype=torch.int64, device=device)
    _broadcast(payload)
    ids, pos, num_pages, flat, q_lens, ctx_lens, index = payload.split([t, t, lens, p, b, b, n])
    ends, page_ids = torch.cumsum(num_pages, 0).tolist(), flat.tolist()
    lists = [page_ids[end - k : end] for end, k in zip(ends, num_pages.tolist(), strict=True)]
    pages = [lists[i : i + b] for i in range(0, lens, b)] if b else [[]] * num_groups
    moves = _receive_bytes(num_bytes, device)
    return StepInputs(ids, pos, pages, q_lens, ctx_lens, index, num_decodes, max_q, moves)
