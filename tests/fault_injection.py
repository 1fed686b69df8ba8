"""Test-side switches for the fault hooks of tests/fault_hooks (pypto_faults there): a fault
reaches the rank and replica processes a test starts through the environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fault_hooks.pypto_faults import (
    FAIL_RANK_START,
    FAIL_REPLICA_START,
    HANG_RANK_START,
    HANG_REPLICA_START,
    SLOW_REPLICA_LAYERS,
)

__all__ = [
    "FAIL_RANK_START",
    "FAIL_REPLICA_START",
    "HANG_RANK_START",
    "HANG_REPLICA_START",
    "SLOW_REPLICA_LAYERS",
    "fault_env",
    "inject",
]

HOOKS = Path(__file__).parent / "fault_hooks"


def inject(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    """The fault for processes this test starts: the variable, and the hooks on PYTHONPATH."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("PYTHONPATH", str(HOOKS), prepend=os.pathsep)


def fault_env(variable: str, value: str) -> dict[str, str]:
    """The same for a subprocess: the entries to add to its environment."""
    path = [str(HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {variable: value, "PYTHONPATH": os.pathsep.join(path)}
