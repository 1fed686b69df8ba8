"""A folder made read-only for a test, as root too (root ignores permission bits).

Where the process may mount (root with CAP_SYS_ADMIN, as in CI), the folder becomes a real
read-only bind mount of itself; elsewhere the os calls that would write under it raise EROFS.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _mount(*args: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextmanager
def read_only(folder: Path) -> Iterator[str]:
    """Make `folder` read-only until the block ends; yields how: "mount" or "injected"."""
    folder = folder.resolve()
    if _mount("--bind", str(folder), str(folder)):
        try:
            if _mount("-o", "remount,ro,bind", str(folder)):
                yield "mount"
                return
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    with inject_errors(folder, errno.EROFS):
        yield "injected"


def _under(path: Any, folder: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(folder)
    except (TypeError, ValueError):
        return False  # a file descriptor


@contextmanager
def inject_errors(folder: Path, code: int, calls: tuple[str, ...] | None = None) -> Iterator[None]:
    """The os calls that change anything under `folder` (or only `calls` of them: open for
    writing, unlink, mkdir, replace, rename, link, chmod, listdir) raise OSError(code)."""
    folder = folder.resolve()
    names = calls or ("open", "unlink", "mkdir", "replace", "rename", "link", "chmod")

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def fake(path: Any, *args: Any, **kwargs: Any) -> Any:
            writes = name != "open" or (args and args[0] & WRITE_FLAGS)
            if writes and _under(path, folder):
                raise OSError(code, os.strerror(code), os.fsdecode(path))
            return real(path, *args, **kwargs)

        return fake

    with ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(os, name, wrap(name, getattr(os, name))))
        yield
