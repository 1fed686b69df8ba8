"""How long the OpenMP thread team spins before it sleeps (torch's libgomp, which the native
kernels share). No torch import here: libgomp reads its settings from the environment once,
when torch loads it, so the package applies them on import, before it imports torch; child
processes (replicas, ranks) inherit them and import the package first too.

Why: by default a libgomp thread that waits, at a barrier or for the next parallel region,
spins 300,000 rounds (about 3 ms here) before it sleeps. The native decode step crosses ~270
barriers a token. When another busy process wants one of the cores, the team member the OS
descheduled waits for its turn while its partner spins on the other core instead of handing
it over: a decode step took 7-15x longer (median, p90) beside one busy process, a 32-token
request 36-66 s instead of 2 s. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) fixes that but
makes every barrier a futex wake-up: idle decode steps 1.56x slower. A short spin keeps both:
idle steps as fast as before, and beside one busy process 2.3x an idle step instead of 7x
(docs/performance.md, "Sharing the cores").
"""

from __future__ import annotations

import os

SPIN_COUNT = "2000"
"""Rounds a waiting thread spins before it sleeps (a `pause` each: ~20 us here)."""
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""The variables that set how libgomp's threads wait: one set by the user wins over ours."""


def use_short_spin() -> None:
    """Set GOMP_SPINCOUNT to SPIN_COUNT, unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT. Takes effect only in a process where torch (libgomp) is not loaded yet."""
    if not any(knob in os.environ for knob in USER_KNOBS):
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
