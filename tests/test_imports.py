"""Imports flow one way: cli → server / bench / chat → engine → ... → models → kv → ops
(docs/architecture.md).

Read from the source with `ast` (lazy imports inside functions count too), so a circle cannot
hide behind an import placed in a function body.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pypto_serving

PACKAGE = Path(pypto_serving.__file__).parent
FRONT = ("server", "bench", "chat")
"""The front ends: only cli.py imports them, and they do not import one another."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every pypto_serving module `path` imports, absolute or relative, at any depth."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]  # a relative import starts from the module's package
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] == "pypto_serving"}


def top(module: str) -> str:
    """The package part a module belongs to: `bench`, `chat`, `cli`, `engine`, ..."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def graph() -> dict[str, set[str]]:
    return {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_graph_sees_the_package():
    edges = graph()
    assert "pypto_serving.cli" in edges and "pypto_serving.bench.serve" in edges
    assert "pypto_serving.config" in edges["pypto_serving.cli"]


def test_nothing_imports_the_cli():
    offenders = [
        m
        for m, names in graph().items()
        if m != "pypto_serving.cli" and any(top(n) == "cli" for n in names)
    ]
    assert offenders == []


def test_front_ends_do_not_import_one_another():
    offenders = [
        (m, n)
        for m, names in graph().items()
        for n in names
        if top(m) in FRONT and top(n) in FRONT and top(n) != top(m)
    ]
    assert offenders == []


def test_layers_below_the_front_do_not_import_it():
    offenders = [
        (m, n)
        for m, names in graph().items()
        for n in names
        if top(m) not in (*FRONT, "cli", "") and top(n) in FRONT
    ]
    assert offenders == []


def test_models_call_kv_and_kv_calls_ops_never_upward():
    """models → kv → ops: the model code calls its attention kind (`kv/kinds/`), so nothing
    in kv imports models, and nothing in ops imports kv or models."""
    order = {"ops": 0, "kv": 1, "models": 2}
    offenders = [
        (m, n)
        for m, names in graph().items()
        for n in names
        if top(m) in order and top(n) in order and order[top(n)] > order[top(m)]
    ]
    assert offenders == []


def test_the_executor_takes_the_plan_and_never_imports_the_engine():
    """engine → executor: the run plan (engine/plan.py) decides, once, and passes its answers
    down; nothing under executor/, models/, kv/ or ops/ imports the engine."""
    below = ("executor", "models", "kv", "ops")
    offenders = [
        (m, n)
        for m, names in graph().items()
        for n in names
        if top(m) in below and top(n) == "engine"
    ]
    assert offenders == []


def test_no_fault_injection_switch_in_the_package():
    """Fault injection is a test-only hook (tests/fault_hooks): the server reads no switch."""
    switches = ("PYPTO_FAIL_", "PYPTO_HANG_", "PYPTO_SLOW_")
    files = [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    found = [
        f"{p.relative_to(PACKAGE.parent)}: {s}"
        for p in files
        for s in switches
        if s in p.read_text(errors="replace")
    ]
    assert found == []
