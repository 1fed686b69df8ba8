"""A real Mooncake master (the `mooncake_master` of mooncake-transfer-engine-non-cuda) for the
remote KV tier's tests, on a free loopback port or inside a network namespace, and the pool's
secret its members are given (`PYPTO_POOL_SECRET`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from patience import patience

from pypto_serving.kv.mooncake_pool import SECRET_ENV

POOL_SECRET = "the-test-pools-secret"
"""What every member of a test's pool is given as PYPTO_POOL_SECRET."""


def pool_env(secret: str = POOL_SECRET) -> dict[str, str]:
    """This process's environment with the pool's secret: for a member run as a process."""
    return os.environ | {SECRET_ENV: secret}


def master_binary() -> str:
    """The mooncake_master executable (on PATH, or next to the interpreter)."""
    found = shutil.which("mooncake_master") or str(
        Path(sys.executable).with_name("mooncake_master")
    )
    assert Path(found).exists(), "mooncake_master is missing: pip install -e '.[test]'"
    return found


def master_command(port: int, metrics_port: int) -> list[str]:
    return [
        master_binary(),
        f"--rpc_port={port}",
        f"--metrics_port={metrics_port}",
        "--enable_metric_reporting=false",
    ]


def wait_for_port(
    host: str, port: int, seconds: float, proc: subprocess.Popen[bytes], log: Path | None = None
) -> None:
    """Until the master listens on host:port; its log's tail says why where it exits first."""
    deadline = time.monotonic() + patience(seconds)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(errors="replace")[-2000:] if log is not None else ""
            raise AssertionError(f"mooncake_master exited with {proc.returncode}: {said}")
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"mooncake_master did not listen on {host}:{port}")


@contextmanager
def mooncake_master(
    port: int, metrics_port: int, prefix: list[str] | None = None, host: str = "127.0.0.1"
) -> Iterator[subprocess.Popen[bytes]]:
    """A master listening on host:port until the block ends (prefix: e.g. `ip netns exec NS`)."""
    with tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log") as log:
        proc = subprocess.Popen(
            [*(prefix or []), *master_command(port, metrics_port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(host, port, 30.0, proc, Path(log.name))
            yield proc
        finally:
            proc.kill()
            proc.wait()
