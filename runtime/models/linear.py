"""Linear layers that run through oneDNN with prepacked weights on CPU, in float32 and (where the CPU has bfloat16
matrix instructions) bfloat16.

``F.linear`` on CPU calls MKL's sgemm. On the 2-core AMD EPYC (AVX-512) reference machine, oneDNN's JIT kernels
over a weight reordered once into their blocked layout are 2-2.5x faster at every batch size we run, from one
decode row to a 2,048-token prefill chunk (SmolLM2-135M, 8 rows: 58 ms -> 26 ms of linear layers per decode step
on one thread), because a decode step streams all the weights and the packed layout streams them at about twice
the bandwidth. The results differ from MKL's in float rounding only (~1e-7 relative).

The packed copy is made once per weight, on first use or by ``prepack``, which the loader calls after the weights
are in (and, under tensor parallelism, sharded). ``prepack`` then releases the plain weight (the parameter becomes
a meta tensor of the same shape and dtype), one layer at a time, so that a served model holds each linear weight
once and loading never holds both copies of more than one layer. A weight another module still reads (an LM
head tied to the embedding) is not packed at all: its packed copy would be a second copy of the embedding (9% of
a 1B Llama's weights); it runs ``F.linear`` (or the small-row kernel), which on the 2-core AMD EPYC costs 11.2 ->
19.7 ms at 16 rows of a 1B model's 49152x2048 head and nothing at 1-4 rows. ``keep_plain=True`` (the engine's
``--keep-plain-weights``) keeps every plain weight beside its packed copy, for the small-row bfloat16 kernel below,
at twice the linear weights' memory. ``RADIXSERVE_ONEDNN_LINEAR=0`` turns packing off (plain weights, ``F.linear``).

In bfloat16, on a CPU with AMX or AVX-512 BF16 (the 2-core Intel Xeon with AMX, 2 threads), oneDNN's packed
kernels beat ``F.linear`` (which reaches oneDNN without the reorder) 1.4-2x up to 64 rows: 8 rows of a
576x1536 projection 95 -> 68 us, the 49152x576 LM head 3.0 -> 1.4 ms; at 512 rows both run at the AMX units'
rate (``bench/linear_kernels.py``). Without those instructions bfloat16 products are emulated and ``F.linear``
is kept. Anything else (CUDA, float16, autograd, a torch without these oneDNN ops) takes ``F.linear``.

Where the CPU has AVX-512 BF16 but no AMX (the 2-core AMD EPYC, Zen 4), and with AMX where that measured faster
(``runtime.models.bf16_layout``), bfloat16 weights are served by kernels of their own instead
(``runtime.models.bf16_kernels``): packed in pairs of K when released, or plain.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.runtime import envs
from radixserve.runtime.cpu_features import native_bf16
from radixserve.runtime.models import bf16_kernels, quant
from radixserve.runtime.models.bf16_kernels import bf16_kernel_max_rows, plain_bf16_weights
from radixserve.runtime.models.loading import StagingPool
from radixserve.runtime.models.quant import QuantParts, QuantTensor
from radixserve.runtime.safetensors_read import unmap_pages

logger = logging.getLogger("radixserve.model")

# Batch-size hint for the weight's blocked layout; measured as good for 1 to 2,048 rows.
PACK_BATCH_HINT = 8


# Dtypes the packed path may serve, with the tolerance of its check against ``F.linear``.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@functools.cache
def onednn_usable(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has the oneDNN linear ops for ``dtype`` and they agree with ``F.linear`` (checked once
    per dtype); bfloat16 only on a CPU with native bfloat16 matrix instructions."""
    if not envs.onednn_linear() or dtype not in _TOLERANCE:
        return False
    if dtype == torch.bfloat16 and (not native_bf16() or plain_bf16_weights()):
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 64), (48, 64), (48,)))
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        tol = _TOLERANCE[dtype]
        ok = torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)
    except (AttributeError, RuntimeError) as exc:
        logger.info("oneDNN %s linear unavailable (%s); using F.linear", dtype, exc)
        return False
    if not ok:
        logger.warning("oneDNN %s linear disagrees with F.linear on this machine; using F.linear", dtype)
    return ok


_NO_BIAS = torch.empty(0)


def _meta_weight(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A weight of this shape and dtype with no data: what stays of a weight served from elsewhere (its packed copy,
    its parts, its tied head's copy), so that shapes and dtypes still read right."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
_PACK_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Quantizable:
    """A weight that may be kept in GGUF blocks (``set_quantized``) instead of as a float parameter."""

    qtype: str | None = None
    qshape: tuple[int, int] | None = None
    qpacked: bool = False
    # A linear layer repacks its blocks for the CPU kernel (``QuantTensor.pack``); an embedding keeps what it is
    # given (its lookups read either layout), so that a tied head and embedding share one packed copy.
    _pack_blocks: bool = False

    _qparts: tuple[tuple[str, tuple[int, int], bool], ...] = ()  # a QuantParts weight: each part's type, shape

    def set_quantized(self, w: QuantTensor | QuantParts) -> None:
        """Keep the weight as ``w``'s blocks; the float parameter goes (it is never materialized). A ``QuantParts``
        weight keeps each part's data as a buffer of its own (``qdata``, ``qdata1``, ...)."""
        if self._pack_blocks:
            w = w.pack()
        parts = w.parts if isinstance(w, QuantParts) else (w,)
        parts = tuple(p.owned() for p in parts)  # what is kept as it came must not hold the file's map
        w = QuantParts(parts) if isinstance(w, QuantParts) else parts[0]
        self.register_parameter("weight", None)  # type: ignore[attr-defined]
        for i, part in enumerate(parts):
            self.register_buffer(f"qdata{i or ''}", part.data, persistent=False)  # type: ignore[attr-defined]
        self._qparts = tuple((p.qtype, p.shape, p.packed) for p in parts) if len(parts) > 1 else ()
        self.qtype, self.qshape = w.qtype, w.shape
        self.qpacked = all(p.packed for p in parts)

    @property
    def quant(self) -> QuantTensor | QuantParts | None:
        if self.qtype is None:
            return None
        if self._qparts:
            data = [getattr(self, f"qdata{i or ''}") for i in range(len(self._qparts))]
            return QuantParts(tuple(QuantTensor(t, d, s, p) for d, (t, s, p) in zip(data, self._qparts, strict=True)))
        return QuantTensor(self.qtype, self.qdata, self.qshape, self.qpacked)  # type: ignore[attr-defined,arg-type]


class Linear(_Quantizable, nn.Linear):
    """``nn.Linear`` that runs on a oneDNN-packed copy of its weight where that is faster (see the module doc), or
    on the weight's GGUF blocks (``runtime.models.quant``) when it is kept quantized."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None
    _small: object | None = None  # the small-row bfloat16 kernel for this weight, or None (see forward)
    _small_key: int | None = None  # data_ptr of the weight ``_small`` was decided for
    _small_weights: list[torch.Tensor] | None = None  # what ``_small`` multiplies: the weight, or its parts
    # Only the packed copy is left (``release_plain``): ``weight`` is a meta tensor, ``_packed`` is the weight.
    _released: bool = False
    # ``_packed`` is in ``csrc/bf16_packed.cpp``'s layout (AVX-512 BF16 without AMX) rather than oneDNN's.
    _bf16_packed: bool = False
    _pack_allowed: bool = True  # False: this weight is shared (a tied head) and is not packed (see prepack)
    _pack_blocks = True
    # The weight as consecutive blocks of rows (``set_plain_parts``), each a tensor of its own; () when whole.
    _plain_parts: tuple[torch.Tensor, ...] = ()

    def reset_parameters(self) -> None:
        """No random initialization: the weights always come from a checkpoint (and on the meta device the
        initializers would import torch's reference-op machinery, seconds at every start)."""


    # (packed kernel, blocks, type code, K, N) for a weight of one packed part, made once (``_direct_call``).
    _direct: tuple | None = None

    def _direct_call(self, x: torch.Tensor) -> tuple | None:
        """The packed block kernel's call for ``x``, where ``quant.linear`` would make that very call: one packed
        part and a 2-D float32 or bfloat16 ``x`` on CPU that does not unpack for a GEMM (``quant._unpacks_for_gemm``).
        A decode step makes ~120 linear calls; going through ``quant.linear`` (a ``QuantTensor`` built per call,
        its checks, reshapes) cost ~16 us of Python each, ~2 ms a step of SmolLM2 at one row."""
        if not self.qpacked or self._qparts or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        data = self._buffers["qdata"]
        direct = self._direct
        if direct is None or direct[1] is not data:
            assert self.qtype is not None and self.qshape is not None and data is not None
            op = quant.packed_ops()
            if op is None or data.device.type != "cpu":
                return None
            n, k = self.qshape
            direct = self._direct = (op.linear, data, quant.QTYPES[self.qtype], k, n)
        return None if quant.packed_unpacks_for_gemm(x) else direct

    def set_plain_parts(self, parts: list[torch.Tensor]) -> None:
        """Serve the weight as ``parts``, its blocks of rows in output order, without concatenating them: a merged
        projection whose parts are views of the checkpoint's memory map, in the file's order rather than the
        model's. The parameter becomes a meta tensor of the whole shape (shapes read right); the parts are
        buffers (``wpart0``, ...). Only where bfloat16 weights are served plain (``plain_bf16_weights``)."""
        w = self.weight
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if tuple(w.shape) != shape:
            raise ValueError(f"weight parts make {shape}, the layer is {tuple(w.shape)}")
        self.weight = _meta_weight(shape, parts[0].dtype)
        for i, part in enumerate(parts):
            self.register_buffer(f"wpart{i}", part, persistent=False)
        self._plain_parts = tuple(parts)
        self._small_key = None

    def _eligible(self) -> bool:
        w = self.weight
        if w is None or not self._pack_allowed or self._plain_parts:  # quantized, shared, or in parts
            return False
        return w.device.type == "cpu" and not torch.is_grad_enabled() and onednn_usable(w.dtype)

    def pack(self) -> torch.Tensor | None:
        """The packed copy of the current weight, (re)made if the weight changed since the last one; ``None`` where
        oneDNN does not apply (then ``forward`` takes ``F.linear``)."""
        if self._released:
            return self._packed
        w = self.weight
        # In-place writes (loading) bump _version; replacing the tensor (sharding, casts) moves data_ptr. (A weight
        # made inside inference_mode has no version counter: replace such a weight rather than write into it.)
        key = (w.data_ptr(), -1 if w.is_inference() else w._version)
        if key != self._packed_key:
            self._packed, self._packed_key = None, key
            if self._eligible():
                try:
                    with torch.inference_mode():
                        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
                except RuntimeError as exc:  # an odd shape this oneDNN build refuses: this layer keeps F.linear
                    logger.info("oneDNN cannot pack a %s weight (%s); using F.linear for it", tuple(w.shape), exc)
        return self._packed

    def release_plain(self) -> bool:
        """Keep only the packed copy of the weight (made now if needed); the parameter becomes a meta tensor of the
        same shape and dtype, so shapes still read right but its data is gone for good. False (nothing released)
        where there is no packed copy. Call it only once the weight is final: loaded, sharded, cast."""
        if self._released:
            return True
        if self._pack_allowed and self._release_to_bf16_packed():
            return True
        packed = self.pack() if self._eligible() else None
        if packed is None:
            return False
        w = self.weight
        self.weight = _meta_weight(w.shape, w.dtype)
        self._released, self._small = True, None
        return True

    def _release_to_bf16_packed(self) -> bool:
        """Where the bfloat16 weight (its parts) packs for ``csrc/bf16_packed.cpp`` (``bf16_kernels.packs``): pack it,
        drop the plain weight (a meta parameter of the same shape stays; mapped pages go back, ``unmap_pages``) and
        return True."""
        w = self.weight
        if w is None or w.device.type == "meta" and not self._plain_parts:
            return False
        parts = self._plain_parts or (w,)
        if not bf16_kernels.packs(parts):
            return False
        with torch.inference_mode():  # on every core: the load waits for it (1B: 2 GB, ~0.6 s on two)
            packed = bf16_kernels.packed_ops().pack([p.detach() for p in parts], _PACK_THREADS)
        self.weight = _meta_weight(w.shape, w.dtype)
        for i in range(len(self._plain_parts)):
            del self._buffers[f"wpart{i}"]
        self._plain_parts = ()
        self._packed, self._bf16_packed, self._released, self._small = packed, True, True, None
        for p in parts:
            unmap_pages(p)  # a part mapped from the checkpoint: its pages leave the resident set
        return True

    def silu_mul_packed(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] projection (equal parts of whole 16-row blocks, packed in pairs of K)
        in one kernel, with the bits of ``fused.silu_mul`` over ``forward``'s output."""
        assert self._bf16_packed, "only a weight packed in pairs of K multiplies gated"
        return self._packed_call(x, gated=True)

    def _packed_call(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """The product over the weight packed in pairs of K (``gated``: silu(gate) * up), ``x``'s rows in any leading
        shape: the pairs' kernel, or oneDNN's GEMM over the weight unpacked for a step of many rows (with AMX,
        ``bf16_kernels.unpack_from_rows``)."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if x2.shape[0] >= bf16_kernels.unpack_from_rows():
            y = bf16_kernels.unpacked_product(x2, self._packed, self.bias, gated)
        else:
            ops = bf16_kernels.packed_ops()
            bias = self.bias if self.bias is not None else _NO_BIAS
            y = (ops.linear_silu_mul if gated else ops.linear)(x2, self._packed, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            direct = self._direct_call(x)
            if direct is not None:
                y = direct[0](x, *direct[1:])
                return y if self.bias is None else y + self.bias
            return quant.linear(x, self.quant, self.bias)  # type: ignore[arg-type]
        if self._released:
            if self._bf16_packed:
                return self._packed_call(x)
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        parts = self._plain_parts
        w = self.weight
        # Few rows: the bfloat16 kernel, on the weight in place. What it needs of the weight is checked once per
        # weight (a decode step makes ~120 of these calls; each check is a few microseconds of Python).
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu and x.shape[0] <= bf16_kernel_max_rows():
            key = parts[0].data_ptr() if parts else w.data_ptr()
            if key != self._small_key:
                self._small, self._small_key = bf16_kernels.weight_kernel(parts or (w,)), key
                self._small_weights = list(parts or (w,))
            if self._small is not None and not torch.is_grad_enabled():
                bias = self.bias if self.bias is not None else _NO_BIAS
                return self._small(x.contiguous(), self._small_weights, bias)
        if parts:  # each part's product, side by side (the copy is of the output, a few rows)
            y = torch.cat([F.linear(x, part) for part in parts], dim=-1)
            return y if self.bias is None else y + self.bias
        packed = self.pack() if self._eligible() else None
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


class Embedding(_Quantizable, nn.Embedding):
    """``nn.Embedding`` without random initialization, for the same reason as ``Linear``; its weight may be kept in
    GGUF blocks, of which a lookup unpacks only the rows it reads, or be the packed weight of its tied head
    (``read_packed_rows``)."""

    _bf16_rows: torch.Tensor | None = None  # the tied head's weight packed in pairs (csrc/bf16_packed.cpp)

    def reset_parameters(self) -> None:
        pass

    def read_packed_rows(self, packed: torch.Tensor) -> None:
        """Look rows up in ``packed``, the tied head's bfloat16 weight packed in pairs of K (the same values), and
        let the plain weight go (a meta parameter of its shape stays): the model holds the matrix once."""
        w = self.weight
        self.weight = _meta_weight(w.shape, w.dtype)
        self._bf16_rows = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            return quant.embedding(ids, self.quant)  # type: ignore[arg-type]
        if self._bf16_rows is not None:  # (the kernel takes int64 ids, as the engine's are)
            return bf16_kernels.packed_ops().rows(self._bf16_rows, ids if ids.dtype == torch.int64 else ids.long())
        return super().forward(ids)


class LoadPacker:
    """The loader's ``on_weight``: a ``Linear`` whose weight just arrived is packed and its plain copy released
    (see ``prepack``) on one of ``workers`` threads, while the loader goes on reading; at most ``workers`` weights
    wait to be packed (their plain copies are the memory this costs). oneDNN's reorder into the packed layout
    runs at ~0.8 GB/s on one thread (2-core AMD EPYC), slower than the disk: a 3B model's 5.5 GB took 7.7 s of
    its load on the loader's thread alone. Each worker runs single-threaded ops (the loader holds one intra-op
    thread, ``runtime.threads.one_intra_op_thread``), so no extra OpenMP team outlives the load. A tied head is
    never loaded this way (it takes the embedding's weight), so nothing shared is released here."""

    def __init__(self, workers: int = 2, staging: StagingPool | None = None) -> None:
        self.staging = staging
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-pack")
        self.slots = threading.Semaphore(workers)
        self.jobs: list[Future[None]] = []

    def __call__(self, module: nn.Module) -> None:
        if not isinstance(module, Linear) or module.qtype is not None:
            return
        self.slots.acquire()
        self.jobs.append(self.pool.submit(self._pack, module))

    def _pack(self, module: Linear) -> None:
        try:
            plain = module.weight.detach()
            with torch.inference_mode():
                released = module.release_plain()
            if released and self.staging is not None:
                self.staging.give(plain)  # its buffer reads the next weight of its size
        finally:
            self.slots.release()

    def finish(self) -> None:
        """Wait for every packing job (raising the first failure) and stop the workers."""
        try:
            for job in self.jobs:
                job.result()
        finally:
            self.pool.shutdown(wait=True)
            if self.staging is not None:
                self.staging.clear()


def prepack(model: nn.Module, *, keep_plain: bool = False) -> None:
    """Pack every ``Linear`` of ``model`` now (after loading, sharding or casting: the weights must be final), so
    that the first step does not pay for it and the memory is taken before the KV pool is sized. Each plain
    weight is released as soon as its packed copy exists (see the module doc) unless ``keep_plain``; a weight
    another module (a tied embedding) also holds is not packed unless ``keep_plain``."""
    shared = {
        p.data_ptr()
        for m in model.modules()
        if not isinstance(m, Linear)
        for p in m.parameters(recurse=False)
        if p.device.type != "meta"
    }
    # A head tied to a plain embedding (the same parameter) that packs in pairs of K: the embedding reads its rows
    # from the packed copy instead (``Embedding.read_packed_rows``), so that the head too runs the packed kernel.
    tied = {
        id(m.weight): m
        for m in model.modules()
        if type(m) is Embedding and m.qtype is None and m.weight is not None and m.weight.device.type != "meta"
    }
    with torch.inference_mode():
        for module in model.modules():
            if not isinstance(module, Linear) or module.qtype is not None:
                continue
            if module._released:
                continue
            module._pack_allowed = keep_plain or module.weight.data_ptr() not in shared
            embedding = tied.get(id(module.weight))
            if not keep_plain and embedding is not None and module._release_to_bf16_packed():
                embedding.read_packed_rows(module._packed)
            elif keep_plain or not module._pack_allowed:
                module.pack()  # (drops a stale packed copy where packing is no longer allowed)
            else:
                module.release_plain()
