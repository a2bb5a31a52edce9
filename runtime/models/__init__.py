"""Model code: plain PyTorch modules, free of scheduling concerns."""

from radixserve.runtime.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelArgs

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArgs"]
