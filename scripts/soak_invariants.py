#!/usr/bin/env python
"""Soak the scheduler + paged KV store + CPU/SSD tiers state machine for many steps.

Runs tests/test_scheduler_invariants.py's SchedulerMachine (the real Scheduler over a real
KV (a manager over a pool) with CPU and SSD tiers, a fake executor, and the paged-engine and tier
invariants checked after every rule) under Hypothesis, one seed after another, until the
rule steps executed reach the target. A step is one rule run after the machine's setup
(add_requests, step, abort or run_to_completion); every example also drains at teardown.
Prints examples, steps, seconds and failures per seed and in total; exits 1 on any failure,
after printing the error and the failing example's steps (the machine's rule calls).

    python scripts/soak_invariants.py                            # 100,000 steps, 4 seeds
    python scripts/soak_invariants.py --steps 20000 --seed 7 42 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_scheduler_invariants import SchedulerMachine

BATCH_SEED_STRIDE = 2**32
"""Top-up batch b of seed s runs with Hypothesis seed s + b * BATCH_SEED_STRIDE."""
COUNTS = ("examples", "steps", "requests", "preemptions", "swaps", "prefix_hit_tokens")


@dataclass
class Tally:
    """What the machines of some examples executed, and what their schedulers saw."""

    examples: int = 0
    steps: int = 0
    requests: int = 0
    preemptions: int = 0
    swaps: int = 0
    prefix_hit_tokens: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    """Pages of arriving prompts found per KV tier (device, cpu, ssd)."""

    def add(self, other: Tally) -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for tier, hits in other.tier_hits.items():
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + hits


class CountingMachine(SchedulerMachine):
    """SchedulerMachine, counting its examples, its rule steps after setup and its events."""

    tally: ClassVar[Tally] = Tally()

    def __init__(self) -> None:
        super().__init__()
        self.set_up = False
        self.tally.examples += 1

    @invariant()
    def invariants(self) -> None:
        super().invariants()
        if self.set_up:  # the first check follows the setup rule
            self.tally.steps += 1
        self.set_up = True

    def teardown(self) -> None:
        super().teardown()
        scheduler, tally = self.h.scheduler, self.tally
        tally.requests += self.arrival
        tally.preemptions += scheduler.num_preemptions
        tally.swaps += scheduler.num_swapped
        tally.prefix_hit_tokens += scheduler.prefix_hits
        tally.add(Tally(tier_hits={name: s.hits for name, s in self.h.store.pool.stats.items()}))


@dataclass
class Batch:
    """One Hypothesis run: its seed and settings, what it executed, and its failure."""

    hypothesis_seed: int
    max_examples: int
    steps_per_example: int
    seconds: float = 0.0
    tally: Tally = field(default_factory=Tally)
    error: str | None = None
    failing_steps: str = ""
    """The failing example's rule calls, as Hypothesis replays it (the notes it adds to the
    error)."""


def run_batch(hseed: int, max_examples: int, steps_per_example: int) -> Batch:
    """Run the machine for `max_examples` examples under Hypothesis seed `hseed`."""
    batch = Batch(hseed, max_examples, steps_per_example)
    run_settings = settings(
        SchedulerMachine.TestCase.settings,
        max_examples=max_examples,
        stateful_step_count=steps_per_example,
        database=None,
        deadline=None,
        derandomize=False,
    )

    def machine() -> CountingMachine:
        return CountingMachine()

    CountingMachine.tally = batch.tally
    start = time.perf_counter()
    try:
        run_state_machine_as_test(hypothesis_seed(hseed)(machine), settings=run_settings)
    except Exception as e:
        notes = e.__dict__.pop("__notes__", [])
        batch.error = "".join(traceback.format_exception(e))
        batch.failing_steps = "\n".join(notes)
    batch.seconds = time.perf_counter() - start
    return batch


@dataclass
class SeedResult:
    seed: int
    batches: list[Batch] = field(default_factory=list)

    @property
    def tally(self) -> Tally:
        total = Tally()
        for b in self.batches:
            total.add(b.tally)
        return total

    @property
    def seconds(self) -> float:
        return sum(b.seconds for b in self.batches)

    @property
    def failures(self) -> int:
        return sum(b.error is not None for b in self.batches)

    def line(self) -> str:
        t = self.tally
        return (
            f"seed {self.seed}: {t.examples} examples, {t.steps} steps, {self.seconds:.1f} s, "
            f"{self.failures} failures ({t.requests} requests, {t.preemptions} preemptions, "
            f"{t.swaps} swaps, tier hits {t.tier_hits})"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            **asdict(self.tally),
            "seconds": round(self.seconds, 2),
            "failures": self.failures,
            "batches": [asdict(b) for b in self.batches],
        }


def soak_seed(s: int, quota: int, steps_per_example: int) -> SeedResult:
    """Run seed `s` until `quota` steps, topping up with derived seeds when examples end early."""
    result = SeedResult(s)
    per_example = max(steps_per_example - 1, 1)  # the setup rule is not a step
    while result.tally.steps < quota and not result.failures:
        hseed = s + len(result.batches) * BATCH_SEED_STRIDE
        missing = quota - result.tally.steps
        batch = run_batch(hseed, math.ceil(missing / per_example), steps_per_example)
        result.batches.append(batch)
        if batch.error is not None:
            print(
                f"seed {s} FAILED: Hypothesis seed {hseed}, max_examples {batch.max_examples}, "
                f"stateful_step_count {steps_per_example}\n{batch.error}"
                f"failing example's steps:\n{batch.failing_steps}",
                flush=True,
            )
        elif batch.tally.steps == 0:
            break
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="total rule steps to run")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=int, default=4, help="run seeds 0..N-1 (default 4)")
    seeds.add_argument("--seed", type=int, nargs="+", help="run these seeds instead")
    parser.add_argument(
        "--steps-per-example",
        type=int,
        default=100,
        help="Hypothesis stateful_step_count, setup included (default 100)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.steps, args.steps_per_example, len(args.seed or []) or args.seeds) < 1:
        parser.error("--steps, --seeds and --steps-per-example must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    seeds: list[int] = args.seed if args.seed is not None else list(range(args.seeds))
    quota = math.ceil(args.steps / len(seeds))
    start = time.perf_counter()
    results = []
    for s in seeds:
        results.append(soak_seed(s, quota, args.steps_per_example))
        print(results[-1].line(), flush=True)
    wall = time.perf_counter() - start
    total = Tally()
    for r in results:
        total.add(r.tally)
    failures = sum(r.failures for r in results)
    print(
        f"total: {len(seeds)} seeds, {total.examples} examples, {total.steps} steps, "
        f"{wall:.1f} s ({total.steps / wall:.0f} steps/s), {failures} failures",
        flush=True,
    )
    if args.json is not None:
        report = {
            "command": ["scripts/soak_invariants.py", *(sys.argv[1:] if argv is None else argv)],
            "target_steps": args.steps,
            "steps_per_example": args.steps_per_example,
            "seeds": [r.summary() for r in results],
            "total": {**asdict(total), "seconds": round(wall, 2), "failures": failures},
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
