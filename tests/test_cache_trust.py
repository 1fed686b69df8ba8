"""Cache files that run code when loaded (compiled graphs are unpickled, native kernels are
dlopened, Inductor unpickles its own cache) are used only from folders no other user can
write, and kept graphs only once their digest, keyed by the cache folder's secret, checks.
A planted file is never executed: the engine compiles or builds again instead."""

from __future__ import annotations

import logging
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
from live_server import tiny_llm

from pypto_serving import native, paths
from pypto_serving.executor import compiled
from pypto_serving.paths import (
    secret_key,
    trusted_cache_dir,
    use_compile_cache,
    write_atomically,
)

MODEL = "llama-gqa4-tied"


class _Planted:
    """Unpickling this writes a marker file: the planted code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.write_text, (self.marker, "executed"))


def _plant(path: Path, marker: Path, key: bytes | None = None) -> None:
    """A graph file that runs code when unpickled: bare (the old format) or, with `key`, behind
    a digest keyed by it (what only a holder of the secret can make)."""
    body = pickle.dumps({"artifact": _Planted(marker)})
    if key is not None:
        body = compiled.GRAPH_MAGIC + paths.keyed_digest(key, body) + body
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)


def _load(path: Path) -> object:
    x = torch.zeros(2, 4)
    return compiled._load_graph(path, None, x, x, x, None)  # type: ignore[arg-type]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PYPTO_CACHE_DIR", str(root))
    return root


def test_a_planted_graph_file_is_never_unpickled(cache: Path, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    graphs = trusted_cache_dir("graphs")
    assert graphs == cache / "graphs"
    for i, key in enumerate([None, b"not the secret".ljust(32)]):
        _plant(graphs / f"{i}.bin", marker, key)
        assert _load(graphs / f"{i}.bin") is None
    assert not marker.exists()
    # the control: only a file with the secret's digest is unpickled (and here it runs)
    _plant(graphs / "signed.bin", marker, secret_key(cache))
    assert _load(graphs / "signed.bin") is None
    assert marker.exists()


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another user's"])
def test_a_cache_folder_others_could_write_is_not_used(
    cache: Path, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Even a file with the right digest is not loaded from a folder someone else could have
    written it into (they may also have read or replaced the secret)."""
    marker = tmp_path / "executed"
    planted = cache / "graphs" / "x.bin"
    assert trusted_cache_dir("graphs") == planted.parent  # private until changed below
    _plant(planted, marker, secret_key(cache))
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        os.chown(cache, 65534, 65534)
    else:
        cache.chmod(0o775 if how == "group-writable" else 0o777)
    with caplog.at_level(logging.WARNING):
        assert trusted_cache_dir("graphs") is None
        assert _load(planted) is None
    assert not marker.exists()
    assert "not using the cache folder" in caplog.text
    assert caplog.text.count("not using the cache folder") == 1  # said once


def test_a_planted_graph_in_the_engines_cache_is_compiled_over(
    cache: Path, tmp_path: Path, tiny_model
) -> None:
    """The attack as found: a kept graph replaced by a pickle that runs code. The restart
    compiles the graph again, serves the same tokens, and the planted code never runs."""
    from pypto_serving import SamplingParams

    torch._dynamo.reset()  # it must compile and keep its graph, not reuse this worker's
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    knobs = {"enforce_eager": False, "num_kv_pages": 32}
    with tiny_llm(tiny_model(MODEL), **knobs) as first:
        want = first.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    kept = sorted((cache / "graphs").glob("*.bin"))
    assert kept
    assert stat.S_IMODE(kept[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((cache / "graphs").stat().st_mode) == 0o700
    marker = tmp_path / "executed"
    for path in kept:
        _plant(path, marker)
    compiles = compiled.COUNTER.num_compiles
    with tiny_llm(tiny_model(MODEL), **knobs) as second:
        got = second.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert not marker.exists()
    assert got == want
    assert compiled.COUNTER.num_compiles > compiles


def test_inductors_cache_moves_to_a_private_folder_when_ours_is_not_private(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
    assert stat.S_IMODE((cache / "inductor").stat().st_mode) == 0o700
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (cache / "inductor").chmod(0o777)
    use_compile_cache()
    private = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert private != cache / "inductor"
    assert paths.untrusted(private) is None and stat.S_IMODE(private.stat().st_mode) == 0o700


def _fake_compiler(tmp_path: Path) -> Path:
    """A 'compiler' that writes 'built' where -o says."""
    cxx = tmp_path / "cxx"
    cxx.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo "cxx 1.0" && exit 0\n'
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo built > "$2"; shift; done\n'
    )
    cxx.chmod(0o755)
    return cxx


def test_a_kernel_library_others_could_replace_is_built_again(tmp_path: Path) -> None:
    cxx = str(_fake_compiler(tmp_path))
    out = tmp_path / "kernels"
    first = native.build(2, 32, out, cxx=cxx)
    assert first is not None and stat.S_IMODE(first.stat().st_mode) == 0o700
    first.write_text("planted")
    first.chmod(0o666)
    assert native.build(2, 32, out, cxx=cxx) == first
    assert first.read_text() == "built\n"  # rebuilt, not loaded
    assert stat.S_IMODE(first.stat().st_mode) == 0o700


def test_a_kept_object_is_keyed_by_the_headers_beside_its_sources(tmp_path: Path) -> None:
    """decode.cpp includes records.h: sources of the same text beside another records.h (a
    benchmark's build of an older revision) get an object of their own, not the kept one."""
    cxx, out = str(_fake_compiler(tmp_path)), tmp_path / "kernels"
    package = Path(native.__file__).parent
    folders = []
    for name, tail in (("a", ""), ("b", "\n// another revision\n")):
        folder = tmp_path / name
        folder.mkdir()
        for source in ("attention.cpp", "decode.cpp", "records.h"):
            (folder / source).write_text((package / source).read_text())
        (folder / "records.h").write_text((package / "records.h").read_text() + tail)
        folders.append(folder)
    for folder in folders:
        built = native._build(
            (folder / "attention.cpp",), (), "lib", out, cxx, (), (folder / "decode.cpp",)
        )
        assert built is not None
    assert len(list(out.glob("decode-*.o"))) == 2
    assert len(list(out.glob("lib-*.so"))) == 2


def test_kernels_are_built_in_a_private_folder_when_the_cache_is_not_private(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built_in: list[Path] = []
    monkeypatch.setattr(native, "build", lambda g, d, out: built_in.append(out))
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    native._library.__wrapped__(2, 32)
    (out,) = built_in
    assert not out.is_relative_to(cache)
    assert paths.untrusted(out) is None and stat.S_IMODE(out.stat().st_mode) == 0o700


def test_a_file_is_written_whole_or_not_at_all(tmp_path) -> None:
    """write_atomically: bytes, or a writer given the temporary file's name (a large file is
    then never held whole in memory), renamed into place at mode 0600; a writer that fails
    leaves the old file and no temporary one."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "kept" / "w.safetensors"
    tensors = {"a": torch.arange(6, dtype=torch.int8), "b": torch.ones(2, 3)}
    write_atomically(path, lambda tmp: save_file(tensors, tmp))
    got = load_file(str(path))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in got)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = path.read_bytes()

    def fails(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        write_atomically(path, fails)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    write_atomically(path, b"bytes")
    assert path.read_bytes() == b"bytes"
