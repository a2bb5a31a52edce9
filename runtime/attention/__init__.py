"""Attention backends behind one small interface; ``TorchReferenceBackend`` is the portable reference."""

from radixserve.runtime.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttnOptions,
    ExtendSeq,
    ForwardContext,
    PrefixGroup,
)
from radixserve.runtime.attention.torch_ref import TorchReferenceBackend, attention_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttnOptions",
    "ExtendSeq",
    "ForwardContext",
    "PrefixGroup",
    "TorchReferenceBackend",
    "attention_backend",
]
