"""requirements.lock pins every dependency: the runtime, test, bench and remote sets, transitive
ones included, each with `==`; and what is installed here is what it pins (the README's
commands install from it)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parent.parent / "requirements.lock"
EXTRAS = ("test", "bench", "remote")
UNPINNED = {"pip", "setuptools", "wheel"}
"""The installer's own tools: not dependencies of the package."""


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.+!-]+", version), f"not a pin: {line!r}"
            found[canonicalize_name(name)] = version
    return found


def closure() -> set[str]:
    """pypto-serving's requirements with EXTRAS, and theirs, as installed here."""
    todo = [Requirement(f"pypto-serving[{','.join(EXTRAS)}]")]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.requires(req.name) or []:
            dep = Requirement(text)
            extras = req.extras or {""}
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return seen - {"pypto-serving"}


def test_the_lock_pins_every_dependency_and_the_install_matches_it():
    locked = pins()
    missing = sorted(closure() - locked.keys() - UNPINNED)
    assert not missing, f"not in requirements.lock (run bash scripts/lock.sh): {missing}"
    for name in sorted(closure() - UNPINNED):
        assert metadata.version(name) == locked[name], name
