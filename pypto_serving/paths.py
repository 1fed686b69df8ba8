"""Where PyPTO Serving keeps files: converted models and the compile cache (no torch import,
so the package can point Inductor at its cache before torch is loaded), and how it writes
them."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: `$PYPTO_CACHE_DIR` if set, else `~/.cache/pypto-serving`."""
    env = os.environ.get("PYPTO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pypto-serving"


def use_compile_cache() -> None:
    """Keep torch.compile's on-disk caches in `cache_dir()/inductor` (unless the user set
    TORCHINDUCTOR_CACHE_DIR). Must run before torch resolves its cache directory."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file (`<name>.<pid>.tmp`) renamed into place:
    a reader (another process starting at once, a start after a crash) sees the old file or
    the whole new one, never half of one. Raises OSError, the temporary file removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
