"""Safetensors files read, not mapped (models/tensor_files.py): every dtype a checkpoint or a
quantized cache file holds comes back as `safetensors` itself reads it, in memory of its own;
a file cut short or not safetensors at all is an error, not a crash."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving.models.tensor_files import MALFORMED, read_tensors, write_tensors


def test_each_tensor_is_the_files_in_memory_of_its_own(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "f32": torch.randn(7),
        "f16": torch.randn(2, 2, 2).half(),
        "u8": torch.randint(0, 255, (33,), dtype=torch.uint8),
        "i8": torch.randint(-128, 127, (4, 4), dtype=torch.int8),
        "i64": torch.arange(5),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    want = load_file(path)
    got = dict(read_tensors(path))
    assert set(got) == set(tensors)
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and tensor.shape == want[name].shape, name
        assert torch.equal(
            tensor.reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)
        ), name
    assert dict(read_tensors(path, {"u8", "f32"}.__contains__)).keys() == {"u8", "f32"}
    first = next(iter(read_tensors(path, "i64".__eq__)))[1]
    first += 1  # its own memory: the file is unchanged
    assert torch.equal(next(iter(read_tensors(path, "i64".__eq__)))[1], torch.arange(5))


@pytest.mark.parametrize("cut", [4, 100, -3])
def test_a_file_cut_short_or_not_safetensors_is_an_error(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(64), "b": torch.randn(64)}, path)
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:cut])
    with pytest.raises(MALFORMED):
        dict(read_tensors(bad))
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(MALFORMED):
        dict(read_tensors(bad))


def test_what_is_written_is_what_safetensors_reads(tmp_path: Path) -> None:
    torch.manual_seed(1)
    tensors = {
        "w": torch.randn(5, 3).bfloat16(),
        "records": torch.randint(0, 255, (2, 17), dtype=torch.uint8),
        "scale": torch.randn(3).half(),
        "none": torch.empty(0, dtype=torch.int32),
    }
    path = tmp_path / "w.safetensors"
    write_tensors(path, tensors)
    got = load_file(path)
    assert got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert all(torch.equal(t, tensors[n]) for n, t in read_tensors(path))
