"""A rank of a two-process gloo group for tests/test_dp_expert_parallel.py, run as a script
(`python moe_exchange.py RANK STORE`; a plain subprocess leaves no helper process behind, as
multiprocessing's resource tracker would): tokens through `moe_dispatch` against
`moe_experts` with every expert on one rank, one JSON line per backend, activation and
case."""

from __future__ import annotations

import json
import sys

import torch

from pypto_serving.distributed import init_distributed, shutdown_distributed, use_rendezvous
from pypto_serving.ops.moe import expert_owners, expert_placement, moe_dispatch, moe_experts

CASES = ((7, 0), (5, 3))
"""Tokens on rank 0 and rank 1: rank 1 idle (no tokens), then both with some."""
ACTIVATIONS = ("swiglu", "gpt-oss")
"""SiLU's SwiGLU; gpt-oss's clamped gate with the experts' biases."""


def exchange(rank: int, store: str) -> None:
    """Every backend, activation and case: (backend, activation, case, rank, shapes agree,
    largest difference)."""
    use_rendezvous(store)
    init_distributed(rank, 2, "gloo", 60.0, tp_size=1, engine_size=1)  # as two replicas join
    try:
        torch.manual_seed(0)  # the same experts on both ranks
        gate_up, down = torch.randn(6, 16, 8), torch.randn(6, 8, 8)
        gate_up_bias, down_bias = torch.randn(6, 16), torch.randn(6, 8)
        held = expert_placement(6, rank, 2, "round_robin")
        for backend in ("all_to_all", "allgather_reducescatter"):
            for activation in ACTIVATIONS:
                tail: tuple = ()  # the activation's arguments, for both ops
                if activation == "gpt-oss":
                    tail = (1.0, 1.702, gate_up_bias, down_bias)  # limit, alpha, biases
                for case, counts in enumerate(CASES):
                    n = counts[rank]
                    torch.manual_seed(10 * case + rank)
                    x, weights = torch.randn(n, 8), torch.rand(n, 3)
                    chosen = [torch.randperm(6)[:3] for _ in range(n)] or [torch.ones(0, 3)]
                    ids = torch.stack(chosen).long().view(n, 3)
                    owners = expert_owners(6, 2, "round_robin") if n else []
                    mine_tail = tail and (*tail[:2], gate_up_bias[held], down_bias[held])
                    ours = (gate_up[held], down[held], held, owners, backend, *mine_tail)
                    mine = moe_dispatch(x, ids, weights, *ours)
                    want = moe_experts(x, ids, weights, gate_up, down, list(range(6)), *tail)
                    diff = ((mine - want).abs() / (want.abs() + 1)).max().item() if n else 0.0
                    row = [backend, activation, case, rank, mine.shape == want.shape, diff]
                    print(json.dumps(row))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    exchange(int(sys.argv[1]), sys.argv[2])
