"""Reading a safetensors file one tensor at a time into ordinary (anonymous) memory, without a memory map.

``safetensors.safe_open`` maps the file and hands out tensors that are views of the map: a parameter made from
one keeps the whole file mapped, and every page a load touches stays in the process's resident set for as long
as the map lives, including the pages of tensors that were copied elsewhere (merged projections, packed copies,
casts). A 2 GB checkpoint then counts twice. Here each tensor is read with one ``readinto`` into a buffer of its
own: the page cache still serves repeated loads, and what stays resident is exactly what the model keeps.

The format: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
(offsets relative to the end of the header), then the data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# A header larger than this is not a safetensors header (the format's own limit is 100 MB).
_MAX_HEADER = 100 * 2**20


def read_header(file: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """``(entries, data_start)``: the header's tensor entries in the file's key order (``__metadata__`` left
    out) and the byte offset where the data begins. ``ValueError`` names the file when it is not safetensors."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise ValueError(f"{file}: not a safetensors file (header length {size})")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{file}: unreadable safetensors header (not an object)")
    header.pop("__metadata__", None)
    return header, 8 + size


def iter_file(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each tensor of ``file`` in sorted name order (safe_open's order), each in a
    fresh CPU buffer of its stored dtype and shape."""
    entries, start = read_header(file)
    with open(file, "rb", buffering=0) as f:
        for name in sorted(entries):
            yield name, _read(f, file, name, entries[name], start)


def _read(f: Any, file: Path, name: str, entry: dict[str, Any], start: int) -> torch.Tensor:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{file}: tensor {name!r} has a malformed or unsupported header entry {entry}") from exc
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if end - begin != nbytes:
        raise ValueError(f"{file}: tensor {name!r} spans {end - begin} bytes, its shape {shape} needs {nbytes}")
    out = torch.empty(nbytes, dtype=torch.uint8)
    f.seek(start + begin)
    view = memoryview(out.numpy())
    done = 0
    while done < nbytes:  # readinto may return less than asked (large reads, signals)
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{file}: truncated: tensor {name!r} ends past the end of the file")
        done += n
    return out.view(dtype).reshape(shape)
