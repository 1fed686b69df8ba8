"""Collectives between the ranks of one machine over shared memory: all-reduce (float32
sum), all-gather and broadcast in a few microseconds, where gloo over loopback TCP takes
about a millisecond (vLLM's CPU backend and oneCCL do the same).

`open_group` is itself collective, run by every rank once the torch.distributed group is up:
rank 0 makes a segment in /dev/shm (mode 0600, a random name, its space reserved), writes a
random nonce in it and hands name and nonce to the others through the group's store; each
rank maps it, checks the nonce and that the file is its own user's, and says whether it
could. Only when every rank could (they share this machine and its /dev/shm, and the native
library built) do they all use it; rank 0 then unlinks the file at once, so nothing is left
in /dev/shm whatever happens later. Otherwise every rank gets None and stays on gloo.

Each rank holds a lock on byte `rank` of the segment's file while it lives: a rank waiting
for a peer that has exited (killed, crashed) sees its lock gone and fails at once, naming
it, rather than waiting out the timeout. The wait loops and copies are native/shm.cpp's.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import secrets
import stat
from pathlib import Path

import torch

from pypto_serving import native

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20
"""Bytes each rank moves per chunk; a larger payload goes in several."""
_STATUS = {1: "did not arrive within {t:.0f} s", 2: "is gone (its process exited)"}


class ShmError(RuntimeError):
    """A shared-memory collective failed: a peer timed out or exited (a RuntimeError, as
    gloo's failures are, so callers treat both alike)."""


class ShmGroup:
    """This rank's view of the group's segment and its collectives (CPU tensors only)."""

    def __init__(self, lib: ctypes.CDLL, fd: int, handle: int, rank: int, world: int) -> None:
        self.lib, self.fd, self.handle, self.rank, self.world = lib, fd, handle, rank, world
        self.timeout_s = 300.0
        """How long a collective waits for the other ranks (`set_collective_timeout`)."""
        self._who = ctypes.c_int(-1)
        self._who_ref = ctypes.byref(self._who)

    @property
    def _limit(self) -> tuple[float, object]:
        """The native calls' last arguments: the time limit and where to say who was late."""
        return self.timeout_s, self._who_ref

    def native_calls(self) -> tuple[int, int, int, int]:
        """For native code that runs the collectives itself (native/decode.cpp), as
        addresses: the group's handle, pypto_shm_all_reduce, pypto_shm_all_gather, and the
        int where a failed call names the rank it waited for."""
        fn = ctypes.cast(self.lib.pypto_shm_all_reduce, ctypes.c_void_p).value
        gather = ctypes.cast(self.lib.pypto_shm_all_gather, ctypes.c_void_p).value
        assert fn is not None and gather is not None
        return self.handle, fn, gather, ctypes.addressof(self._who)

    def check(self, status: int, what: str) -> None:
        """Raise ShmError for a native collective's failed `status` (naming the rank it
        waited for, which the call left at `native_calls()[3]`)."""
        if status == 0:
            return
        if status == 3:
            raise ShmError(f"shared-memory {what}: the group broke in an earlier collective")
        why = _STATUS[status].format(t=self.timeout_s)
        raise ShmError(f"shared-memory {what}: rank {self._who.value} {why}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of every rank's float32 `x`, added in rank order."""
        x = x.contiguous()
        out = torch.empty_like(x)
        ends = (x.data_ptr(), out.data_ptr())
        status = self.lib.pypto_shm_all_reduce(self.handle, *ends, x.numel(), *self._limit)
        self.check(status, "all_reduce")
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., d] side by side along the last dimension: [..., world * d]."""
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], self.world * x.shape[-1])
        row = x.shape[-1] * x.element_size()
        rows = x.numel() // max(x.shape[-1], 1)
        self._gather(x, out, rows, row)
        return out

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [rows, ...] one after the other, rank 0's first."""
        x = x.contiguous()
        out = x.new_empty(self.world * len(x), *x.shape[1:])
        self._gather(x, out, 1, x.numel() * x.element_size())
        return out

    def _gather(self, x: torch.Tensor, out: torch.Tensor, rows: int, row_bytes: int) -> None:
        if not row_bytes:
            return
        ends = (x.data_ptr(), out.data_ptr())
        status = self.lib.pypto_shm_all_gather(self.handle, *ends, rows, row_bytes, *self._limit)
        self.check(status, "all_gather")

    def broadcast(self, t: torch.Tensor, root: int = 0) -> None:
        """`root`'s contiguous `t` into every other rank's `t` (in place)."""
        assert t.is_contiguous()
        size = t.numel() * t.element_size()
        status = self.lib.pypto_shm_broadcast(self.handle, t.data_ptr(), size, root, *self._limit)
        self.check(status, "broadcast")

    def close(self) -> None:
        """Unmap the segment and release this rank's lock. Idempotent."""
        if self.handle:
            self.lib.pypto_shm_detach(self.handle)
            self.handle = 0
            os.close(self.fd)


def open_group(
    store: torch.distributed.Store, rank: int, world: int, wanted: bool
) -> ShmGroup | None:
    """Every rank of the group calls this: a `ShmGroup` on every rank, or None on every rank
    (one of them did not want it, could not build the library or could not share the
    segment). The store's own timeout bounds the waits."""
    lib = native.shm_library() if wanted else None
    opened: tuple[int, int] | None = None
    made: tuple[Path, str] | None = None
    if rank == 0:
        made = None if lib is None else _make_segment(lib.pypto_shm_bytes(world, SLOT_BYTES))
        store.set("pypto-shm/name", "" if made is None else f"{made[0].name}:{made[1]}")
        if lib is not None and made is not None:
            opened = _attach(lib, made[0], made[1], rank, world)
    else:
        found = store.get("pypto-shm/name").decode()
        if lib is not None and found:
            name, nonce = found.split(":")
            opened = _attach(lib, SHM_DIR / name, nonce, rank, world)
    store.set(f"pypto-shm/ok/{rank}", "1" if opened else "0")
    agreed = all(store.get(f"pypto-shm/ok/{r}") == b"1" for r in range(world))
    if made is not None:
        made[0].unlink(missing_ok=True)  # every rank has it open (or gave up): leave nothing
    if lib is None or opened is None:
        return None
    group = ShmGroup(lib, *opened, rank, world)
    if not agreed:
        group.close()
        return None
    return group


def _make_segment(size: int) -> tuple[Path, str] | None:
    """Rank 0: a new private file of `size` bytes in /dev/shm with a nonce at its start."""
    path = SHM_DIR / f"pypto-tp-{secrets.token_hex(12)}"
    nonce = secrets.token_hex(16)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        log.info("no shared-memory collectives: cannot create %s (%s)", path, e)
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # the space now, or an error (never SIGBUS later)
        os.pwrite(fd, nonce.encode(), 0)
    except OSError as e:
        log.info("no shared-memory collectives: %s (%d bytes): %s", path, size, e)
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(fd)
    return path, nonce


def _attach(
    lib: ctypes.CDLL, path: Path, nonce: str, rank: int, world: int
) -> tuple[int, int] | None:
    """Open and map the segment after checking it is rank 0's (this user's, private, with
    the nonce), and lock byte `rank`: (fd, native handle), or None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        log.info("no shared-memory collectives: cannot open %s (%s)", path, e)
        return None
    try:
        st = os.fstat(fd)
        ours = st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        if not ours or os.pread(fd, len(nonce), 0) != nonce.encode():
            raise OSError(f"{path} is not this group's segment")
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)  # released when this process ends
        handle = lib.pypto_shm_attach(fd, rank, world, SLOT_BYTES)
        if not handle:
            raise OSError(f"cannot map {path}")
    except OSError as e:
        log.info("no shared-memory collectives: %s", e)
        os.close(fd)
        return None
    return fd, handle
