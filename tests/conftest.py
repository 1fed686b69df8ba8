from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

import pypto_serving  # noqa: F401  (first: it sets OpenMP's spin count before torch loads)

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import TINY, build_checkpoint, build_tokenizer
from patience import patience


@pytest.fixture(autouse=True)
def patient_http_clients():
    """httpx calls that name no timeout wait patience(60) s, not httpx's 5 s: a request to a
    test server may take that long on a loaded machine. (The default is one shared object.)"""
    default = httpx._config.DEFAULT_TIMEOUT_CONFIG
    saved = (default.connect, default.read, default.write, default.pool)
    default.connect = default.read = default.write = default.pool = patience(60)
    yield
    default.connect, default.read, default.write, default.pool = saved


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


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder ($PYPTO_CACHE_DIR) of the test's own, empty at first."""
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=sorted(TINY))
def tiny_name(request: pytest.FixtureRequest) -> str:
    return request.param
