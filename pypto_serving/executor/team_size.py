"""How many threads a native decode step runs with, measured rather than assumed.

A step of a few decodes crosses ~270 barriers of its thread team. When another process keeps
one of the team's cores busy, the thread that shares it is descheduled for whole time
slices, and every barrier waits for it: beside one busy process a team of 2 on 2 cores
decoded SmolLM2 at 33-35 tok/s, a team of 1 at 63 (bf16, AVX2 build; 83-86 for 2 on a quiet
machine). So the team size is chosen by timing: every PROBE_EVERY steps a window of WINDOW
steps runs with one thread fewer (or, below the full team, one more), and the size whose
median step time is lower by MARGIN is kept. On a quiet machine a probe costs a few slower
steps (~1 % of the time); under contention the team shrinks within a probe, and grows back
once the other process is gone.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 8
"""Steps timed per team size before comparing."""
PROBE_EVERY = 128
"""Steps between probes of another team size."""
MARGIN = 0.93
"""A size is taken when its median step time is below this fraction of the current one's."""


class TeamSize:
    """The thread count for the next step (`threads`) and what the steps took (`record`).
    Steps are compared only with steps of the same row count."""

    def __init__(self, max_threads: int) -> None:
        self.max = max(1, max_threads)
        self.current = self.max
        self.probe: int | None = None
        self.probe_start = 0
        self.steps = 0
        self.grow = False  # the direction of the next probe
        self.times: dict[tuple[int, int], deque[float]] = {}

    def threads(self) -> int:
        """The team size the next step runs with."""
        if self.probe is None and self.steps % PROBE_EVERY == PROBE_EVERY - 1:
            target = self.current + 1 if self.grow else self.current - 1
            if not 1 <= target <= self.max:
                target = self.current - 1 if self.grow else self.current + 1
            self.grow = not self.grow
            if 1 <= target <= self.max and target != self.current:
                self.probe, self.probe_start = target, self.steps
                for key in [k for k in self.times if k[1] == target]:
                    del self.times[key]  # fresh samples only
        return self.current if self.probe is None else self.probe

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A step of `rows` rows ran with `threads` threads in `seconds`."""
        self.steps += 1
        self.times.setdefault((rows, threads), deque(maxlen=WINDOW)).append(seconds)
        if self.probe is None or threads != self.probe:
            return
        probed = self.times[(rows, threads)]
        if len(probed) < WINDOW:
            if self.steps - self.probe_start > 4 * WINDOW:  # the rows kept changing: give up
                self.probe = None
            return
        base = self.times.get((rows, self.current))
        if base and statistics.median(probed) < MARGIN * statistics.median(base):
            self.current = self.probe
        self.probe = None
