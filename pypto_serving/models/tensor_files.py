"""Safetensors files read, not mapped (`read_tensors` gives each tensor memory of its own),
and written from the tensors where they lie (`write_tensors`).

`safetensors.safe_open` hands out tensors on the file's mapping. A mapping's touched pages
count in the process's resident memory until the file closes: loading a checkpoint shard of
5 GB, or reading back a quantized cache file, held the file's bytes beside the copies made of
them, so a load's peak was about twice what it keeps. And tensors on a shared mapping of a
cache file that another start may rewrite are not safe to keep. Reading each tensor into its
own memory (`readinto`, one at a time) makes a load's peak what it holds. Writing is the
same the other way: `safetensors.torch.save_file` copied the tensors into bytes first (1.2 GB
more at the peak of a MoE's first quantized load), `write_tensors` writes each from its
memory.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors' dtype names."""


MALFORMED = (ValueError, KeyError, TypeError, IndexError, RuntimeError, struct.error)
"""What `read_tensors` raises for a file that is not safetensors (OSError where unreadable)."""
MAX_HEADER = 1 << 28
"""The largest safetensors header read (safetensors' own limit is 100 MB)."""


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's header: each tensor's dtype, shape and data_offsets (and the
    file's `__metadata__`). A malformed file raises MALFORMED."""
    with open(path, "rb") as f:
        return _header(f)[0]


def _header(f: BinaryIO) -> tuple[dict[str, dict[str, Any]], int]:
    """The header of the safetensors file open as `f`, and where its data starts."""
    (size,) = struct.unpack("<Q", f.read(8))
    if size > MAX_HEADER:
        raise ValueError(f"a header of {size} bytes")
    header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + size


def read_tensors(
    path: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file that `wanted` names (all: None), in the order they
    lie in it, each read into memory of its own. A malformed file raises MALFORMED."""
    with open(path, "rb") as f:
        header, start = _header(f)
        header.pop("__metadata__", None)
        for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if wanted is not None and not wanted(key):
                continue
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            if tensor.numel() * tensor.element_size() != end - begin:
                raise ValueError(f"{key}: {end - begin} bytes for shape {info['shape']}")
            f.seek(start + begin)
            into = (ctypes.c_char * (end - begin)).from_address(tensor.data_ptr())
            if end > begin and f.readinto(into) != end - begin:
                raise ValueError(f"{key}: the file ends early")
            yield key, tensor


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (contiguous, on the CPU) to `path` as a safetensors file, each from
    where it lies (no copy), in the order given."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, tensor in tensors.items():
        assert tensor.is_contiguous() and tensor.device.type == "cpu", key
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for tensor in tensors.values():
            size = tensor.numel() * tensor.element_size()
            if size:
                f.write((ctypes.c_char * size).from_address(tensor.data_ptr()))
