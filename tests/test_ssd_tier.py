"""The SSD tier under faults and forgery: an I/O error (a full or read-only disk, a failing
read, an unlistable folder) costs a page, never a step; a page file not made with the
directory's secret is never served; its files and folders are private.

Same fake store as test_kv_tiers.py: the KV of a token at position p is (token id, p).
"""

import errno
import hashlib
import logging
import os
import stat
import struct
from pathlib import Path

import pytest
from read_only import inject_errors
from test_kv_tiers import PS, A, B, _page_on_ssd, assert_kv, compute, make_store, request, slots

from pypto_serving.kv import disk_tier
from pypto_serving.kv.disk_tier import MAGIC, SUFFIX
from pypto_serving.paths import DIGEST_BYTES, keyed_digest

# --- I/O errors: a page is lost, never a step ----------------------------------------------


def test_a_full_disk_drops_the_pages_pushed_to_ssd_and_writes_resume_after(
    tmp_path: Path,
) -> None:
    store = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    assert store.pool.ssd is not None
    a, b = request("a", A), request("b", B)
    compute(store, a)
    store.free(a)
    with inject_errors(tmp_path, errno.ENOSPC, ("open",)):
        compute(store, b)  # a's two pages go to SSD: neither can be written
        store.pool.ssd.flush()
    assert store.pool.ssd.num_errors == 2 and len(store.pool.ssd) == 0
    assert list(store.pool.ssd.dir.iterdir()) == []  # no temporary file left either
    store.free(b)
    again = request("a2", A)
    assert compute(store, again) == 0  # recomputed
    assert_kv(store, again)
    store.pool.ssd.flush()  # b's pages were pushed down with space back: written
    assert len(list(store.pool.ssd.dir.glob("*" + SUFFIX))) == 2
    assert {t.name: t.errors for t in store.tier_stats()} == {"device": 0, "ssd": 2}
    store.close()


def test_a_failing_read_is_a_miss_and_an_undeletable_file_is_still_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, page_file = _page_on_ssd(tmp_path)
    assert store.pool.ssd is not None
    real_open = open

    def failing_open(path: object, *args: object, **kwargs: object) -> object:
        if Path(str(path)) == page_file:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(disk_tier, "open", failing_open, raising=False)
    again = request("a2", A)
    assert compute(store, again) == 0
    assert_kv(store, again)
    assert store.pool.ssd.num_errors == 1 and store.pool.ssd.num_unreadable == 0
    assert page_file.exists()  # a read error is not a verdict on the file
    monkeypatch.undo()
    store.close()

    store, page_file = _page_on_ssd(tmp_path / "second")
    assert store.pool.ssd is not None
    with inject_errors(tmp_path, errno.EROFS, ("unlink",)):
        again = request("a2", A)
        assert compute(store, again) == 8  # both pages loaded; their files stay
        assert_kv(store, again)
    assert store.pool.ssd.num_errors == 2 and page_file.exists()
    store.close()


def test_an_unlistable_ssd_folder_finds_nothing_and_the_tier_serves_on(tmp_path: Path) -> None:
    store, _ = _page_on_ssd(tmp_path)
    store.close()
    with inject_errors(tmp_path, errno.EACCES, ("listdir",)):
        second = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    assert second.pool.ssd is not None and second.pool.ssd.num_found == 0
    assert second.pool.ssd.num_errors == 1 and second.pool.ssd.off is None
    assert compute(second, request("a2", A)) == 0
    second.close()


def _spill_log(tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int | None) -> list[str]:
    """What closing a store with a's two pages cached on the device logs (the spill), with
    every write under tmp_path failing with `code` (None: none failing)."""
    store = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    a = request("a", A)
    compute(store, a)
    store.free(a)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pypto_serving.kv.pool"):
        if code is None:
            store.close()
        else:
            with inject_errors(tmp_path, code):
                store.close()
    return [r.getMessage() for r in caplog.records if r.name == "pypto_serving.kv.pool"]


def test_the_spill_logs_the_pages_kept_not_those_whose_writes_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert _spill_log(tmp_path / "ok", caplog, None) == [
        "kept 2 cached KV pages on the SSD tier for the next start"
    ]
    said = _spill_log(tmp_path / "read-only", caplog, errno.EROFS)
    assert not any("kept" in m and "not keep" not in m for m in said), said
    assert any("could not keep 2 of 2 cached KV pages" in m and "failed" in m for m in said)


# --- the SSD tier's files are authenticated and private -------------------------------------


def _forge(page_file: Path, key: bytes) -> None:
    """Rewrite a page file with a zero payload and a digest recomputed over it with `key`
    (b"": a plain, unkeyed BLAKE2b, what anyone can compute)."""
    data = page_file.read_bytes()
    (size,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    head = data[: len(MAGIC) + 4 + size]
    payload = bytes(len(data) - len(head) - DIGEST_BYTES)
    digest = (
        keyed_digest(key, head, payload)
        if key
        else hashlib.blake2b(head + payload, digest_size=DIGEST_BYTES).digest()
    )
    page_file.write_bytes(head + payload + digest)


@pytest.mark.parametrize("key", ["plain", "other key", "the secret"])
def test_a_forged_ssd_page_is_rejected_unless_made_with_the_secret(
    tmp_path: Path, key: str
) -> None:
    """A page file rewritten with a zero payload and a recomputed digest is rejected and
    recomputed; only a digest keyed by the directory's secret passes (the control that shows
    the forgery is otherwise well formed: it is then served, zeros and all)."""
    store, page_file = _page_on_ssd(tmp_path)
    secret = (tmp_path / "secret").read_bytes()
    _forge(page_file, {"plain": b"", "other key": b"k" * 32, "the secret": secret}[key])
    again = request("a2", A)
    assert store.pool.ssd is not None
    if key != "the secret":
        assert compute(store, again) == 0
        assert store.pool.ssd.num_unreadable == 1 and not page_file.exists()
        assert_kv(store, again)  # recomputed
        assert {t.name: t.rejected for t in store.tier_stats()}["ssd"] == 1
    else:
        assert compute(store, again) == 8
        first_page = slots(store, again, range(PS))
        assert store.pool.cache.k_cache[0, 0, first_page].abs().sum() == 0  # the forged zeros
    store.close()


def test_ssd_files_and_folders_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store, page_file = _page_on_ssd(tmp_path / "kv")
    finally:
        os.umask(old)
    modes = {
        name: stat.S_IMODE(p.stat().st_mode)
        for name, p in (
            ("secret", tmp_path / "kv" / "secret"),
            ("folder", page_file.parent),
            ("page", page_file),
        )
    }
    assert modes == {"secret": 0o600, "folder": 0o700, "page": 0o600}
    store.close()


@pytest.mark.parametrize("how", ["readable by others", "a symlink", "another user's"])
def test_an_unusable_secret_turns_the_ssd_tier_off(tmp_path: Path, how: str) -> None:
    """A secret others could read (or that is not this user's own file) could sign forged
    pages: the tier is off (said in the log and in describe), the engine serves on."""
    secret = tmp_path / "secret"
    if how == "readable by others":
        secret.write_bytes(b"s" * 32)
        secret.chmod(0o644)
    elif how == "a symlink":
        (tmp_path / "elsewhere").write_bytes(b"s" * 32)
        (tmp_path / "elsewhere").chmod(0o600)
        secret.symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the secret to another user")
        secret.write_bytes(b"s" * 32)
        secret.chmod(0o600)
        os.chown(secret, 65534, 65534)
    store = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    assert store.pool.ssd is not None and store.pool.ssd.off is not None
    assert store.pool.ssd.capacity == 0 and "off:" in store.describe()
    a = request("a", A)
    compute(store, a)
    store.free(a)
    compute(store, request("b", B))  # a's pages are dropped, not written
    store.close()
    assert list(store.pool.ssd.dir.iterdir()) == []


def test_a_folder_that_cannot_be_made_turns_the_ssd_tier_off(tmp_path: Path) -> None:
    with inject_errors(tmp_path, errno.EROFS, ("mkdir",)):
        store = make_store(num_pages=3, cpu_pages=0, ssd_pages=4, ssd_dir=tmp_path)
    assert store.pool.ssd is not None and store.pool.ssd.off is not None
    assert store.pool.ssd.capacity == 0 and store.pool.ssd.num_errors == 1
    a = request("a", A)
    compute(store, a)
    store.free(a)
    assert compute(store, request("b", B)) == 0
    store.close()
