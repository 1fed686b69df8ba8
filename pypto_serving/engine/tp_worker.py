"""Tensor-parallel ranks 1..N-1 of an engine: processes that follow rank 0's steps.

Rank 0 is the engine itself (`EngineCore`: scheduler, KV decisions, sampling). It picks a
rendezvous port, starts the other ranks as child processes (engine/process.py) with
torch.distributed's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), and joins the
group with them. Each rank loads its share of the weights, builds the same paged executor
(its share of the KV heads, the same page ids) and runs every step rank 0 broadcasts, until
rank 0 says stop or goes away.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

from pypto_serving.config import EngineConfig
from pypto_serving.device import plan_devices, resolve_device, resolve_dtype, set_num_threads
from pypto_serving.distributed import init_distributed, shutdown_distributed
from pypto_serving.engine.process import ChildProcess
from pypto_serving.executor.paged import build_paged_executor
from pypto_serving.models.loader import load_model

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerSpec:
    rank: int
    world_size: int
    backend: str
    config: EngineConfig
    """The engine's config with this rank's device and threads."""
    model_dir: Path
    cpus: list[int] | None
    log_level: int


def backend_for(config: EngineConfig, device: str) -> str:
    chosen = config.parallel.distributed_backend
    return chosen or ("nccl" if resolve_device(device).type == "cuda" else "gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plan_ranks(config: EngineConfig) -> list[tuple[EngineConfig, list[int] | None]]:
    """Each tensor-parallel rank's own config (device, threads) and cores, rank 0 first."""
    tp = config.parallel.tensor_parallel_size
    plan = plan_devices(tp, config.parallel.device_list(), config.device)
    return [
        (replace(config, device=d, num_threads=config.num_threads or (len(c) if c else None)), c)
        for d, c in plan
    ]


def start_workers(config: EngineConfig, model_dir: Path) -> list[ChildProcess]:
    """Start ranks 1..N-1 (they block in the rendezvous until rank 0 joins); set this
    process's environment for rank 0's own join."""
    ranks = plan_ranks(config)
    backend = backend_for(config, ranks[0][0].device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("PYPTO_MASTER_PORT") or str(free_port())
    level = logging.getLogger().getEffectiveLevel()
    workers: list[ChildProcess] = []
    try:
        for rank, (own, cpus) in enumerate(ranks[1:], start=1):
            spec = WorkerSpec(rank, len(ranks), backend, own, model_dir, cpus, level)
            workers.append(ChildProcess(worker_main, spec))
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """A rank > 0: join the group, load its share, follow rank 0's steps."""
    logging.basicConfig(
        level=spec.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s tp{spec.rank} %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    config = spec.config
    set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    group = init_distributed(spec.rank, spec.world_size, spec.backend)
    try:
        model = load_model(spec.model_dir, dtype, device, group)
        build_paged_executor(config, model, device, dtype, spec.model_dir).follow()
    except RuntimeError as e:  # rank 0 went away mid-collective: nothing left to serve
        log.info("rank %d stops: %s", spec.rank, str(e).splitlines()[0][:200])
    finally:
        shutdown_distributed()
    conn.close()
