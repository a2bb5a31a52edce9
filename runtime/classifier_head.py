"""A classifier's head (``runtime.pooling``: a cross-encoder reranker), taken from the checkpoint as it loads.

The head is a small float32 matrix ``[outputs, hidden]``, and a classifier's outputs are ``hidden @ head.T`` at the
prompt's last row (``ModelRunner``). It is one of:

* a ``*ForSequenceClassification`` checkpoint's ``score.weight``, as transformers applies it (no soft-capping);
* with vLLM's ``classifier_from_token``: the language model head's rows of those tokens (the embedding's rows
  where the head is tied to it); with ``two_way`` (``is_original_qwen3_reranker``), the one row ``W[yes] - W[no]``,
  taken in float32 before any rounding, as vLLM builds it.

Taking the rows as the checkpoint streams by means the vocabulary's head is never built (the model is loaded with
its head tied, as an embedding model's is), and the rows are taken before ``--quantization`` rounds them (a
checkpoint's own blocks are dequantized as the loader reads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from radixserve.runtime.models import quant
from radixserve.runtime.pooling import Pooling

SCORE = "score.weight"
HEADS = ("lm_head.weight",)
EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight")


def _dense(tensor: Any) -> torch.Tensor:
    return tensor.dequantize().float() if isinstance(tensor, quant.QuantTensor) else tensor.float()


def _rows(tensor: Any, ids: list[int]) -> torch.Tensor:
    if isinstance(tensor, quant.QuantTensor):
        return tensor.rows(torch.tensor(ids, dtype=torch.long)).dequantize().float()
    return tensor[ids].float()


class HeadCapture:
    """Wraps the checkpoint's tensor stream (``capture``) and keeps what the classifier's head is made of; ``head``
    then gives it. ``tied``: the checkpoint ties its language model head to the embedding."""

    def __init__(self, pooling: Pooling, outputs: int, hidden: int, tied: bool) -> None:
        self.pooling = pooling
        self.outputs = outputs
        self.hidden = hidden
        self.tied = tied
        self.rows: torch.Tensor | None = None

    def capture(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        ids = list(self.pooling.tokens)
        for name, tensor in weights:
            if name == SCORE:  # (the model has no such parameter; with tokens, the vocabulary's head is read)
                if not ids:
                    self.rows = _dense(tensor).clone()
                continue
            if ids and name in HEADS:
                if not self.tied:
                    self.rows = _rows(tensor, ids)
                continue  # the model is loaded with its head tied: a head of its own is not read
            if ids and self.tied and name in EMBEDDINGS:
                self.rows = _rows(tensor, ids)
            yield name, tensor

    def dummy(self, seed: int) -> None:
        """``--load-format dummy``: random rows (speed depends on the shape, not the values)."""
        n = len(self.pooling.tokens) or self.outputs
        self.rows = torch.randn(n, self.hidden, generator=torch.Generator().manual_seed(seed)) * 0.02

    def head(self, device: torch.device) -> torch.Tensor:
        """The ``[outputs, hidden]`` float32 head on ``device``; ``ValueError`` where the checkpoint lacked it."""
        if self.rows is None:
            where = SCORE if not self.pooling.tokens else ("the embedding" if self.tied else HEADS[0])
            raise ValueError(f"the classifier's head is read from {where}, which the checkpoint lacks")
        rows = self.rows
        if self.pooling.two_way:
            rows = rows[1:] - rows[:1]
        if tuple(rows.shape) != (self.outputs, self.hidden):
            raise ValueError(
                f"the classifier's head is {tuple(rows.shape)}; the config says {self.outputs} output(s) of "
                f"{self.hidden} (num_labels / id2label)"
            )
        return rows.contiguous().to(device)


def classify_rows(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """A classifier's outputs ``[rows, outputs]`` (float32) for final hidden states ``[rows, hidden]``."""
    return hidden.float() @ head.T
