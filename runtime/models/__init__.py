"""Model code: plain PyTorch modules, free of scheduling concerns."""

from radixserve.runtime.models.args import ModelArgs
from radixserve.runtime.models.families import SUPPORTED_ARCHITECTURES
from radixserve.runtime.models.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArgs"]
