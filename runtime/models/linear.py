"""Linear layers that run through oneDNN with prepacked weights on CPU in float32.

``F.linear`` on CPU calls MKL's sgemm. On the 2-core AMD EPYC (AVX-512) reference machine, oneDNN's JIT kernels
over a weight reordered once into their blocked layout are 2-2.5x faster at every batch size we run, from one
decode row to a 2,048-token prefill chunk (SmolLM2-135M, 8 rows: 58 ms -> 26 ms of linear layers per decode step
on one thread), because a decode step streams all the weights and the packed layout streams them at about twice
the bandwidth. The results differ from MKL's in float rounding only (~1e-7 relative).

The packed copy is made once per weight (``prepack``, which the loader calls, or on first use) and remade whenever
the weight changes (loading, tensor-parallel sharding, a dtype cast), so the parameters stay ordinary tensors with
HF names. It costs a second copy of the linear weights in memory; ``RADIXSERVE_ONEDNN_LINEAR=0`` turns it off.
Anything else (CUDA, bfloat16, autograd, a torch without these oneDNN ops) takes ``F.linear``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.runtime import envs
from radixserve.runtime.models import quant
from radixserve.runtime.models.quant import QuantTensor

logger = logging.getLogger("radixserve.model")

# Batch-size hint for the weight's blocked layout; measured as good for 1 to 2,048 rows.
PACK_BATCH_HINT = 8


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch has the oneDNN linear ops and they agree with ``F.linear`` (checked once)."""
    if not envs.onednn_linear():
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen) for shape in ((5, 64), (48, 64), (48,)))
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        ok = torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    except (AttributeError, RuntimeError) as exc:
        logger.info("oneDNN linear unavailable (%s); using F.linear", exc)
        return False
    if not ok:
        logger.warning("oneDNN linear disagrees with F.linear on this machine; using F.linear")
    return ok


class _Quantizable:
    """A weight that may be kept in GGUF blocks (``set_quantized``) instead of as a float parameter."""

    qtype: str | None = None
    qshape: tuple[int, int] | None = None

    def set_quantized(self, w: QuantTensor) -> None:
        """Keep the weight as ``w``'s blocks; the float parameter goes (it is never materialized)."""
        self.register_parameter("weight", None)  # type: ignore[attr-defined]
        self.register_buffer("qdata", w.data, persistent=False)  # type: ignore[attr-defined]
        self.qtype, self.qshape = w.qtype, w.shape

    @property
    def quant(self) -> QuantTensor | None:
        if self.qtype is None:
            return None
        return QuantTensor(self.qtype, self.qdata, self.qshape)  # type: ignore[attr-defined,arg-type]


class Linear(_Quantizable, nn.Linear):
    """``nn.Linear`` that runs on a oneDNN-packed copy of its weight where that is faster (see the module doc), or
    on the weight's GGUF blocks (``runtime.models.quant``) when it is kept quantized."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None

    def reset_parameters(self) -> None:
        """No random initialization: the weights always come from a checkpoint (and on the meta device the
        initializers would import torch's reference-op machinery, seconds at every start)."""


    def _eligible(self) -> bool:
        w = self.weight
        if w is None:  # quantized
            return False
        return w.device.type == "cpu" and w.dtype == torch.float32 and not torch.is_grad_enabled() and onednn_usable()

    def pack(self) -> torch.Tensor | None:
        """The packed copy of the current weight, (re)made if the weight changed since the last one; ``None`` where
        oneDNN does not apply (then ``forward`` takes ``F.linear``)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            return quant.linear(x, self.quant, self.bias)  # type: ignore[arg-type]
        packed = self.pack() if self._eligible() else None
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


class Embedding(_Quantizable, nn.Embedding):
    """``nn.Embedding`` without random initialization, for the same reason as ``Linear``; its weight may be kept in
    GGUF blocks, of which a lookup unpacks only the rows it reads."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            return quant.embedding(ids, self.quant)  # type: ignore[arg-type]
        return super().forward(ids)


def prepack(model: nn.Module) -> None:
    """Pack every ``Linear`` of ``model`` now (after loading, casting or sharding), so that the first step does not
    pay for it and the memory is taken before the KV pool is sized."""
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, Linear) and module.qtype is None:
                module.pack()
