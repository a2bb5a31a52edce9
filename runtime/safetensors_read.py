"""Reading a safetensors file one tensor at a time into ordinary (anonymous) memory, or mapped in place.

``safetensors.safe_open`` maps the file and hands out tensors that are views of the map: a parameter made from
one keeps the whole file mapped, and every page a load touches stays in the process's resident set for as long
as the map lives, including the pages of tensors that were copied elsewhere (merged projections, packed copies,
casts). A 2 GB checkpoint then counts twice. Here each tensor is read with one ``readinto`` into a buffer of its
own: the page cache still serves repeated loads, and what stays resident is exactly what the model keeps.

A tensor the model serves exactly as stored (``mapped`` says which: the loader's bfloat16 weights where they are
served plain, ``bf16_kernels.plain_bf16_weights``) is instead a view of one private map of the file, its pages mapped
up front (``MADV_POPULATE_READ``, which reads them off the disk if need be): no copy, no fresh memory to fault in
(0.6 s a GiB on this machine's VMs), so the load takes what reading the file takes. Only those tensors' pages
are touched, and the map lives as long as one of them does. A write into such a tensor would copy its page
(the map is private): the file is never changed. ``runtime.mapped_weights`` later moves them into memory of the
process's own and gives each tensor's pages back (``unmap_pages``).

The format: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
(offsets relative to the end of the header), then the data.
"""

from __future__ import annotations

import collections
import json
import math
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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

# How many bytes of tensors the reader thread may hold ahead of the loader (``read_ahead``).
READ_AHEAD_BYTES = 128 << 20

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


# Where to read a tensor: ``into(name, dtype, shape)`` gives a contiguous CPU tensor of that dtype and shape (a
# slice of a larger buffer, say) or None for a fresh buffer of its own. ``shape`` is the cut's, when one is read.
Destination = Callable[[str, torch.dtype, list[int]], torch.Tensor | None]

# The bytes a column cut reads at a time: whole rows into a scratch buffer kept for the file, then their columns.
_SCRATCH_BYTES = 8 << 20


@dataclass(frozen=True)
class Cut:
    """The part of a tensor to read (a tensor-parallel rank's shard): the rows ``rows`` of its first dimension
    (ranges, concatenated in order), of them the columns ``cols`` (a 2-D tensor; None: all), then zero rows up to
    ``out_rows`` (None: none). Only those bytes are read, so a rank never holds the whole tensor: rows are one read
    each, columns go through a small scratch buffer. ``Cut(rows=(), out_rows=n)`` reads nothing (zeros)."""

    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int] | None = None
    out_rows: int | None = None

    def shape(self, full: list[int]) -> list[int]:
        """The cut's shape, of a tensor of shape ``full``; ``ValueError`` when it does not fit it."""
        n = sum(b - a for a, b in self.rows)
        rows_ok = full and all(0 <= a <= b <= full[0] for a, b in self.rows)
        cols_ok = self.cols is None or (len(full) == 2 and 0 <= self.cols[0] <= self.cols[1] <= full[1])
        if not rows_ok or not cols_ok or (self.out_rows is not None and self.out_rows < n):
            raise ValueError(f"cut {self} does not fit a tensor of shape {full}")
        rest = list(full[1:])
        if self.cols is not None:
            rest[0] = self.cols[1] - self.cols[0]
        return [n if self.out_rows is None else self.out_rows, *rest]


    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The same cut of a tensor already in memory (one read some other way: a GGUF checkpoint's)."""
        out = tensor.new_zeros(self.shape(list(tensor.shape)))
        at = 0
        for a, b in self.rows:
            out[at : at + b - a] = tensor[a:b] if self.cols is None else tensor[a:b, self.cols[0] : self.cols[1]]
            at += b - a
        return out


# Which part of a tensor to read: ``select(name, dtype, shape)`` gives a ``Cut`` or None for the whole tensor.
Select = Callable[[str, torch.dtype, list[int]], Cut | None]

# Whether a (whole) tensor is to be a view of the file's map: ``mapped(name, dtype, shape)``.
Mapped = Callable[[str, torch.dtype, list[int]], bool]

# madvise: map a range's pages now, reading them in, without a fault per page (Linux 5.14+; older kernels refuse
# it, and then the pages are touched one by one).
MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE


# Every live file map, by its first address (the maps go when their last view does).
_MAPS: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()


class _FileMap:
    """One file's private map, made at the first tensor that asks for it, as one uint8 tensor: every view shares
    its storage (so the parts of a merged projection that lie side by side in the file are seen as one block)."""

    def __init__(self, f: Any) -> None:
        self.size = os.fstat(f.fileno()).st_size
        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        _MAPS[self.bytes.data_ptr()] = self._map

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
        """The tensor at ``offset``, its pages mapped; None where its offset does not suit its dtype."""
        if offset % dtype.itemsize or nbytes == 0:
            return None
        start = offset - offset % _PAGE
        try:
            self._map.madvise(MADV_POPULATE_READ, start, offset + nbytes - start)
        except OSError:
            self.bytes[offset : offset + nbytes : _PAGE].sum()  # one read a page faults each in
        return self.bytes[offset : offset + nbytes].view(dtype).reshape(shape)


def _map_of(t: torch.Tensor) -> tuple[int, mmap.mmap] | None:
    for base, m in list(_MAPS.items()):
        if base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + len(m):
            return base, m
    return None


def is_mapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of a file map made here."""
    return t.device.type == "cpu" and _map_of(t) is not None


def unmap_pages(t: torch.Tensor) -> None:
    """Give back the pages wholly inside ``t``'s bytes of its file map (``MADV_DONTNEED``): they leave the
    resident set. Safe while something still reads them: the map is private and the file unchanged, so a read
    maps the same bytes in again."""
    found = _map_of(t)
    if found is None:
        return
    base, m = found
    lo = -(-(t.data_ptr() - base) // _PAGE) * _PAGE
    hi = (t.data_ptr() - base + t.nbytes) // _PAGE * _PAGE
    if hi > lo:
        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def iter_file(
    file: Path, into: Destination | None = None, select: Select | None = None, mapped: Mapped | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each tensor of ``file`` in the order of their data in the file (one sequential
    pass over the disk), each in a fresh CPU buffer of its stored dtype and shape, or in the one ``into`` gives,
    or (a whole tensor ``mapped`` names) as a view of the file's map; only the part ``select`` names, where it
    names one."""
    entries, start = read_header(file)
    order = sorted(entries, key=lambda n: (_offset(entries[n]), n))
    scratch: list[np.ndarray] = []  # column cuts' buffer, made at the first one
    file_map: list[_FileMap] = []  # made at the first mapped tensor
    with open(file, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):  # a larger read-ahead window off the disk
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for name in order:
            dtype, shape, offset = _entry(file, name, entries[name], start)
            view = None
            if mapped is not None and select is None and mapped(name, dtype, shape):
                view = _view(f, file_map, offset, dtype, shape)
            yield name, view if view is not None else _read(f, file, name, dtype, shape, offset, into, select, scratch)


def _entry(file: Path, name: str, entry: Any, start: int) -> tuple[torch.dtype, list[int], int]:
    """A header entry's dtype, shape and absolute byte offset; ``ValueError`` names what is wrong with it."""
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{file}: tensor {name!r} has a malformed or unsupported header entry {entry}") from exc
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise ValueError(f"{file}: tensor {name!r} spans {end - begin} bytes, its shape {shape} needs {nbytes}")
    return dtype, shape, start + begin


def _view(f: Any, file_map: list[_FileMap], offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
    """The tensor at ``offset`` as a view of the file's map (made at the first one); None where the file is
    truncated before its end (``_read`` says so: a map read past the end would kill the process with SIGBUS)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not file_map:
        file_map.append(_FileMap(f))
    if file_map[0].size < offset + nbytes:
        return None
    return file_map[0].view(offset, nbytes, dtype, shape)


def _offset(entry: Any) -> int:
    try:
        return int(entry["data_offsets"][0])
    except (KeyError, TypeError, ValueError, IndexError):
        return -1  # malformed: _read names it


def read_ahead(
    items: Iterator[tuple[str, torch.Tensor]], budget: int = READ_AHEAD_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items``, read ahead on a thread of their own while fewer than ``budget`` bytes wait (at least one tensor
    always may): reading (the copy out of the page cache or off the disk, and the page faults of the fresh
    buffer) overlaps with what the consumer does with the tensors before (packing them). The thread runs no torch
    op, so it adds no OpenMP team (``runtime.threads``). Its exception is raised here; closing this generator stops
    the thread. The waiting tensors are the loader's only transient memory beyond the tensor being packed."""
    ready: collections.deque[tuple[str, Any]] = collections.deque()
    cond = threading.Condition()
    waiting = [0]  # bytes read and not yet taken
    stop = threading.Event()

    def produce() -> None:
        try:
            while True:
                with cond:
                    cond.wait_for(lambda: stop.is_set() or not ready or waiting[0] < budget)
                    if stop.is_set():
                        return
                item = next(items, None)
                with cond:
                    if item is None:
                        ready.append(("done", None))
                    else:
                        waiting[0] += item[1].nbytes
                        ready.append(("item", item))
                    cond.notify_all()
                if item is None:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            with cond:
                ready.append(("error", exc))
                cond.notify_all()

    thread = threading.Thread(target=produce, name="weights-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            with cond:
                cond.wait_for(lambda: bool(ready))
                kind, value = ready.popleft()
                if kind == "item":
                    waiting[0] -= value[1].nbytes
                    cond.notify_all()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        with cond:
            stop.set()
            cond.notify_all()
        thread.join()


def _read(
    f: Any,
    file: Path,
    name: str,
    dtype: torch.dtype,
    shape: list[int],
    offset: int,
    into: Destination | None,
    select: Select | None,
    scratch: list[np.ndarray],
) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    cut = select(name, dtype, shape) if select is not None else None
    out_shape = cut.shape(shape) if cut is not None else shape
    out_bytes = math.prod(out_shape) * dtype.itemsize
    given = into(name, dtype, out_shape) if into is not None else None
    if given is not None:
        if given.dtype != dtype or list(given.shape) != out_shape or not given.is_contiguous():
            raise ValueError(f"{name}: destination {given.dtype} {list(given.shape)} for a {dtype} {out_shape} tensor")
        out = given.view(-1).view(torch.uint8) if out_bytes else torch.empty(0, dtype=torch.uint8)
    else:
        out = torch.empty(out_bytes, dtype=torch.uint8)
    view = memoryview(out.numpy())
    where = f"{file}: truncated: tensor {name!r}"
    if cut is None:
        _fill(f, offset, view, where)
    else:
        row = nbytes // shape[0] if shape[0] else 0  # bytes of one row of the stored tensor
        done = 0
        for a, b in cut.rows:
            if cut.cols is None:  # whole rows: one read
                _fill(f, offset + a * row, view[done : done + (b - a) * row], where)
                done += (b - a) * row
            else:
                span = ((a, b), cut.cols)
                done = _read_columns(f, offset, row, span, dtype.itemsize, view, done, scratch, where)
        out.numpy()[done:] = 0  # a vocabulary shard's padding rows, or a rank's zero bias
    return given if given is not None else out.view(dtype).reshape(out_shape)


def _fill(f: Any, offset: int, view: memoryview, where: str) -> None:
    """Read ``len(view)`` bytes at ``offset`` into ``view``."""
    f.seek(offset)
    done = 0
    while done < len(view):  # readinto may return less than asked (large reads, signals)
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{where} ends past the end of the file")
        done += n


def _read_columns(
    f: Any,
    data: int,
    row: int,
    span: tuple[tuple[int, int], tuple[int, int]],
    itemsize: int,
    out: memoryview,
    done: int,
    scratch: list[np.ndarray],
    where: str,
) -> int:
    """Columns ``span[1]`` of rows ``span[0]`` of the 2-D tensor at ``data``, into ``out`` from byte ``done``; whole
    rows are read into the scratch buffer, a block at a time (byte copies in numpy: the reader thread runs no torch
    op). Returns where the next row goes."""
    rows, cols = span
    if not scratch:
        scratch.append(np.empty(max(_SCRATCH_BYTES, row), dtype=np.uint8))
    buf = scratch[0]
    per = max(1, len(buf) // row)  # rows a block
    width = (cols[1] - cols[0]) * itemsize
    dest = np.frombuffer(out, dtype=np.uint8)
    for a in range(rows[0], rows[1], per):
        n = min(per, rows[1] - a)
        _fill(f, data + a * row, memoryview(buf)[: n * row], where)
        block = buf[: n * row].reshape(n, row)[:, cols[0] * itemsize : cols[1] * itemsize]
        dest[done : done + n * width].reshape(n, width)[:] = block
        done += n * width
    return done
