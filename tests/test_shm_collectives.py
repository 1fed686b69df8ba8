"""The shared-memory collectives of ranks on one machine (shm_collectives.py, native/shm.cpp):
the same bits as gloo's, chunked payloads, odd shapes; a rank that dies or never comes is
named within a time limit; an idle rank waiting for rank 0 sleeps rather than spins.

Each rank is a plain subprocess running tests/shm_ranks.py (see its modes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from patience import patience

from pypto_serving.native import compiler

pytestmark = pytest.mark.skipif(
    compiler() is None or not Path("/dev/shm").is_dir(), reason="needs g++ and /dev/shm"
)
SCRIPT = Path(__file__).with_name("shm_ranks.py")
ROOT = str(Path(__file__).parents[1])
ENV = os.environ | {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pypto-tp-*")}


def run_ranks(
    mode: str, world: int, tmp_path: Path, limit_s: float = 120, env: dict[str, str] | None = None
) -> list[list[list]]:
    """Every rank's JSON lines, rank 0's first; each rank must exit 0 within the limit."""
    store = tmp_path / "store"
    env = ENV | (env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), mode, str(r), str(world), str(store)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=patience(limit_s))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * world, outs
    return [[json.loads(line) for line in out.splitlines()] for out in outs]


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_gives_gloos_bits(tmp_path, world):
    before = segments()
    ranks = run_ranks("compare", world, tmp_path)
    for lines in ranks:
        assert lines[0] == ["transport", "shm"]
        assert len(lines) > 40
        failed = [line for line in lines[1:] if line[-1] is not True]
        assert failed == []
    assert segments() - before == set()  # unlinked as soon as every rank had it open


def test_gloo_when_asked(tmp_path):
    ranks = run_ranks("compare", 2, tmp_path, env={"PYPTO_TP_COLLECTIVES": "gloo"})
    assert all(lines[0] == ["transport", "gloo"] for lines in ranks)
    assert all(line[-1] is True for lines in ranks for line in lines[1:])


def test_a_rank_that_dies_is_named_at_once(tmp_path):
    rank0, _ = run_ranks("die", 2, tmp_path)
    _, message, seconds = rank0[-1]
    assert message == "shared-memory all_reduce: rank 1 is gone (its process exited)"
    assert seconds < patience(5)  # not the 300 s collective timeout


def test_a_rank_that_never_comes_times_out(tmp_path):
    store = tmp_path / "store"
    late = subprocess.Popen(
        [sys.executable, str(SCRIPT), "late", "1", "2", str(store)],
        stdout=subprocess.DEVNULL,
        env=ENV,
    )
    try:
        rank0 = subprocess.run(
            [sys.executable, str(SCRIPT), "late", "0", "2", str(store)],
            capture_output=True,
            text=True,
            timeout=patience(120),
            env=ENV,
        )
    finally:
        late.kill()
        late.wait()
    _, message, seconds = json.loads(rank0.stdout.splitlines()[-1])
    assert message == "shared-memory all_reduce: rank 1 did not arrive within 1 s"
    assert 1.0 <= seconds < patience(5)


def test_an_idle_rank_sleeps(tmp_path):
    _, rank1 = run_ranks("idle", 2, tmp_path)
    ((_, cpu_s),) = [line for line in rank1 if line[0] == "cpu_s"]
    assert cpu_s < 0.5  # 3 s of waiting: spinning would use about 3 s
