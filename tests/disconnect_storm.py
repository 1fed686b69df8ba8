"""A storm of streaming clients that drop at random points, against a live server.

Shared by tests/test_disconnects.py (200 clients) and scripts/disconnect_storm.py (1,000).
The engine is set up so that requests are often queued, mid-prefill (small step budget),
preempted (a small device pool) and served from the CPU and SSD tiers (shared prompt
prefixes, small tiers). Each client either reads its whole stream, drops after k chunks, or
drops at a random moment before or during its response. Every abort is classified by the
state its request was in when the engine applied it. Afterwards the engine must be idle and
hold nothing, and every client that stayed must have received exactly the greedy tokens of
the offline API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from live_server import serving, tiny_llm
from patience import patience

from pypto_serving.engine.async_llm import AsyncLLM
from pypto_serving.engine.llm import LLM
from pypto_serving.kv.groups import KVGroups
from pypto_serving.request import Request, RequestStatus
from pypto_serving.sampling import SamplingParams

STORM_KNOBS: dict[str, Any] = {
    "num_kv_pages": 40,  # 640 tokens: a few requests fill it, later ones preempt
    "page_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 16,  # prompts take several steps: aborts land mid-prefill
    "kv_cpu_bytes": 24 << 10,
    "kv_ssd_bytes": 96 << 10,
}
PREFIXES = [[(31 * p + 7 * j) % 300 + 3 for j in range(40)] for p in range(4)]
"""Shared prompt beginnings (2.5 pages each): cached, demoted to the tiers, loaded back."""


PLANS = {
    "complete": 0.3,
    "drop_after": 0.25,  # after k chunks: mid-decode
    "drop_at": 0.15,  # at a random moment: mostly while queued
    "drop_in:prefill": 0.1,  # the moment the engine is seen computing its prompt
    "drop_in:preempted": 0.1,  # ...or holding it preempted
    "drop_in:tier": 0.1,  # ...or running on prompt pages loaded from the CPU or SSD tier
}
"""Each client's plan and its share. The drop_in plans close the connection when a watcher
on the engine thread sees the request in that state."""
HOLD_S = 1.0
"""Longest the watcher holds the engine for a dropping client's disconnect to arrive (on an
idle machine: stretched by `patience`)."""


@dataclass(slots=True)
class Client:
    prompt: list[int]
    max_tokens: int
    plan: str
    after: int = 0
    at: float = 0.0
    delay: float = 0.0
    """Seconds after the storm starts that the client sends its request."""
    chunks: int = 0
    text: str = ""
    status: int | None = None
    done: bool = False
    error: str | None = None
    drop: asyncio.Event | None = None
    """Set (from the engine thread, through the loop) when a drop_in plan's state is seen."""


@dataclass(slots=True)
class StormResult:
    clients: list[Client]
    abort_states: Counter[str]
    seconds: float
    idle_after_s: float
    """From the last client's end until the engine was idle and held no page."""
    tier_loads: dict[str, int]
    mismatches: list[int]
    """Indexes of clients that stayed and did not get exactly the offline text."""

    def summary(self) -> dict[str, Any]:
        return {
            "clients": len(self.clients),
            "plans": dict(Counter(c.plan for c in self.clients)),
            "completed": sum(c.done for c in self.clients),
            "abort_states": dict(self.abort_states),
            "tier_loads": self.tier_loads,
            "mismatches": len(self.mismatches),
            "errors": sum(c.error is not None for c in self.clients),
            "idle_after_s": round(self.idle_after_s, 3),
            "seconds": round(self.seconds, 1),
        }


def make_clients(n: int, seed: int, spread_s: float) -> list[Client]:
    rng = random.Random(seed)
    clients = []
    for _ in range(n):
        prompt = [*rng.choice(PREFIXES)][: rng.randint(8, 40)] if rng.random() < 0.8 else []
        prompt += [rng.randrange(3, 300) for _ in range(rng.randint(4, 300))]
        max_tokens = rng.randint(4, 48)
        plan = rng.choices(list(PLANS), list(PLANS.values()))[0]
        clients.append(
            Client(
                prompt,
                max_tokens,
                plan,
                after=rng.randrange(max_tokens),
                at=rng.uniform(0.0, 4.0),
                delay=rng.uniform(0.0, spread_s),
            )
        )
    return clients


async def run_client(http: httpx.AsyncClient, url: str, model: str, c: Client) -> None:
    await asyncio.sleep(c.delay)
    body = {
        "model": model,
        "prompt": c.prompt,
        "max_tokens": c.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def read() -> None:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            c.status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    c.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    c.error = event["error"]["message"]
                    continue
                c.chunks += 1
                c.text += event["choices"][0]["text"]
                if c.plan == "drop_after" and c.chunks > c.after:
                    return  # leaving the block closes the connection mid-stream

    reading = asyncio.ensure_future(read())
    if c.plan == "drop_at":
        await asyncio.wait({reading}, timeout=c.at)
    elif c.drop is not None:
        dropped = asyncio.ensure_future(c.drop.wait())
        await asyncio.wait({reading, dropped}, return_when=asyncio.FIRST_COMPLETED)
        dropped.cancel()
    else:
        await reading
    if not reading.done():  # cancelling the read closes the connection
        reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading


def abort_state(request: Request, kv: KVGroups) -> str:
    """Where a request was when its abort was applied."""
    if request.finished:
        return "finished"
    if request.status is RequestStatus.PREEMPTED:
        return (
            "preempted (swapped)" if request.request_id in kv.managers[0].swapped else "preempted"
        )
    if request.status is RequestStatus.WAITING:
        return "queued"
    if request.num_computed_tokens < len(request.prompt_token_ids):
        return "prefill"
    return "decode"


def loaded_from_tier(request: Request) -> bool:
    return any(request.cached_tokens_by_tier.get(t) for t in ("cpu", "ssd"))


def watch_states(engine: AsyncLLM, clients: list[Client], loop: asyncio.AbstractEventLoop) -> None:
    """Before each engine step (on the engine thread), tell the drop_in clients whose request
    is in their state to drop, and hold the step until the server has seen the disconnect
    (up to HOLD_S), so the abort is applied while the request is still in that state."""
    by_prompt = {tuple(c.prompt): c for c in clients if c.plan.startswith("drop_in:")}
    core = engine.engine
    real_step = core.step

    def step() -> list[Request]:
        for r in [*core.scheduler.running, *core.scheduler.waiting]:
            c = by_prompt.get(tuple(r.prompt_token_ids))
            if c is None or c.drop is None or c.drop.is_set():
                continue
            state = abort_state(r, core.executor.kv).removesuffix(" (swapped)")
            wanted = c.plan.removeprefix("drop_in:")
            if state == wanted or (wanted == "tier" and loaded_from_tier(r)):
                loop.call_soon_threadsafe(c.drop.set)
                family = r.request_id.rsplit("-", 1)[0]
                deadline = time.monotonic() + patience(HOLD_S)
                while family not in engine._aborts and time.monotonic() < deadline:
                    time.sleep(0.001)
                return []  # a step that does nothing: the abort is applied before the next
        return real_step()

    core.step = step  # type: ignore[method-assign]


def holdings(llm: LLM) -> list[str]:
    """What the engine still holds: requests, device pages with references, swapped KV."""
    core = llm.engine
    kv = core.executor.kv
    held = []
    stats = core.stats()
    if stats.num_running or stats.num_waiting:
        held.append(f"{stats.num_running} running, {stats.num_waiting} waiting")
    referenced = [p for p in range(kv.pool.num_pages) if kv.pool.device.ref_count(p)]
    if referenced:
        held.append(f"device pages with references: {referenced}")
    if kv.managers[0].tables:
        held.append(f"page tables: {sorted(kv.managers[0].tables)}")
    if kv.managers[0].swapped or (kv.pool.cpu is not None and kv.pool.cpu.held_keys()):
        held.append(f"swapped: {sorted(kv.managers[0].swapped)}")
    return held


def storm_llm(model_dir: Path, ssd_dir: Path, **knobs: Any) -> LLM:
    return tiny_llm(model_dir, **(STORM_KNOBS | {"kv_ssd_dir": str(ssd_dir)} | knobs))


def storm(llm: LLM, n: int, seed: int = 0, spread_s: float = 3.0) -> StormResult:
    """Run `n` clients against a server around `llm`; check nothing is held afterwards."""
    clients = make_clients(n, seed, spread_s)
    stay = [i for i, c in enumerate(clients) if c.plan == "complete"]
    for c in clients:  # prompts are how the watcher finds a client's request: make them unique
        while sum(tuple(o.prompt) == tuple(c.prompt) for o in clients) > 1:
            c.prompt.append(3)
    offline = llm.generate(  # the offline API's greedy text, for the clients that stay
        [clients[i].prompt for i in stay],
        [
            SamplingParams(temperature=0, ignore_eos=True, max_tokens=clients[i].max_tokens)
            for i in stay
        ],
        use_tqdm=False,
    )
    expected = {i: out.outputs[0].text for i, out in zip(stay, offline, strict=True)}
    states: Counter[str] = Counter()
    real_abort = llm.abort

    def abort(family: Any) -> None:
        for child in family.children:
            states[abort_state(child, llm.engine.executor.kv)] += 1
            if loaded_from_tier(child):
                states["after loading from a tier"] += 1
        real_abort(family)

    llm.abort = abort  # type: ignore[method-assign]
    loads_before = {t.name: t.loaded for t in llm.engine.stats().tiers}
    room = len(clients) + 64  # every client connected at once, under the connection caps
    with serving(llm, max_connections=room, max_connections_per_client=room) as live:
        start = time.monotonic()

        async def all_clients() -> None:
            for c in clients:
                c.drop = asyncio.Event() if c.plan.startswith("drop_in:") else None
            watch_states(live.engine, clients, asyncio.get_running_loop())
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=patience(120), limits=limits) as http:
                await asyncio.gather(*(run_client(http, live.url, live.model, c) for c in clients))

        try:
            asyncio.run(all_clients())
        finally:
            del llm.engine.step  # the watcher's wrapper: back to the class's method
        ended = time.monotonic()
        limit = patience(5)
        while holdings(llm) and time.monotonic() - ended < limit:
            time.sleep(0.005)
        idle_after = time.monotonic() - ended
        held = holdings(llm)
        assert not held, f"{held} after {limit:.1f} s"
    llm.abort = real_abort  # type: ignore[method-assign]
    loads = {t.name: t.loaded - loads_before.get(t.name, 0) for t in llm.engine.stats().tiers}
    mismatches = [i for i in stay if not clients[i].done or clients[i].text != expected[i]]
    return StormResult(clients, states, ended - start, idle_after, loads, mismatches)
