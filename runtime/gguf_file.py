"""A lean reader of GGUF files: the header, the tensor directory and memory-mapped tensor data.

gguf-py's ``GGUFReader`` builds a numpy view for every metadata item, ~250,000 of them for a 49K-token vocabulary,
which takes 4 s on the machine this was written on and most of a cached start. Loading weights needs none of
those arrays, so this reader walks past them with ``struct`` (string arrays are skipped length by length,
numeric arrays by size) and keeps only scalar metadata. The layout (GGUF v2/v3, little-endian):

    magic "GGUF", version u32, n_tensors u64, n_kv u64,
    n_kv x (key: string, type: u32, value), n_tensors x (name: string, n_dims u32, dims u64[n_dims], type u32,
    offset u64), padding to ``general.alignment`` (32 by default), then the tensor data at those offsets.

A string is a u64 length and UTF-8 bytes; an array is an item type u32, a count u64 and the items.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MADV_POPULATE_READ = 22  # Linux's value (mmap has no name for it before Python 3.13)

# GGML tensor types the engine meets: id -> (name, values per block, bytes per block), as gguf-py's
# GGML_QUANT_SIZES (tests/test_quant.py checks every row against it). Others are looked up in gguf-py, whose import
# (~0.2 s) a start with only these types does not pay.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
}  # fmt: skip


def ggml_type(type_id: int) -> tuple[str, int, int]:
    """``(name, values per block, bytes per block)`` of a GGML tensor type."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(type_id)
    return (kind.name, *GGML_QUANT_SIZES[kind])


# GGUF metadata value types: struct format of the fixed-size ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory. ``shape`` is in torch order (outermost first; GGUF lists dims innermost
    first); ``offset`` is absolute in the file; ``tensor_type`` is the GGML type number."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    offset: int
    nbytes: int


class GGUFFile:
    """The file's scalar metadata and tensor directory; ``data(t)`` is a read-only uint8 view of a tensor's
    bytes in the map. Invariant: views stay valid until ``close()``; callers copy what they keep."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # Ask the kernel to read the whole file ahead now: the loader copies and repacks one tensor at a time, and
        # without this each tensor's pages were read only when first touched, so the disk waited on the repacking
        # and the repacking on the disk.
        with contextlib.suppress(AttributeError, OSError):  # madvise: Python 3.8+ on Unix
            self._map.madvise(mmap.MADV_WILLNEED)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with b'GGUF')")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version < 2:
            raise ValueError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        pos = 24
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, pos = _value(buf, pos + 4, vtype)
            if value is not _SKIPPED:
                self.metadata[key] = value
        alignment = int(self.metadata.get("general.alignment", 32))  # type: ignore[call-overload]
        raw = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, dims, ttype, offset))
        start = (pos + alignment - 1) // alignment * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, ttype, offset in raw:
            _, block, size = ggml_type(ttype)
            count = int(np.prod(dims)) if dims else 1
            if count % block:
                raise ValueError(f"{self.path}: tensor {name} has {count} values, not a whole number of blocks")
            nbytes = count // block * size
            if start + offset + nbytes > len(buf):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors.append(TensorInfo(name, tuple(int(d) for d in reversed(dims)), ttype, start + offset, nbytes))

    def data(self, t: TensorInfo) -> np.ndarray:
        # Map the tensor's pages at once (MADV_POPULATE_READ, Linux 5.14+; waits for any not yet read in): the
        # repacking then takes no fault per 4 KB page. SmolLM2's Q4_1 file: load_model 0.35 s against 0.38 s,
        # medians of 8. Older kernels refuse it, and the pages fault in one by one as before.
        start = t.offset - t.offset % mmap.PAGESIZE
        with contextlib.suppress(AttributeError, OSError):
            if t.nbytes:
                self._map.madvise(MADV_POPULATE_READ, start, t.offset + t.nbytes - start)
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view is still alive somewhere: the map goes when it does
            self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SKIPPED = object()


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[object, int]:
    """One metadata value at ``pos`` and the position after it; arrays are skipped (``_SKIPPED``)."""
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALARS:
            return _SKIPPED, pos + count * struct.calcsize(_SCALARS[item])
        if item == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            return _SKIPPED, pos
        for _ in range(count):  # arrays of arrays: rare, walked item by item
            _, pos = _value(buf, pos, item)
        return _SKIPPED, pos
    raise ValueError(f"unknown GGUF metadata type {vtype} at byte {pos}")
