"""Test-only fault injection for rank and replica processes; pypto_serving never reads these.

Rank and replica processes are fresh interpreters, so the faults travel as environment
variables and this folder on PYTHONPATH (its `sitecustomize` calls `install`). When a
variable is set, the entry function of ranks (or replicas) is wrapped as its module is
imported; in the rank or replica the variable names, the wrapper swaps a function the entry
calls inside its start-up `try`, so the fault reaches the parent just as a real one would: a
`StartFailed` naming the process, or silence until `startup_timeout_s`.

Only modules that site has already loaded are imported here: every process with this folder
on PYTHONPATH pays for it.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any, NoReturn

FAIL_RANK_START = "PYPTO_FAIL_RANK_START"
"""Rank r raises before the rendezvous (as it plans its run): it fails to start."""
HANG_RANK_START = "PYPTO_HANG_RANK_START"
"""Rank r waits forever after joining the group, before loading its share."""
FAIL_REPLICA_START = "PYPTO_FAIL_REPLICA_START"
"""Replica i raises as it builds its engine: it fails to start."""
HANG_REPLICA_START = "PYPTO_HANG_REPLICA_START"
"""Replica i waits forever instead of building its engine."""
SLOW_REPLICA_LAYERS = "PYPTO_SLOW_REPLICA_LAYERS"
""""i:seconds" ("*:seconds": every replica): each layer's attention sleeps that long first,
so steps are long but make progress."""
VARIABLES = (
    FAIL_RANK_START,
    HANG_RANK_START,
    FAIL_REPLICA_START,
    HANG_REPLICA_START,
    SLOW_REPLICA_LAYERS,
)


def install() -> None:
    """Patch the rank and replica modules as they are imported, if a fault is set."""
    if any(os.environ.get(v) for v in VARIABLES):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport:
    """A meta-path finder: finds the modules in `_PATCHES` as usual, patches them once run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def run_and_patch(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = run_and_patch  # this spec's own loader
        return spec


def _patch_ranks(ranks: ModuleType) -> None:
    """worker_main (a rank > 0) is looked up by name in the child: wrap it there."""
    worker_main = ranks.worker_main

    @functools.wraps(worker_main)  # same name: the parent names it to start the child
    def faulty_worker_main(spec: Any, conn: Any) -> None:
        rank = str(spec.rank)
        if os.environ.get(FAIL_RANK_START) == rank:
            ranks.plan_run = _fail(FAIL_RANK_START, rank)
        if os.environ.get(HANG_RANK_START) == rank:
            ranks.load_share = _hang
        worker_main(spec, conn)

    ranks.worker_main = faulty_worker_main


def _patch_replicas(replica: ModuleType) -> None:
    """replica_main is looked up by name in the child: wrap it there."""
    replica_main = replica.replica_main

    @functools.wraps(replica_main)  # same name: the parent names it to start the child
    def faulty_replica_main(spec: Any, conn: Any) -> None:
        index = str(spec.index)
        if os.environ.get(FAIL_REPLICA_START) == index:
            replica.EngineCore = _fail(FAIL_REPLICA_START, index)
        if os.environ.get(HANG_REPLICA_START) == index:
            replica.EngineCore = _hang
        which, _, seconds = os.environ.get(SLOW_REPLICA_LAYERS, "").partition(":")
        if which in ("*", index):
            _slow_layers(float(seconds))
        replica_main(spec, conn)

    replica.replica_main = faulty_replica_main


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "pypto_serving.engine.ranks": _patch_ranks,
    "pypto_serving.engine.replica": _patch_replicas,
}


def _fail(variable: str, value: str) -> Callable[..., NoReturn]:
    def fail(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"injected start-up failure ({variable}={value})")

    return fail


def _hang(*args: Any, **kwargs: Any) -> None:
    threading.Event().wait()  # the parent's start-up limit ends this process


def _slow_layers(seconds: float) -> None:
    from pypto_serving.kv.paged_attention import StepAttention  # loaded by the replica already

    attend = StepAttention.attend

    def slow(self: StepAttention, *args: Any) -> Any:
        time.sleep(seconds)
        return attend(self, *args)

    StepAttention.attend = slow
