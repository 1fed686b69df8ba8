"""Hosts for multi-host tests on one machine: Linux network namespaces joined by veth pairs.

`hosts(n)` makes n namespaces, each a "host" with one interface (eth0) and its own address in
a private 10.x.y.0/24 network that exists only inside the test: every host's eth0 is one end
of a veth pair whose other end sits on a bridge in a further namespace (the switch). Nothing
is added to the machine's own namespace; everything is deleted when the block ends. Needs
root and iproute2 (`ip`), as CI has.

A process runs on a host through `host.run(argv)` (`ip netns exec`); this process talks to a
host from a thread that entered its namespace (`host.call(fn)`, setns(2) on that thread only).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is missing (apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    netns: str
    address: str

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: list[str], **popen: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(argv), text=True, **popen)

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on a thread inside this host's namespace (its sockets are the host's)."""
        result: list[Any] = []

        def enter_and_run() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            finally:
                os.close(fd)
            try:
                result.append(("ok", fn()))
            except BaseException as e:  # handed back to the caller's thread
                result.append(("error", e))

        thread = threading.Thread(target=enter_and_run)
        thread.start()
        thread.join()
        kind, value = result[0]
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]


@contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """n hosts on one private network until the block ends."""
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    net = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    switch = f"pt{tag}sw"
    made = [switch]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        out = []
        for i in range(n):
            name = f"pt{tag}h{i}"
            _ip("netns", "add", name)
            made.append(name)
            port = f"p{i}"
            _ip(
                "-n",
                switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                name,
            )
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            address = f"{net}.{i + 1}"
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            out.append(Host(name, address))
        yield out
    finally:
        for name in reversed(made):  # what a failed test left running goes with its host
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
