"""The files of the KV tier (``runtime.kv_tier``): one chunk of one prefix's KV per file, self-checking.

A file is ``MAGIC``, a 4-byte little-endian header length, the header (JSON: the model key, the chunk key, the
chunk's token ids, the KV dtype and shape), the KV bytes, and a CRC-32 of header and KV. A reader serves a file only
if every part agrees with what it asked for: the model key (same weights, dtype, quantization, KV layout), the
chunk key and its tokens (the same prefix), the shape and dtype of the pool, the length, the checksum. Anything else
raises ``ChunkError`` with the reason, and the caller computes that KV instead.

Writes go to a temporary name in the same folder and are renamed into place once complete (``os.replace`` is
atomic on POSIX), so a process killed mid-write leaves at worst a ``*.tmp`` file, which the tier deletes at start;
a file cut short by a crash of the machine fails its length or checksum. No fsync: the checksum, not the disk's
ordering, is what keeps a torn file from being served, and an fsync per chunk would cost the writer more than the
chunk.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

MAGIC = b"RSKVTIER1\n"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class ChunkError(Exception):
    """A chunk file that must not be served: the message says why (missing, truncated, another model, ...)."""


def write_chunk(path: Path, model_key: str, chunk_key: str, tokens: list[int], kv: torch.Tensor) -> int:
    """Write ``kv`` (the chunk's keys and values, any shape, on CPU) to ``path`` atomically; returns its size."""
    header = json.dumps(
        {
            "model_key": model_key,
            "chunk_key": chunk_key,
            "tokens": tokens,
            "dtype": str(kv.dtype).removeprefix("torch."),
            "shape": list(kv.shape),
        },
        separators=(",", ":"),
    ).encode()
    payload = memoryview(kv.contiguous().view(torch.uint8).reshape(-1).numpy())
    crc = zlib.crc32(payload, zlib.crc32(header))
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<I", len(header)))
            f.write(header)
            f.write(payload)
            f.write(struct.pack("<I", crc))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(MAGIC) + 4 + len(header) + len(payload) + 4


def read_chunk(
    path: Path, model_key: str, chunk_key: str, tokens: list[int], shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The chunk's KV as a ``shape`` tensor of ``dtype``; ``ChunkError`` unless the file is exactly that chunk."""
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(data)
    except FileNotFoundError:
        raise ChunkError("the file is gone (deleted to keep the tier within its size)") from None
    except OSError as exc:
        raise ChunkError(f"unreadable: {exc}") from None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ChunkError("not a KV chunk file (bad magic) or truncated")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header: dict[str, Any] = json.loads(data[start : start + hlen])
    except ValueError:
        raise ChunkError("unreadable header (truncated or corrupt)") from None
    if not isinstance(header, dict):
        raise ChunkError("unreadable header")
    if header.get("model_key") != model_key:
        raise ChunkError(f"written for another model, dtype or KV layout (key {header.get('model_key')!r})")
    if header.get("chunk_key") != chunk_key or header.get("tokens") != tokens:
        raise ChunkError("holds another prefix than its name says")
    if _DTYPES.get(str(header.get("dtype"))) is not dtype or header.get("shape") != list(shape):
        raise ChunkError(f"KV of dtype {header.get('dtype')} shape {header.get('shape')}, the pool's differ")
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    body = start + hlen
    if len(data) != body + nbytes + 4:
        raise ChunkError(f"{len(data)} bytes where {body + nbytes + 4} were written (truncated?)")
    (crc,) = struct.unpack_from("<I", data, body + nbytes)
    payload = memoryview(data)[body : body + nbytes]
    if zlib.crc32(payload, zlib.crc32(data[start:body])) != crc:
        raise ChunkError("checksum mismatch (corrupt)")
    return torch.frombuffer(data, dtype=torch.uint8, offset=body, count=nbytes).view(dtype).reshape(shape)
