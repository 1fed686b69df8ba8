"""Checks shared by the parallelism tests: processes gone, no children left, config errors;
the parallel layouts a MoE model is run under."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pypto_serving.errors import PyptoError

MOE_PARALLEL: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "enable_expert_parallel": True,
    },
}
"""TP, PP and TP x PP knobs for a mixture-of-experts model (its experts over the TP ranks)."""


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def config_error(knobs: dict[str, Any]) -> str:
    """The PyptoError message building an engine config from `knobs` raises (it must)."""
    from pypto_serving.config import engine_config

    with pytest.raises(PyptoError) as e:
        engine_config(**knobs)
    return str(e.value)
