"""A rank of a group for tests/test_shm_collectives.py, run as a script
(`python shm_ranks.py MODE RANK WORLD STORE`): it joins through `init_distributed` (gloo,
the shared-memory transport where it can) and prints one JSON line per check.

Modes:
- compare: every collective through shared memory against gloo's on the same inputs
  (`[what, case, equal]`); every rank can make every rank's inputs (seeded by rank), so it
  also checks the all-reduce against the sum in rank order (`[what, case, "order", equal]`).
- die: rank 1 exits at once; rank 0's all-reduce must fail naming it.
- late: rank 1 stays but never joins; rank 0's all-reduce (1 s limit) must time out.
- idle: rank 1 waits 3 s for rank 0's broadcast; it prints the CPU seconds it used.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from pypto_serving import distributed as d

ALL_REDUCE_SHAPES = ((1, 576), (3, 7), (1,), (0, 5), (5, 70001), (1, 576 * 1024))
"""[1, hidden]; odd; one value; empty; chunked (1.4 and 2.4 MB: over the 1 MiB slot)."""
GATHER_SHAPES = ((1, 24576), (3, 5, 7), (2, 0), (2, 300007), (1, 1))
BROADCAST_BYTES = (8, 1, 13, 0, 3 * (1 << 20) + 3)


def emit(*fields: object) -> None:
    print(json.dumps(fields), flush=True)


def inputs(shape: tuple[int, ...], rank: int, case: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(shape, generator=g).to(dtype)


def gloo_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def gloo_all_gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def compare(rank: int, world: int) -> None:
    for case, shape in enumerate(ALL_REDUCE_SHAPES):
        mine = [inputs(shape, r, case, torch.float32) for r in range(world)]
        got = d.tp_all_reduce(mine[rank])
        in_order = mine[0] + mine[1]
        for x in mine[2:]:
            in_order += x
        emit("all_reduce", case, "order", torch.equal(got, in_order))
        gloo = gloo_all_reduce(mine[rank])
        exact = world == 2 or torch.equal(got, gloo)  # gloo's order for 3 may differ
        emit("all_reduce", case, exact or torch.allclose(got, gloo, rtol=1e-5, atol=1e-5))
        whole = torch.round(mine[rank] * 64)  # exact in any order: gloo's bits exactly
        same = torch.equal(d.tp_all_reduce(whole), gloo_all_reduce(whole))
        emit("all_reduce", case, "integral", same)
    bf16 = d.tp_all_reduce(torch.ones(4, dtype=torch.bfloat16))  # summed in float32
    emit("all_reduce", "bf16 in", torch.equal(bf16, torch.full((4,), float(world))))
    for case, shape in enumerate(GATHER_SHAPES):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = inputs(shape, rank, case, dtype)
            same = torch.equal(d.tp_all_gather(x), gloo_all_gather(x))
            emit("all_gather", case, str(dtype), same)
    rows = inputs((3, 5), rank, 9, torch.float32)
    want = torch.cat([inputs((3, 5), r, 9, torch.float32) for r in range(world)])
    emit("all_gather_rows", torch.equal(d.all_gather_rows(rows, 3), want))
    emit("all_ranks_max", d.all_ranks_max([rank, -rank, 7]) == [world - 1, 0, 7])
    for case, n in enumerate(BROADCAST_BYTES):
        sent = inputs((n,), 0, case, torch.float32).view(torch.int32).to(torch.uint8)
        t = sent.clone() if rank == 0 else torch.zeros(n, dtype=torch.uint8)
        d._broadcast(t)
        g = sent.clone() if rank == 0 else torch.zeros(n, dtype=torch.uint8)
        dist.broadcast(g, 0)
        emit("broadcast", case, torch.equal(t, sent) and torch.equal(g, t))
    ids = torch.arange(5)
    pages = [[[1, 2], [3]], [[7], [8, 9, 10]]]  # two KV groups' page lists
    step = d.StepInputs(ids, ids, pages, ids[:2], ids[:2], ids[:1], 2, 1, b"moves")
    if rank == 0:
        d.broadcast_step(step, torch.device("cpu"))
        d.broadcast_step(d.Control(d.STOP, b"bye"), torch.device("cpu"))
        emit("step", True)
    else:
        got_step = d.receive_step(torch.device("cpu"), num_groups=2)
        stop = d.receive_step(torch.device("cpu"))
        assert isinstance(got_step, d.StepInputs) and isinstance(stop, d.Control)
        same = got_step.pages == step.pages and got_step.moves == b"moves"
        emit("step", same and torch.equal(got_step.input_ids, ids) and stop.data == b"bye")


def main(mode: str, rank: int, world: int, store: str) -> None:
    d.use_rendezvous(store)
    d.init_distributed(rank, world, "gloo", 120.0)
    emit("transport", d.collectives_transport())
    if mode == "compare":
        compare(rank, world)
    elif mode == "die" and rank == 1:
        os._exit(0)
    elif mode == "late" and rank == 1:
        time.sleep(30)  # alive, never joins: rank 0's limit ends it (the test kills this one)
    elif mode == "idle" and rank == 1:
        before = resource.getrusage(resource.RUSAGE_SELF)
        d._broadcast(torch.zeros(1))
        after = resource.getrusage(resource.RUSAGE_SELF)
        emit("cpu_s", after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    elif mode == "idle":
        time.sleep(3)
        d._broadcast(torch.ones(1))
    elif mode in ("die", "late"):
        if mode == "late":
            d.set_collective_timeout(1.0)
        start = time.monotonic()
        try:
            d.tp_all_reduce(torch.ones(1, 576))
            emit("error", None, time.monotonic() - start)
        except RuntimeError as e:
            emit("error", str(e), time.monotonic() - start)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a peer may be gone


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
