"""A pytest plugin loaded into vLLM's own test run by `scripts/vllm_client_tests.py`.

It runs inside vLLM's interpreter (vLLM's tests import vLLM), never inside ours:

- vLLM's server fixture (`tests.utils.RemoteOpenAIServer`) starts `pypto serve` instead of
  `vllm serve`, with the test's vLLM flags passed through unchanged and the test's model name
  served by `--served-model-name`; nothing is downloaded before it starts;
- only client tests are kept: those whose test or fixtures start that server; the rest test
  vLLM's own Python classes and are left out (counted);
- tests listed in the run's skip table (a JSON file: node-id pattern -> reason) are skipped
  with their reason;
- every test's outcome, and for a failure the exception's first line, go to a JSON file.

The settings come from the environment the driver sets: PYPTO_HARNESS_SERVE (the command
that starts our server, shell-quoted), PYPTO_HARNESS_MODEL (our model; empty for the default),
PYPTO_HARNESS_SKIPS and PYPTO_HARNESS_RESULTS (file paths).
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

SERVER_CLASSES = ("RemoteOpenAIServer",)
results: dict[str, dict[str, str]] = {}
server_log = ""
left_out: list[str] = []


LORA_FLAGS = {"--enable-lora": 0, "--lora-modules": 1, "--max-lora-rank": 1, "--max-cpu-loras": 1}
"""vLLM's LoRA flags and how many values follow each: left out of our command line (LoRA is
not served here; the tests that name an adapter are in the skip table)."""


def without_lora(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        name = args[i].partition("=")[0]
        if name in LORA_FLAGS:
            i += 1 + (LORA_FLAGS[name] if "=" not in args[i] else 0)
        else:
            out.append(args[i])
            i += 1
    return out


def serve_command(model: str, vllm_args: list[str]) -> list[str]:
    """`pypto serve` for a test that asked vLLM to serve `model` with `vllm_args` (less its
    LoRA flags)."""
    vllm_args = without_lora(vllm_args)
    command = shlex.split(os.environ["PYPTO_HARNESS_SERVE"])
    ours = os.environ.get("PYPTO_HARNESS_MODEL", "")
    if ours:
        command += ["--model", ours]
    if "--served-model-name" not in vllm_args:
        command += ["--served-model-name", model]
    return [*command, *vllm_args]


def start_pypto(self: Any, model: str, vllm_args: list[str], env: dict[str, str] | None) -> None:
    global server_log
    environ = os.environ | (env or {})
    command = serve_command(model, vllm_args)
    fd, server_log = tempfile.mkstemp(prefix="pypto-serve-", suffix=".log")
    print("harness: starting", shlex.join(command), "; its log:", server_log, flush=True)
    self.proc = subprocess.Popen(
        command, env=environ, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True
    )
    os.close(fd)


def last_words() -> str:
    """The last line the latest server wrote (why it exited, when it did)."""
    if not server_log:
        return ""
    lines = [line for line in Path(server_log).read_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def pytest_configure(config: pytest.Config) -> None:
    from tests import utils

    for name in SERVER_CLASSES:
        cls = getattr(utils, name)
        cls._start_server = start_pypto
    # Our server reads its model itself; vLLM's pre-download would go to the hub.
    utils.RemoteVLLMServer._pre_download_model = lambda self, model, args: None
    # A LoRA adapter's files would come from the hub, for flags our command line leaves out.
    from huggingface_hub import HfApi

    download = HfApi.snapshot_download

    def no_adapter(self: HfApi, repo_id: str, *args: Any, **kwargs: Any) -> str:
        if "lora" in repo_id.lower():
            return tempfile.mkdtemp(prefix="no-lora-")
        return download(self, repo_id, *args, **kwargs)

    HfApi.snapshot_download = no_adapter  # type: ignore[method-assign]


def source_of(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def starts_a_server(item: pytest.Item) -> bool:
    """Whether the test, or a fixture it uses (directly, through others, or by name with
    request.getfixturevalue in a module that starts one), starts vLLM's server: the test
    is a client test."""
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        funcs += [d.func for defs in info.name2fixturedefs.values() for d in defs]
    sources = [source_of(f) for f in funcs if f is not None]
    if any(name in text for text in sources for name in SERVER_CLASSES):
        return True
    module = source_of(getattr(item, "module", None))
    by_name = any("getfixturevalue" in text for text in sources)
    return by_name and any(name in module for name in SERVER_CLASSES)


def skip_table() -> dict[str, str]:
    path = os.environ.get("PYPTO_HARNESS_SKIPS", "")
    return json.loads(open(path).read()) if path else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = skip_table()
    kept = []
    for item in items:
        if not starts_a_server(item):
            left_out.append(item.nodeid)
            continue
        kept.append(item)
        for pattern, reason in skips.items():
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                item.add_marker(pytest.mark.skip(reason=reason))
                break
    items[:] = kept


def first_line(report: pytest.TestReport | pytest.CollectReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[0][:300] if lines else ""
    return f"{line} ({last_words()[:300]})" if "Server exited unexpectedly" in line else line


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "passed" and report.when != "call":
        return
    if report.nodeid in results and results[report.nodeid]["outcome"] != "passed":
        return  # the first failure of a test (setup, call, teardown) is its outcome
    entry = {"outcome": report.outcome, "when": report.when}
    if report.outcome == "skipped":
        longrepr = report.longrepr
        entry["reason"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    elif report.outcome == "failed":
        entry["reason"] = first_line(report)
    results[report.nodeid] = entry


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.outcome == "failed":
        results[report.nodeid] = {
            "outcome": "collect-error",
            "when": "collect",
            "reason": first_line(report),
        }


def pytest_sessionfinish(session: pytest.Session) -> None:
    with open(os.environ["PYPTO_HARNESS_RESULTS"], "w") as out:
        json.dump({"tests": results, "left_out": left_out}, out, indent=1)
