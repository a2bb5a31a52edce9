"""A second tier under the radix cache: KV that leaves the pool goes to files, is found again by prefix, and
outlives the process (a warm restart).

Chunks. A sequence's KV is kept in chunks of ``chunk_tokens`` tokens at fixed positions ``[kC, (k+1)C)``. Chunk
k's key hashes the model key and every token up to the chunk's end, as a chain (``key_k = H(key_{k-1}, tokens of
chunk k)``), so a key names exactly one prefix's KV under one set of weights. The tier is a content-addressed store
of such chunks: the chain of keys along a prompt is the path a tree would hold, so the tier needs no tree of its
own, and a restarted server finds every chunk by hashing its prompts. (An evicted radix node keeps its place in
the sense that matters: a request that reaches its tokens loads them back; a radix tree of evicted nodes would have
to be written and reloaded consistently with the files, which the chain gives for free.)

What is kept: whole chunks only. When a radix leaf is evicted, every chunk that ends inside it is saved (the part
of such a chunk in its ancestors is still in the pool then: a parent leaves the tree only after its children); the
tokens after the last chunk boundary are dropped, at most ``chunk_tokens - 1`` per leaf.

Threads. The scheduler thread calls ``save`` (copies the chunk's KV out of the pool at once, since its slots are
about to be reused, and queues it), ``prefetch``, ``load`` and ``keys``; one writer thread writes the queued chunks
and deletes the least recently used files beyond ``capacity_bytes``; one reader thread reads ahead the chunks of
prompts that wait for admission (``prefetch``), so that ``load`` mostly copies from memory. The index, the queue,
the read-ahead and the counters are shared under one lock; the pool is touched only by the scheduler thread
(``load`` writes slots that were just allocated and that no request has yet).

Never blocking the engine: a chunk waiting to be written is served from memory; past ``max_pending_bytes`` of
queued chunks a save is dropped (counted), never waited for. A file is written under a temporary name and renamed
when complete (``runtime.kv_tier_file``), so a crash leaves the previous state or an ignorable ``.tmp``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.kv_tier_file import SUFFIX, TMP_SUFFIX, ChunkError, read_chunk, write_chunk

logger = logging.getLogger("radixserve.kv_tier")

# What a KV file's validity depends on besides the files of the weights; bump when the KV layout changes.
FORMAT_VERSION = 1
# Files of these kinds in the model folder identify its weights (and its config: rope settings, layout).
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")


def model_key(
    folder: Path,
    dtype: torch.dtype,
    quantization: str,
    kv_shape: tuple[int, int, int],
    tp_rank: int,
    tp_size: int,
    weights: str = "checkpoint",
) -> str:
    """A hash of everything that makes KV valid: the weight and config files (name, size, modification time), the
    dtype, the weight format, the KV layout (layers, KV heads, head size), the tensor-parallel rank, and where the
    weights came from (``weights``: "checkpoint", or "dummy:<seed>" for ``--load-format dummy``, whose random
    weights share the folder's files but none of its KV)."""
    files = []
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix in _WEIGHT_SUFFIXES:
                st = path.stat()
                files.append((path.name, st.st_size, st.st_mtime_ns))
    ident = {
        "format": FORMAT_VERSION,
        "files": files,
        "dtype": str(dtype),
        "quantization": quantization,
        "kv": list(kv_shape),
        "tp": [tp_rank, tp_size],
        "weights": weights,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def chain_keys(
    model_key: str,
    tokens: Sequence[int],
    chunk_tokens: int,
    start_chunk: int = 0,
    end_chunk: int | None = None,
    prev: str | None = None,
) -> list[str]:
    """Keys of chunks ``start_chunk .. end_chunk - 1`` of ``tokens`` (default: every complete chunk): chunk k's key
    hashes chunk k - 1's key (the model key's hash for chunk 0) with chunk k's tokens. ``prev``, the key of chunk
    ``start_chunk - 1`` when the caller has it, saves hashing the chunks before."""
    c = chunk_tokens
    end = len(tokens) // c if end_chunk is None else end_chunk
    out: list[str] = []
    first = start_chunk if prev is not None else 0
    key = bytes.fromhex(prev) if prev is not None else hashlib.blake2b(model_key.encode(), digest_size=16).digest()
    for k in range(first, end):
        chunk = tokens[k * c : (k + 1) * c]
        key = hashlib.blake2b(key + struct.pack(f"<{c}I", *chunk), digest_size=16).digest()
        if k >= start_chunk:
            out.append(key.hex())
    return out


@dataclass(frozen=True)
class TierConfig:
    directory: Path  # the tier's files go to ``directory / model_key``
    capacity_bytes: int
    chunk_tokens: int
    model_key: str
    max_pending_bytes: int = 1 << 30


class KVTier:
    """The chunk store; see the module doc for what it keeps, its threads and its guarantees.

    Invariants: ``stored_bytes`` is the size of the files in the index and stays ``<= capacity_bytes`` once the
    writer has caught up (``check``); a key is in the index only once its file is complete; a key is pending
    (served from memory) from ``save`` until its file is written or the write failed.
    """

    def __init__(self, config: TierConfig, pool: KVPool) -> None:
        self.config = config
        self.pool = pool
        self.chunk_tokens = config.chunk_tokens
        layers, _, heads, _, head_dim = pool._kv.shape
        self.shape = (layers, 2, heads, config.chunk_tokens, head_dim)
        self.chunk_bytes = pool._kv.element_size() * layers * 2 * heads * config.chunk_tokens * head_dim
        if config.capacity_bytes < self.chunk_bytes:
            raise ValueError(
                f"--hicache-size holds less than one chunk ({self.chunk_bytes / 2**20:.1f} MiB of KV); raise it"
            )
        self.dir = config.directory / config.model_key
        # One process per folder: another's scan would delete this one's unfinished writes, and each keeps its own
        # size account. The lock goes with the process (flock), so a killed server never holds it.
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.dir / ".lock", "w")  # noqa: SIM115 - held for the tier's lifetime
        except OSError as exc:
            raise ValueError(f"--hicache-dir {config.directory} cannot hold the KV tier: {exc}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ValueError(
                f"another radixserve process uses the KV tier in {self.dir}; give each server its own --hicache-dir"
            ) from None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._stored = 0
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._queue: deque[tuple[str, list[int]]] = deque()
        # Chunks being read ahead of their request's admission (``prefetch``), oldest first.
        self._prefetched: OrderedDict[str, Future[torch.Tensor]] = OrderedDict()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="radixserve-kv-prefetch")
        self._closing = False
        self.stats = dict.fromkeys(
            ("hit_tokens", "loads", "load_seconds", "bytes_read", "bytes_written", "chunks_written")
            + ("writes_dropped", "write_errors", "files_skipped", "prefetch_reads"),
            0,
        )
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="radixserve-kv-tier", daemon=True)
        self._writer.start()

    # --- keys ---------------------------------------------------------------------------------------------
    def keys(
        self, tokens: Sequence[int], start_chunk: int = 0, end_chunk: int | None = None, prev: str | None = None
    ) -> list[str]:
        """Keys of chunks ``start_chunk .. end_chunk - 1`` of ``tokens`` (``chain_keys`` under this model)."""
        return chain_keys(self.config.model_key, tokens, self.chunk_tokens, start_chunk, end_chunk, prev)

    def has_room(self) -> bool:
        """Whether a ``save`` now would be queued rather than dropped for want of queue space."""
        with self._lock:
            return self._pending_bytes + self.chunk_bytes <= self.config.max_pending_bytes

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    # --- save ---------------------------------------------------------------------------------------------
    def save(self, key: str, k: int, tokens: Sequence[int], slots: Sequence[int]) -> bool:
        """Copy chunk ``k`` (key ``key``) of a cached path (``tokens`` and their ``slots``) out of the pool and
        queue it for writing; ``False`` when it is already kept or the queue is full (then it is not kept)."""
        with self._lock:
            if key in self._index or key in self._pending or self._closing:
                return False
            if self._pending_bytes + self.chunk_bytes > self.config.max_pending_bytes:
                self.stats["writes_dropped"] += 1
                return False
        c = self.chunk_tokens
        idx = torch.tensor(slots[k * c : (k + 1) * c], dtype=torch.long, device=self.pool._kv.device)
        kv = self.pool._kv.index_select(3, idx).cpu()
        with self._lock:
            self._pending[key] = kv
            self._pending_bytes += self.chunk_bytes
            self._queue.append((key, list(tokens[k * c : (k + 1) * c])))
            self._wake.notify_all()
        return True

    # --- load ---------------------------------------------------------------------------------------------
    def load(self, keys: list[str], tokens: Sequence[int], first_chunk: int, start: int, slots: list[int]) -> int:
        """Write chunks ``first_chunk, first_chunk + 1, ...`` (``keys``) of ``tokens`` into ``slots``, from
        position ``start`` on (inside the first chunk); stops at the first chunk that is missing or not valid.
        Returns the position loaded up to (``start`` when nothing was)."""
        c = self.chunk_tokens
        t0 = time.perf_counter()
        pos = start
        read = 0
        for i, key in enumerate(keys):
            k = first_chunk + i
            chunk_tokens = list(tokens[k * c : (k + 1) * c])
            with self._lock:
                kv = self._pending.get(key)
                on_disk = key in self._index
                if on_disk:
                    self._index.move_to_end(key)
                fut = self._prefetched.pop(key, None)
            if kv is None:
                if not on_disk and fut is None:
                    break
                try:
                    kv = self._prefetched_or_read(fut, on_disk, key, chunk_tokens)
                except ChunkError as exc:
                    if on_disk:  # else evicted since its read-ahead: nothing to forget
                        self._forget(key, f"skipped KV chunk file {key}{SUFFIX}: {exc}")
                    break
                read += self.chunk_bytes
            lo = pos - k * c
            idx = torch.tensor(slots[pos - start : pos - start + c - lo], dtype=torch.long, device=self.pool._kv.device)
            self.pool._kv.index_copy_(3, idx, kv[:, :, :, lo:].to(self.pool._kv.device))
            pos = (k + 1) * c
        if pos > start:
            with self._lock:
                self.stats["hit_tokens"] += pos - start
                self.stats["loads"] += 1
                self.stats["bytes_read"] += read
                self.stats["load_seconds"] += time.perf_counter() - t0
        return pos

    def _prefetched_or_read(
        self, fut: Future[torch.Tensor] | None, on_disk: bool, key: str, tokens: list[int]
    ) -> torch.Tensor:
        """The chunk from its read-ahead, else read now. A read-ahead that failed may have read a file since
        replaced (evicted, then saved again): the file is read again before it is judged."""
        if fut is not None:
            try:
                return fut.result()
            except ChunkError:
                if not on_disk:
                    raise
        return self._read(key, tokens)

    def _read(self, key: str, tokens: list[int]) -> torch.Tensor:
        return read_chunk(self.dir / f"{key}{SUFFIX}", self.config.model_key, key, tokens, self.shape,
                          self.pool._kv.dtype)  # fmt: skip

    # --- prefetch -----------------------------------------------------------------------------------------
    def prefetch(self, keys: list[str], tokens: Sequence[int], first: int) -> int:
        """Start reading chunks ``first, first + 1, ...`` (``keys``) of ``tokens`` that the tier holds on disk, on
        the reader thread: a request's prompt when it arrives, past what the radix tree holds, so that its
        admission finds them in memory. At most ``max_pending_bytes / 2`` are held this way (the oldest finished
        reads make room). Returns how many reads were started."""
        c = self.chunk_tokens
        limit = max(1, self.config.max_pending_bytes // 2 // self.chunk_bytes)
        started = 0
        with self._lock:
            if self._closing:
                return 0
            for k, key in enumerate(keys, start=first):
                if key in self._pending or key in self._prefetched:
                    continue
                if key not in self._index:
                    break
                while len(self._prefetched) >= limit and next(iter(self._prefetched.values())).done():
                    self._prefetched.popitem(last=False)  # a read no admission took (an aborted request)
                if len(self._prefetched) >= limit:
                    break
                chunk_tokens = list(tokens[k * c : (k + 1) * c])
                self._prefetched[key] = self._reader.submit(self._read, key, chunk_tokens)
                started += 1
            self.stats["prefetch_reads"] += started
        return started

    # --- lifecycle ----------------------------------------------------------------------------------------
    def drain(self, timeout: float) -> bool:
        """Wait until every queued chunk is written (or ``timeout`` passes); ``True`` when the queue is empty."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (for up to ``timeout`` seconds), then stop the writer; later saves are refused."""
        done = self.drain(timeout)
        with self._lock:
            self._closing = True
            lost = len(self._queue)
            self._wake.notify_all()
        self._writer.join(timeout=max(1.0, timeout))
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._lock_file.close()
        if not done:
            logger.warning("KV tier: %d chunks were not written before the deadline; they are not kept", lost)

    def info(self) -> dict[str, float]:
        with self._lock:
            return {
                **self.stats,
                "stored_chunks": len(self._index),
                "stored_bytes": self._stored,
                "capacity_bytes": self.config.capacity_bytes,
                "pending_bytes": self._pending_bytes,
            }

    def check(self) -> None:
        """Raise ``RuntimeError`` when the tier's own accounting is off or its size bound is exceeded."""
        with self._lock:
            total = sum(self._index.values())
            if total != self._stored:
                raise RuntimeError(f"KV tier: index holds {total} bytes but {self._stored} are counted")
            if self._stored > self.config.capacity_bytes:
                raise RuntimeError(f"KV tier: {self._stored} bytes stored over the bound {self.config.capacity_bytes}")
            if self._pending_bytes != self.chunk_bytes * len(self._pending):
                raise RuntimeError("KV tier: pending bytes do not match the pending chunks")

    # --- internals ----------------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the chunk files a previous run left (oldest first) and delete its unfinished writes; other files
        in the folder are left alone."""
        files, tmp = [], 0
        for path in self.dir.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)
                tmp += 1
            elif path.suffix == SUFFIX and len(path.stem) == 32:
                st = path.stat()
                files.append((st.st_mtime_ns, path.stem, st.st_size))
        for _, key, size in sorted(files):
            self._index[key] = size
            self._stored += size
        self._unlink(self._pop_over_capacity())
        if tmp:
            logger.warning("KV tier: removed %d unfinished chunk writes left by an earlier run", tmp)
        if files:
            logger.info(
                "KV tier: %d chunks (%.1f MiB) kept from an earlier run in %s", len(files), self._stored / 2**20,
                self.dir,
            )  # fmt: skip

    def _forget(self, key: str, reason: str) -> None:
        logger.warning("KV tier: %s", reason)
        with self._lock:
            self.stats["files_skipped"] += 1
            size = self._index.pop(key, None)
            if size is not None:
                self._stored -= size
        (self.dir / f"{key}{SUFFIX}").unlink(missing_ok=True)

    def _pop_over_capacity(self) -> list[str]:
        """Drop the least recently used chunks from the index until it fits the bound (under the lock, so the bound
        holds whenever the lock is free); the caller deletes their files."""
        victims = []
        while self._stored > self.config.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._stored -= size
            victims.append(key)
        return victims

    def _unlink(self, keys: list[str]) -> None:
        for key in keys:
            (self.dir / f"{key}{SUFFIX}").unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing:  # close() waited for the queue as long as it could
                    return
                key, tokens = self._queue.popleft()
                kv = self._pending[key]
            try:
                size = write_chunk(self.dir / f"{key}{SUFFIX}", self.config.model_key, key, tokens, kv)
            except OSError as exc:
                size = -1
                if self.stats["write_errors"] % 100 == 0:  # a full disk fails every write: say so, not 10^4 times
                    logger.warning("KV tier: writing a chunk failed (%s); it is not kept (%d failures so far)", exc,
                                   self.stats["write_errors"] + 1)  # fmt: skip
            victims: list[str] = []
            with self._lock:
                del self._pending[key]
                self._pending_bytes -= self.chunk_bytes
                if size >= 0:
                    self._index[key] = size
                    self._stored += size
                    self.stats["bytes_written"] += size
                    self.stats["chunks_written"] += 1
                    victims = self._pop_over_capacity()
                else:
                    self.stats["write_errors"] += 1
                self._wake.notify_all()
            self._unlink(victims)
