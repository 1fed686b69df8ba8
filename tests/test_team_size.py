"""The native decode step's team size (executor/team_size.py): timed, not assumed. Fake step
times stand for a quiet machine (the full team is faster), a busy one (one thread fewer is)
and a busy one that goes quiet again."""

from __future__ import annotations

from collections.abc import Callable

from pypto_serving.executor.team_size import PROBE_EVERY, WINDOW, TeamSize


def run(team: TeamSize, steps: int, cost: Callable[[int], float], rows: int = 1) -> list[int]:
    """`steps` steps whose time for a team of n is cost(n); the team size of each."""
    sizes = []
    for _ in range(steps):
        n = team.threads()
        sizes.append(n)
        team.record(rows, n, cost(n))
    return sizes


def quiet(n: int) -> float:
    return 10.0 / n**0.6  # more threads, faster


def busy(n: int) -> float:
    return 10.0 if n == 1 else 16.0  # the second thread waits for a shared core


def test_a_quiet_machine_keeps_the_full_team_and_probes_rarely():
    team = TeamSize(2)
    sizes = run(team, 10 * PROBE_EVERY, quiet)
    assert team.current == 2
    assert sizes.count(1) <= 10 * WINDOW  # a window of one thread per probe at most


def test_another_busy_process_shrinks_the_team_and_its_end_grows_it_back():
    team = TeamSize(2)
    run(team, PROBE_EVERY + WINDOW, busy)
    assert team.current == 1  # the first probe found one thread faster
    sizes = run(team, 4 * PROBE_EVERY, quiet)
    assert team.current == 2 and sizes[-1] == 2


def test_larger_teams_step_down_one_thread_at_a_time():
    team = TeamSize(4)
    run(team, 8 * PROBE_EVERY, lambda n: 10.0 if n == 2 else 10.0 + 4 * abs(n - 2))
    assert team.current == 2


def test_steps_of_other_row_counts_are_not_compared():
    team = TeamSize(2)
    run(team, PROBE_EVERY - 1, quiet, rows=1)
    # the probe's steps all have 3 rows, which no step of the full team had: nothing to beat
    run(team, 5 * WINDOW, lambda n: 1.0, rows=3)
    assert team.current == 2 and team.probe is None


def test_one_thread_is_one_thread():
    team = TeamSize(1)
    assert set(run(team, 3 * PROBE_EVERY, busy)) == {1}
