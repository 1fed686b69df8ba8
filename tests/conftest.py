from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import TINY, build_checkpoint, build_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """tiny_model(name) -> directory of a tiny random checkpoint with a tokenizer (cached)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            build_checkpoint(name, out)
            build_tokenizer(out)
            made[name] = out
        return made[name]

    return get


@pytest.fixture(params=sorted(TINY))
def tiny_name(request: pytest.FixtureRequest) -> str:
    return request.param
