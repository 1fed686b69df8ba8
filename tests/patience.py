"""Time limits for tests, made to hold on a loaded machine (issue 23, item 17).

A test asserts correctness, not speed: its time limits only tell a hang, or a promise missed
by far ("a lost request ends within 5 s"), from a machine that is slow because other processes
want its cores. Each limit is written as it holds on an idle machine and passed through
`patience()`, which stretches it by how loaded the machine is; waits poll for their condition
(`wait_for`) rather than sleep a fixed time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SCALE_ENV = "PYPTO_TEST_TIME_SCALE"
"""An extra factor for every limit (default 1), for machines slower than load shows."""


def load_per_core() -> float:
    """Runnable work per core this process may use: the larger of the 1-minute load average
    and the threads runnable right now (less this one), over the cores."""
    try:
        with open("/proc/loadavg") as f:
            now = int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        now = 0
    return max(os.getloadavg()[0], now) / len(os.sched_getaffinity(0))


_stretch = 1.0


def patience(seconds: float) -> float:
    """`seconds`, a limit that holds on an idle machine, stretched for this one: times the
    highest load per core seen so far in this process (at least 1; never less, so a limit
    taken later is never shorter than one taken before) and $PYPTO_TEST_TIME_SCALE."""
    global _stretch
    _stretch = max(_stretch, load_per_core())
    return seconds * _stretch * float(os.environ.get(SCALE_ENV, "1"))


def wait_for(condition: Callable[[], object], seconds: float, what: str) -> float:
    """Poll until `condition()` holds, within `patience(seconds)`; returns when it did."""
    limit = patience(seconds)
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit:.0f} s: {what}")
        time.sleep(0.02)
    return time.monotonic()
