"""The ranks 1..N-1 of an engine (tensor-parallel shares, pipeline stages): processes that
follow rank 0's steps.

Rank 0 is the engine itself (`EngineCore`: scheduler, KV decisions, sampling). It sets up
the rendezvous (a private file on one machine; MASTER_ADDR / MASTER_PORT across machines,
where each other node's `pypto serve --node-rank R` starts that node's ranks), starts the
other ranks of its machine as child processes (engine/process.py), and joins the group with
them. Each rank loads its share of the weights (its heads, or its stage's layers),
builds the same paged executor (the same page ids) and runs every step rank 0 broadcasts,
until rank 0 says stop or goes away.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from pypto_serving.config import EngineConfig
from pypto_serving.device import plan_devices, resolve_device
from pypto_serving.distributed import (
    WAIT_FOREVER_S,
    Group,
    check_no_group,
    engine_gather,
    local_rendezvous,
    network_rendezvous,
    set_collective_timeout,
    shutdown_distributed,
)
from pypto_serving.engine.plan import plan_run
from pypto_serving.engine.process import (
    ChildProcess,
    Joining,
    StartFailed,
    StartupDeadline,
    describe,
)
from pypto_serving.engine.worker import join_group, load_share
from pypto_serving.errors import PyptoError
from pypto_serving.executor.kv_shares import handoff_page_bytes
from pypto_serving.executor.paged import PagedExecutor
from pypto_serving.models.config import ModelConfig, read_model_config, remember_model_config

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Loaded:
    """A rank's report that its share is loaded and its executor built: it follows steps."""

    pid: int


@dataclass(slots=True)
class WorkerSpec:
    rank: int
    backend: str
    config: EngineConfig
    """The engine's config with this rank's device and threads."""
    model_dir: Path
    log_level: int
    model_config: tuple[str, ModelConfig]
    """The parent's reading of the model's config.json (`read_model_config`)."""
    dp: Group = field(default_factory=Group)
    """Its replica's place among the data-parallel replicas (DP attention + EP: the world
    spans them all)."""


def backend_for(config: EngineConfig, device: str) -> str:
    chosen = config.parallel.distributed_backend
    return chosen or ("nccl" if resolve_device(device).type == "cuda" else "gloo")


def plan_ranks(config: EngineConfig) -> list[EngineConfig]:
    """The config (device, threads) of each of the engine's ranks on this machine, lowest rank
    first. On the CPU each rank gets as many threads as it has cores in `plan_devices`' split
    of the engine's cores, but is not pinned to them: all the ranks may run on any of the
    engine's cores. The ranks of a group step in lockstep (dozens of collectives a token), so
    a rank pinned to a core that another process also wants waits out that process's time
    slices and stalls every rank: beside one busy process TP=2 pinned fell to 23 tok/s, not
    pinned 52, where the kernel moves a rank to whichever core is free (idle: 103 vs 94;
    docs/performance.md)."""
    p = config.parallel
    plan = plan_devices(p.ranks_per_engine // p.nnodes, p.device_list(), config.device)
    return [
        replace(config, device=d, num_threads=config.num_threads or (len(c) if c else None))
        for d, c in plan
    ]


def start_workers(
    config: EngineConfig, model_dir: Path, deadline: StartupDeadline, dp: Group | None = None
) -> list[ChildProcess]:
    """Start this machine's ranks, all but rank 0 on node 0 (they block in the rendezvous
    until every rank joins); set this process's environment for rank 0's own join. Under DP
    attention + EP the ranks of replica `dp` join the world of every replica's ranks, whose
    rendezvous the replica process was given."""
    p = config.parallel
    check_no_group()  # before any process starts: rank 0 could not join a second group
    ranks = plan_ranks(config)
    backend = backend_for(config, ranks[0].device)
    if not p.expert_parallel_over_dp:  # else the replicas' meeting place is set already
        if p.nnodes == 1:
            local_rendezvous()
        else:
            network_rendezvous(p.master_addr, p.master_port or 0, len(ranks))
    level = logging.getLogger().getEffectiveLevel()
    first = p.node_rank * len(ranks)
    workers: list[ChildProcess] = []
    read = read_model_config(model_dir)  # handed to every rank: none reads it again
    try:
        for local, own in enumerate(ranks):
            if first + local == 0:
                continue  # rank 0 is the engine process itself
            spec = WorkerSpec(first + local, backend, own, model_dir, level, read, dp or Group())
            workers.append(ChildProcess(worker_main, spec))
        wait_ranks(workers, first + (1 if first == 0 else 0), Joining, deadline)
    except BaseException:
        for w in workers:
            w.kill()
        shutdown_distributed()  # removes the rendezvous file made above
        raise
    return workers


def wait_ranks(
    workers: list[ChildProcess],
    first_rank: int,
    expected: type[Joining] | type[Loaded],
    deadline: StartupDeadline,
) -> None:
    """Wait until every started rank reports `expected`: Joining (set up, joining the group:
    rank 0 then never waits in the rendezvous for one that failed), then Loaded (its share
    loaded: the collective warm-up may start). If one fails, exits or misses the deadline
    first, stop them all and raise PyptoError naming it."""
    pending = {w.conn: (first_rank + i, w) for i, w in enumerate(workers)}
    while pending:
        ready = wait(list(pending), timeout=deadline.left())
        if not ready:
            for other in workers:
                other.kill()
            raise deadline.missed([f"rank {r} (pid {w.pid})" for r, w in pending.values()])
        for conn in ready:
            rank, w = pending.pop(conn)  # type: ignore[call-overload]
            try:
                message = w.conn.recv()
            except (EOFError, OSError):
                message = None
            if isinstance(message, expected):
                continue
            why = (
                message.message
                if isinstance(message, StartFailed)
                else f"it exited with code {w.exit_code()}"
            )
            for other in workers:
                other.kill()
            raise PyptoError(f"rank {rank} (pid {w.pid}) failed to start: {why}")


def serve_node(config: EngineConfig, model_dir: Path) -> int:
    """A node other than 0: host this machine's ranks until they exit (rank 0 stops them, or
    goes away); Ctrl-C stops them. Returns the exit code."""
    deadline = StartupDeadline.after(config.parallel.startup_timeout_s)
    workers = start_workers(config, model_dir, deadline)
    log.info(
        "node %d of %d: ranks %s joining %s:%s",
        config.parallel.node_rank,
        config.parallel.nnodes,
        ", ".join(str(w.pid) for w in workers),
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    first = config.parallel.node_rank * len(workers)
    try:  # a rank that cannot join says why
        wait_ranks(workers, first, Loaded, deadline)
    except PyptoError as e:
        raise PyptoError(
            f"{e} (its group meets node 0 at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']}: is `pypto serve --node-rank 0` running there?)"
        ) from None
    log.info("node %d: every rank joined and loaded its share", config.parallel.node_rank)
    try:
        codes = [w.process.wait() for w in workers]
    except KeyboardInterrupt:
        codes = [130]
    finally:
        for w in workers:
            w.kill()
    return max(codes, default=0)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """A rank > 0: join the group, load its share, follow rank 0's steps."""
    logging.basicConfig(
        level=spec.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    config = spec.config
    try:
        remember_model_config(spec.model_dir, spec.model_config)
        plan = plan_run(config, spec.model_dir)
        torch.set_num_threads(plan.num_threads)
    except BaseException as e:  # reported before the rendezvous, so rank 0 never waits on it
        conn.send(StartFailed(os.getpid(), describe(e)))
        sys.exit(1)
    conn.send(Joining(os.getpid()))
    try:
        timeout = config.parallel.startup_timeout_s
        groups = join_group(config, spec.rank, spec.backend, timeout, spec.dp)
        executor = load_share(config, plan, spec.model_dir, groups).executor  # as rank 0 does
        assert isinstance(executor, PagedExecutor)  # parallelism needs it (config.validate)
    except BaseException as e:  # rank 0 waits for Loaded before any collective: tell it
        with contextlib.suppress(OSError):
            conn.send(StartFailed(os.getpid(), describe(e)))
        shutdown_distributed()
        sys.exit(1)
    conn.send(Loaded(os.getpid()))
    gc.freeze()  # start-up's objects live as long as the rank (as rank 0's engine does)
    try:
        engine_gather(executor.model.held_experts)  # rank 0 reports every rank's experts
        engine_gather(handoff_page_bytes(executor.kv, executor.groups))  # and their KV shares
        set_collective_timeout(WAIT_FOREVER_S)  # an idle engine sends no step for so long
        executor.follow()
    except RuntimeError as e:  # rank 0 went away mid-collective: nothing left to serve
        log.info("rank %d stops: %s", spec.rank, str(e).splitlines()[0][:200])
    except BaseException:
        shutdown_distributed()
        raise
    conn.close()
    # Done: leave without tearing gloo down. Its threads can abort a process at teardown
    # ("terminate called without an active exception", SIGABRT) while a peer's last message is
    # still in flight, which turned a clean stop into exit code 250; nothing is left to free.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)
