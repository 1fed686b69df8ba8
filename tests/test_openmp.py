"""OpenMP's threads spin only briefly before they sleep (issue 23, item 16): the package sets
GOMP_SPINCOUNT before torch loads libgomp, in the engine's process and in its child processes,
unless the user set how threads wait. Checked on libgomp itself: OMP_DISPLAY_ENV=VERBOSE makes
it print the settings it adopted as it loads (its default spin count, 300000, is the spinning
that made decode steps 7-15x slower beside a busy process, docs/performance.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from patience import patience

from pypto_serving.engine.process import ChildProcess
from pypto_serving.openmp import SPIN_COUNT, USER_KNOBS


def adopted(text: str) -> dict[str, str]:
    """libgomp's settings as OMP_DISPLAY_ENV printed them (`  NAME = 'value'` lines)."""
    return dict(re.findall(r"^\s+(\w+) = '([^']*)'", text, re.MULTILINE))


def import_package(env: dict[str, str]) -> dict[str, str]:
    """What libgomp adopted in a fresh interpreter that imports the package with `env`."""
    base = {k: v for k, v in os.environ.items() if k not in USER_KNOBS}
    proc = subprocess.run(
        [sys.executable, "-c", "import pypto_serving"],
        env=base | {"OMP_DISPLAY_ENV": "VERBOSE"} | env,
        capture_output=True,
        text=True,
        timeout=patience(300),  # a hang only: the imports take seconds
        check=True,
    )
    return adopted(proc.stderr)


def test_importing_the_package_shortens_openmp_spin_waits():
    assert import_package({})["GOMP_SPINCOUNT"] == SPIN_COUNT != "300000"


@pytest.mark.parametrize(
    ("env", "spincount"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "0"),
        ({"GOMP_SPINCOUNT": "1234"}, "1234"),
    ],
)
def test_the_users_own_wait_setting_wins(env, spincount):
    assert import_package(env)["GOMP_SPINCOUNT"] == spincount


def report_spin_count(spec: None, conn: Connection) -> None:
    """A child's entry: send back the spin count it runs with."""
    conn.send(os.environ.get("GOMP_SPINCOUNT"))


def test_engine_child_processes_shorten_their_spin_waits(monkeypatch, capfd):
    # the child must set it itself (as a replica or rank does: it imports the package
    # first), not only inherit this process's
    for knob in USER_KNOBS:
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    child = ChildProcess(report_spin_count, None)
    try:
        assert child.conn.recv() == SPIN_COUNT
    finally:
        child.stop()
    got = adopted(capfd.readouterr().err)  # the child's stderr is this process's
    assert got["GOMP_SPINCOUNT"] == SPIN_COUNT
