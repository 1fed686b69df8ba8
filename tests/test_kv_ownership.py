"""Who owns what in the KV (issue 43, docs/architecture.md's ownership table), held as tests:

- the physical pool (`kv/pool.py` and every module it imports) imports nothing of requests,
  the scheduler, the kinds or their managers, and keeps no per-request state: after requests
  ran, were swapped and resumed, no request id is anywhere in it;
- only the kinds' managers (`kv/manager.py`) call the pool's `allocate` and `free`, by the
  code's text and by what runs;
- nothing but `kv/` and the kind files builds a page table.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

from checkpoints import fake_kv_store

import pypto_serving
from pypto_serving.config import SchedulerConfig
from pypto_serving.kv.pool import KVPool
from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams
from pypto_serving.scheduler import Scheduler

PACKAGE = Path(pypto_serving.__file__).parent
FORBIDDEN = ("pypto_serving.request", "pypto_serving.scheduler", "pypto_serving.kv.kinds")
FORBIDDEN += ("pypto_serving.kv.manager", "pypto_serving.kv.groups", "pypto_serving.engine")


def imports(module: str) -> set[str]:
    """The pypto_serving modules `module` imports (at any depth of its own file)."""
    path = PACKAGE / (module.removeprefix("pypto_serving.").replace(".", "/") + ".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {n if (PACKAGE / _file(n)).exists() else node.module for n in names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("pypto_serving.") and m != "pypto_serving"}


def _file(module: str) -> str:
    return module.removeprefix("pypto_serving.").replace(".", "/") + ".py"


def test_the_pool_and_what_it_imports_know_no_requests_scheduler_or_kinds() -> None:
    seen, todo = set(), ["pypto_serving.kv.pool"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [m for m in imports(module) if (PACKAGE / _file(m)).exists()]
    assert "pypto_serving.kv.page_pool" in seen and "pypto_serving.kv.disk_tier" in seen
    bad = sorted(m for m in seen if m.startswith(FORBIDDEN))
    assert bad == [], f"the pool reaches {bad}"


def run_requests(store: Any) -> list[Request]:
    """The real scheduler over `store`: 6 requests, sharing prefixes, on too few pages for
    all of them at once (preemption, swaps, prefix hits), run to the end."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), store)
    requests = [
        Request(f"request-{i}", [7] * 8 + list(range(i, i + 5 + i % 3)), params, arrival=i)
        for i in range(6)
    ]
    for r in requests:
        scheduler.add(r)
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        for s in out.scheduled:
            store.cache_full_pages(s.request, s.request.num_computed_tokens + s.num_new_tokens)
        done = [
            s
            for s in out.scheduled
            if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens
        ]
        scheduler.update(out, {s.request.request_id: [_token(s.request)] for s in done})
    assert not scheduler.has_unfinished()
    return requests


def _token(request: Request) -> Any:
    from pypto_serving.ops.sampler import Sampled

    return Sampled(1 + len(request.output_token_ids), 0.0, None)


def strings_in(value: Any, depth: int = 0) -> set[str]:
    """Every string reachable from `value` through containers and objects' attributes."""
    if depth > 6:
        return set()
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple | set | frozenset):
        items = list(value)
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("pypto_serving"):
        items = list(vars(value).values())
    elif hasattr(value, "__slots__") and type(value).__module__.startswith("pypto_serving"):
        items = [getattr(value, s, None) for s in value.__slots__]
    else:
        return set()
    return set().union(*(strings_in(v, depth + 1) for v in items)) if items else set()


def test_the_pool_keeps_no_per_request_state_after_swaps(monkeypatch: Any) -> None:
    store = fake_kv_store(5, 4, cpu_pages=16)
    store.pool.costs.recompute_s_per_token = 1.0  # swapping always pays: it happens
    callers: list[str] = []
    for name in ("allocate", "free", "acquire"):
        original = getattr(KVPool, name)

        def spy(self: KVPool, *args: Any, _original: Any = original) -> Any:
            callers.append(inspect.stack()[1].filename)
            return _original(self, *args)

        monkeypatch.setattr(KVPool, name, spy)
    requests = run_requests(store)
    assert store.pool.num_swap_ins > 0, "the run should have swapped"
    ids = {r.request_id for r in requests}
    assert not ids & strings_in(store.pool), "the pool holds a request id"
    assert {Path(f).relative_to(PACKAGE).as_posix() for f in callers} == {"kv/manager.py"}


def test_only_the_managers_call_the_pools_allocate_and_free_by_the_code() -> None:
    calls: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("allocate", "free", "acquire")
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in ("pool", "device")
            ):
                where = path.relative_to(PACKAGE).as_posix()
                calls.setdefault(where, []).append(f"{node.func.value.attr}.{node.func.attr}")
    assert set(calls) == {"kv/manager.py", "kv/pool.py"}, calls
    assert set(calls["kv/pool.py"]) <= {"device.allocate", "device.free", "device.acquire"}
    assert set(calls["kv/manager.py"]) <= {"pool.allocate", "pool.free", "pool.acquire"}
