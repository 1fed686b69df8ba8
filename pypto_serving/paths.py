"""Where PyPTO Serving keeps files: converted models and the compile cache (no torch import,
so the package can point Inductor at its cache before torch is loaded), how it writes them,
and how it tells its own files from planted ones.

Files read back from a cache (compiled graphs, native kernels, quantized weights, Inductor's
own cache, SSD KV pages) are only used from folders that no other user can write: owned by
this user, not writable by group or others (`untrusted`). Folders this package makes are
0700 and its files 0600. Files whose content is executed or served (graphs, KV pages) carry
a digest keyed by a per-folder secret (`secret_key`, 0600, made on first use), checked
before they are deserialized.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SECRET_NAME = "secret"
SECRET_BYTES = 32
DIGEST_BYTES = 32
"""Bytes of a keyed digest (BLAKE2b-256)."""


class UntrustedPathError(PermissionError):
    """A cache file or folder that someone other than this user could have written."""


def cache_dir() -> Path:
    """The cache root: `$PYPTO_CACHE_DIR` if set, else `~/.cache/pypto-serving`."""
    env = os.environ.get("PYPTO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pypto-serving"


def use_compile_cache() -> None:
    """Keep torch.compile's on-disk caches in `cache_dir()/inductor` (unless the user set
    TORCHINDUCTOR_CACHE_DIR). Must run before torch resolves its cache directory. Inductor
    unpickles and loads what it finds there, so where that folder (or the cache folder) could
    hold another user's files, a private temporary folder is used instead (said in the log)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    inductor = cache_dir() / "inductor"
    # made private before torch makes them with the umask's mode (a read-only home: Inductor
    # says so itself if it needs the folder)
    with contextlib.suppress(OSError):
        inductor.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        inductor.mkdir(mode=0o700, exist_ok=True)
    why = untrusted(inductor.parent) or untrusted(inductor)
    if why is not None:
        inductor = Path(tempfile.mkdtemp(prefix="pypto-inductor-"))
        atexit.register(shutil.rmtree, inductor, ignore_errors=True)
        log.warning("not using Inductor's cache (%s): compiling into %s", why, inductor)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)


def untrusted(path: Path) -> str | None:
    """Why the files in `path` (a folder or a file) may not be this user's own: it is owned by
    another user, or its group or others may write it. None where it is private enough, or
    does not exist (it will be made private)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot check {path}: {e}"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user uses: made 0700 where absent, tightened to 0700 where
    it is this user's. Raises UntrustedPathError where another user could write into it,
    OSError where it cannot be made."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o700:
        with contextlib.suppress(OSError):  # e.g. a read-only mount: checked as it is
            path.chmod(0o700)
    why = untrusted(path)
    if why is not None:
        raise UntrustedPathError(why)
    return path


_refused: set[Path] = set()


def trusted_cache_dir(name: str) -> Path | None:
    """`cache_dir()/name` as a private folder, or None (said once in the log) where it could
    hold files planted by another user: the cache folder or it is another user's or writable
    by group or others. What would be cached there is then neither read nor kept."""
    root = cache_dir()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = untrusted(root)
        if why is not None:
            raise UntrustedPathError(why)
        return private_dir(root / name)
    except OSError as e:
        if root / name not in _refused:
            _refused.add(root / name)
            log.warning("not using the cache folder %s (%s): made again instead", root / name, e)
        return None


def secret_key(folder: Path) -> bytes:
    """The secret that keys the digests of the files kept in `folder`: `folder/secret`, 32
    random bytes, made (0600) on first use. Raises UntrustedPathError where that file is not
    this user's private file, OSError where it cannot be read or made."""
    path = folder / SECRET_NAME
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    tmp = path.with_name(f"{SECRET_NAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
        try:  # atomic, and never replaces the secret of a process that made it first
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UntrustedPathError(
                f"{path} is not this user's private file (uid {st.st_uid}, "
                f"mode {stat.S_IMODE(st.st_mode):o}; expected uid {os.geteuid()}, mode 600)"
            )
        key = f.read(SECRET_BYTES + 1)
    if len(key) != SECRET_BYTES:
        raise UntrustedPathError(f"{path} does not hold a {SECRET_BYTES}-byte secret")
    return key


def keyed_digest(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    """BLAKE2b-256 keyed by `key` over `parts` in order: only a holder of the key can make it
    (compare with `hmac.compare_digest`)."""
    h = hashlib.blake2b(key=key, digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def write_atomically(
    path: Path, data: bytes | bytearray | memoryview | Callable[[Path], None]
) -> None:
    """Write `data` to `path` (mode 0600) through a temporary file (`<name>.<pid>.tmp`)
    renamed into place: a reader (another process starting at once, a start after a crash)
    sees the old file or the whole new one, never half of one. `data` may be a function that
    writes the temporary file by its name (made 0600 first), so that a large file is never
    held whole in memory. Its folder is made 0700 if absent. Raises OSError (or the
    writer's error), the temporary file removed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f:
            if not callable(data):
                f.write(data)
        if callable(data):
            data(tmp)
        os.replace(tmp, path)
    except BaseException:  # (the writer's own errors too)
        with contextlib.suppress(OSError):  # e.g. a read-only file system: nothing to remove
            tmp.unlink(missing_ok=True)
        raise
