"""Pinning the KV pools' load-or-recompute choice in tests.

A pool loads a lower tier's page back only when that costs less than recomputing its tokens
at the rates the steps measure (`kv.pool.Costs`). A tiny test model recomputes a page of 16
tokens in about the time of the shared pool's first-guess load (a round trip), so which wins
turns on the machine's moment; tests about what the tiers hold pin the choice here."""

from __future__ import annotations

from pypto_serving.engine.llm import LLM
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.pool import Costs


class FixedCosts(Costs):
    """Estimates that no measurement moves: the choices replay whatever the machine's load."""

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        pass

    def observe_load(self, tier: str, num_pages: int, seconds: float) -> None:
        pass


def fixed(costs: Costs, recompute_s_per_token: float | None = None) -> FixedCosts:
    """The same estimates, kept (recompute_s_per_token: another recompute rate)."""
    rate = costs.recompute_s_per_token if recompute_s_per_token is None else recompute_s_per_token
    return FixedCosts(rate, dict(costs.load_s_per_page))


def loads_always_pay(llm: LLM) -> None:
    """Every KV group of `llm` loads the pages its lower tiers hold (a second per recomputed
    token: no load costs more)."""
    kv = llm.engine.executor.kv
    assert isinstance(kv, KVGroups)
    for manager in kv.managers:
        manager.pool.costs = fixed(manager.pool.costs, recompute_s_per_token=1.0)
