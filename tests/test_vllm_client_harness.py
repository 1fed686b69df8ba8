"""scripts/vllm_client_tests.py and its plugin, without vLLM: the command line a vLLM test's
server becomes, the report's sorting of outcomes (a named model's files, skips with their
reasons, failures) and its pass rate, and the skip table's shape."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_vllm_servers_flags_become_pypto_serves(monkeypatch):
    plugin = load("vllm_client_plugin")
    monkeypatch.setenv("PYPTO_HARNESS_SERVE", shlex.join([sys.executable, "-m", "x", "serve"]))
    monkeypatch.setenv("PYPTO_HARNESS_MODEL", "")
    args = ["--dtype", "bfloat16", "--enable-lora", "--lora-modules", "a=/x"]
    args += ["--max-lora-rank", "64", "--max-cpu-loras=2", "--port", "9"]
    command = plugin.serve_command("org/model-7b", args)
    assert command == [
        sys.executable, "-m", "x", "serve",
        "--served-model-name", "org/model-7b", "--dtype", "bfloat16", "--port", "9",
    ]  # fmt: skip
    monkeypatch.setenv("PYPTO_HARNESS_MODEL", "/models/tiny")
    named = plugin.serve_command("m", ["--served-model-name", "a", "b"])
    assert named[-5:] == ["--model", "/models/tiny", "--served-model-name", "a", "b"]


def test_the_report_sorts_outcomes_and_counts_the_rate(capsys):
    harness = load("vllm_client_tests")
    hub = "huggingface_hub.errors.LocalEntryNotFoundError: outgoing traffic has been disabled"
    found = {
        "tests": {
            "t.py::a": {"outcome": "passed", "when": "call"},
            "t.py::b": {"outcome": "passed", "when": "call"},
            "t.py::c": {"outcome": "passed", "when": "call"},
            "t.py::d": {"outcome": "failed", "when": "call", "reason": "AssertionError: 1 == 2"},
            "t.py::e": {"outcome": "failed", "when": "setup", "reason": hub},
            "t.py::f": {"outcome": "skipped", "when": "setup", "reason": "Skipped: LoRA"},
            "u.py": {"outcome": "collect-error", "when": "collect", "reason": "ImportError: x"},
        },
        "left_out": ["v.py::unit"],
    }
    assert harness.report(found) == 1  # a failure: exit 1
    out = capsys.readouterr().out
    assert "3 passed, 1 failed (75.0 % of the 4 that ran), 1 skipped" in out
    assert "1 need a named model's files, 1 modules not importable" in out
    assert "1 tests of vLLM's own Python classes left out" in out
    assert "- 1 × Skipped: LoRA\n    t.py::f" in out
    assert "- t.py::d\n    AssertionError: 1 == 2" in out
    found["tests"].pop("t.py::d")
    assert harness.report(found) == 0


def test_every_skip_names_its_reason():
    skips = json.loads((SCRIPTS / "vllm_client_skips.json").read_text())
    assert skips and all(isinstance(r, str) and len(r) > 20 for r in skips.values())
    nodeid = "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py"
    watermarked = f"{nodeid}::test_function_tool_use[watermarked-True-auto-True-Qwen/Qwen3-0.6B]"
    first = next(p for p in skips if fnmatch.fnmatchcase(watermarked, p))
    assert "watermark" in skips[first]  # the first pattern that matches is the reason
    forced = f"{nodeid}::test_function_tool_use[plain-False-required-False-Qwen/Qwen3-0.6B]"
    assert not any(fnmatch.fnmatchcase(forced, p) for p in skips)  # forced calls run


@pytest.mark.parametrize("args", [["/nonexistent"], ["/tmp", "--vllm-python", "/nonexistent"]])
def test_a_missing_checkout_or_interpreter_is_named(args, tmp_path, capsys):
    harness = load("vllm_client_tests")
    with pytest.raises(SystemExit) as e:
        harness.main(args)
    assert "not found (see --help)" in str(e.value)
