"""Child processes of the engine (DP replicas, TP workers) and their local channel.

A child is a fresh interpreter (`subprocess`, not multiprocessing's spawn, which would re-run
the caller's main module) that inherits one end of a socketpair created before it starts;
its spec is the first message on it, and its entry function runs with the channel. There is
no listening socket, so pickled messages only ever come from a process this one started.
When a child dies its end closes and the parent reads EOF. When the parent dies, the child
exits within PARENT_CHECK_S even if it is busy or stuck in a collective: a watcher thread
sees it re-parented.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pypto_serving.errors import PyptoError

STOP_TIMEOUT_S = 10.0
PARENT_CHECK_S = 0.5


@dataclass(slots=True)
class StartFailed:
    """A child's report that it could not start (sent before it exits)."""

    pid: int
    message: str


@dataclass(slots=True)
class Joining:
    """A rank's report that it is set up and joins the torch.distributed group now."""

    pid: int


@dataclass(frozen=True, slots=True)
class StartupDeadline:
    """When the engine's child processes must have started (`startup_timeout_s`)."""

    limit_s: float
    at: float

    @classmethod
    def after(cls, limit_s: float) -> StartupDeadline:
        return cls(limit_s, time.monotonic() + limit_s)

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def missed(self, who: list[str]) -> PyptoError:
        """The error for the children (`who`: 'rank 1 (pid 123)', ...) not started in time."""
        return PyptoError(
            f"{', '.join(who)} did not start within startup_timeout_s ({self.limit_s:g} s)"
        )


def peak_rss_mib(pid: int | None = None) -> float:
    """Process `pid`'s (None: this one's) peak resident memory so far, from Linux's VmHWM: its
    own address space's, where getrusage's ru_maxrss also counts a parent's peak from before an
    exec (a bench run forked by a script that had converted a model read 4.5 GiB so); 0 where
    the process is gone."""
    try:
        status = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return 0.0
    kib = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0
    )
    return kib / 1024


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, PyptoError) else f"{type(e).__name__}: {e}"


class ChildProcess:
    """The parent's handle on a child running `entry(spec, channel)`."""

    def __init__(self, entry: Callable[[Any, Connection], None], spec: Any) -> None:
        self.conn, child = multiprocessing.Pipe()
        fd = child.fileno()
        code = (
            f"import {__name__} as m; "
            f"m.child_main({fd}, {entry.__module__!r}, {entry.__name__!r}, {os.getpid()})"
        )
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(fd,))
        child.close()
        self.conn.send(spec)

    @property
    def pid(self) -> int:
        return self.process.pid

    def request_stop(self) -> None:
        """Ask the child to finish its work and exit (a None message)."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.conn.send(None)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to finish, wait for it, then make sure it is gone."""
        self.request_stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        self.kill()

    def kill(self, grace: float = 2.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after `grace` seconds; at once with 0)
        and reap it."""
        if self.process.poll() is None and grace > 0:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()

    def peak_rss_mib(self) -> float:
        """The child's peak resident memory so far (Linux: VmHWM), 0 once it is gone."""
        return peak_rss_mib(self.pid)

    def exit_code(self, timeout: float = 5.0) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout)
        return None


def exit_with_parent(parent: int) -> None:
    """Exit this process as soon as `parent` is no longer its parent (it died)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="pypto-parent-watch", daemon=True).start()


def child_main(fd: int, module: str, name: str, parent: int) -> None:
    """In the child: read the spec from the inherited channel and run the entry function."""
    exit_with_parent(parent)
    conn = Connection(fd)
    try:
        spec = conn.recv()
    except (EOFError, OSError):
        sys.exit(1)
    getattr(importlib.import_module(module), name)(spec, conn)
