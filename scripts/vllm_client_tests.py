"""Run vLLM's own OpenAI-server client tests against `pypto serve`, and count what passes.

    python scripts/vllm_client_tests.py VLLM_SRC [--vllm-python PY] [--model MODEL]
        [--skips scripts/vllm_client_skips.json] [--json out.json] [PYTEST_ARGS...]

PYTEST_ARGS go to vLLM's pytest (`-k`, `-x`, or paths under tests/ to run instead of the
two suites).

VLLM_SRC is a checkout of vLLM's repository at the version installed in PY (a `git clone`
at the release's tag, or its source archive from PyPI unpacked: `pip download --no-binary
:all: --no-deps vllm==X`, which also holds the tests). Whoever runs this fetches it; nothing
of vLLM's is part of this project. PY is an interpreter where `vllm` imports along with
the test needs of vLLM's `requirements/test/cpu.txt` (pytest, pytest-asyncio, pytest-timeout,
schemathesis, lm-eval, tblib); `../shared/peers/install_vllm_cpu.sh` makes one in
~/.cache/peers/vllm, the default.

vLLM's pytest runs `tests/entrypoints/openai` and `tests/tool_use` with
`scripts/vllm_client_plugin.py` loaded: its server fixture starts `pypto serve` (this
interpreter's, on the default model unless `--model`) under the test's model name with the
test's flags; only client tests run (the rest test vLLM's Python classes). The hub is off
(`HF_HUB_OFFLINE=1`): a test that needs a named model's files fails on that, and is listed
under its own heading rather than counted as ours. The skip table names the tests that
assert what one of vLLM's models answers, or exercise a feature out of scope here, each
with its reason.

Prints passes, failures (with the exception's first line) and skips (with their reasons),
and the pass rate over the tests that ran; exits 1 when a test failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITES = ("tests/entrypoints/openai", "tests/tool_use")
HUB = "needs a named model's files from the hub"
HUB_MARKERS = (
    "huggingface.co",
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "outgoing traffic has been disabled",
    "Cannot find the requested files in the disk cache",
    "validation error for ModelConfig",  # vLLM's ModelConfig reads the named model's config
)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm_src", type=Path, help="a checkout of vLLM's repository")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path.home() / ".cache/peers/vllm/bin/python",
        help="an interpreter where vllm and its test needs import",
    )
    parser.add_argument("--model", default="", help="our model (default: the embedded one)")
    parser.add_argument("--skips", type=Path, default=HERE / "vllm_client_skips.json")
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    return parser.parse_known_args(argv)


def needs_the_hub(entry: dict[str, str]) -> bool:
    return any(marker in entry.get("reason", "") for marker in HUB_MARKERS)


def test_tree(src: Path, into: Path) -> Path:
    """vLLM's tests, the examples they read and pytest's settings, without the source of
    the `vllm` package: pytest puts the tree's root first on sys.path, and the installed
    vLLM (with its compiled parts) must be the one imported."""
    work = into / "vllm"
    for name in ("tests", "examples"):
        shutil.copytree(src / name, work / name, symlinks=True)
    shutil.copy(src / "pyproject.toml", work)
    return work


def run_pytest(args: argparse.Namespace, extra: list[str], tmp: Path, results: Path) -> int:
    for path in (args.vllm_src / "tests/utils.py", args.vllm_python):
        if not path.exists():
            sys.exit(f"vllm_client_tests: {path} not found (see --help)")
    work = test_tree(args.vllm_src, tmp)
    serve = [sys.executable, "-m", "pypto_serving.cli", "serve"]
    env = os.environ | {
        "PYPTO_HARNESS_SERVE": shlex.join(serve),
        "PYPTO_HARNESS_MODEL": args.model,
        "PYPTO_HARNESS_SKIPS": str(args.skips) if args.skips.exists() else "",
        "PYPTO_HARNESS_RESULTS": str(results),
        "PYTHONPATH": str(HERE),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [
        str(args.vllm_python),
        "-m",
        "pytest",
        "-p",
        "vllm_client_plugin",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-q",
        "-rN",
        *([] if any(a.startswith("tests/") for a in extra) else SUITES),
        *extra,
    ]
    return subprocess.call(command, cwd=work, env=env)


def report(found: dict[str, object]) -> int:
    tests: dict[str, dict[str, str]] = found["tests"]  # type: ignore[assignment]
    left_out: list[str] = found["left_out"]  # type: ignore[assignment]
    groups: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for nodeid, entry in sorted(tests.items()):
        outcome = entry["outcome"]
        if outcome in ("failed", "collect-error") and needs_the_hub(entry):
            outcome = HUB
        groups[outcome].append((nodeid, entry.get("reason", "")))
    for outcome in ("collect-error", HUB, "skipped"):
        by_reason = collections.defaultdict(list)
        for nodeid, reason in groups[outcome]:
            by_reason[reason].append(nodeid)
        if by_reason:
            print(f"\n## {outcome} ({len(groups[outcome])})")
        for reason, nodeids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            print(f"- {len(nodeids)} × {reason}")
            for nodeid in nodeids:
                print(f"    {nodeid}")
    if groups["failed"]:
        print(f"\n## failed ({len(groups['failed'])})")
        for nodeid, reason in groups["failed"]:
            print(f"- {nodeid}\n    {reason}")
    passed, failed = len(groups["passed"]), len(groups["failed"])
    ran = passed + failed
    rate = f"{100 * passed / ran:.1f} %" if ran else "n/a"
    print(
        f"\nvLLM client tests against pypto serve: {passed} passed, {failed} failed "
        f"({rate} of the {ran} that ran), {len(groups['skipped'])} skipped, "
        f"{len(groups[HUB])} need a named model's files, "
        f"{len(groups['collect-error'])} modules not importable; "
        f"{len(left_out)} tests of vLLM's own Python classes left out"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        run_pytest(args, extra, Path(tmp), results)
        if not results.exists():
            print("vllm_client_tests: pytest wrote no results", file=sys.stderr)
            return 2
        found = json.loads(results.read_text())
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return report(found)


if __name__ == "__main__":
    sys.exit(main())
