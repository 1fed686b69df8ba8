"""scripts/soak_invariants.py at a small size: it runs, counts, and fails loudly."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import test_scheduler_invariants

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak_invariants.py"


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_invariants", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_soak_runs_the_machine_for_the_steps_asked(soak: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert soak.main(["--steps", "2000", "--seeds", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [s["seed"] for s in report["seeds"]] == [0, 1]
    assert all(s["steps"] >= 1000 and s["failures"] == 0 for s in report["seeds"])
    total = report["total"]
    assert total["steps"] == sum(s["steps"] for s in report["seeds"]) >= 2000
    assert total["examples"] >= 2000 // report["steps_per_example"]
    assert total["failures"] == 0 and total["requests"] > 0


def test_soak_is_deterministic_per_seed(soak: ModuleType) -> None:
    first, second = (soak.soak_seed(3, 300, 20).tally for _ in range(2))
    assert first == second and first.steps >= 300


def test_soak_fails_with_the_falsifying_example(
    soak: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = test_scheduler_invariants.check_invariants

    def planted(h: test_scheduler_invariants.Harness) -> None:
        real(h)
        assert not h.scheduler.requests, "planted failure"

    monkeypatch.setattr(test_scheduler_invariants, "check_invariants", planted)
    assert soak.main(["--steps", "200", "--seed", "5", "--steps-per-example", "10"]) == 1
    out = capsys.readouterr().out
    assert "seed 5 FAILED" in out and "planted failure" in out
    steps = out.partition("failing example's steps:\n")[2]
    assert "add_requests(" in steps  # the rule calls that fail: the machine's own names
    assert out.splitlines()[-1].endswith("1 failures")
