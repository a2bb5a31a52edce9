// The one Python module of radixserve's CPU kernels: each kernel file registers its functions as a submodule.
// The files are compiled as one translation unit (included here): torch's headers, most of the build time, are
// parsed once, and a machine's first start pays one build of about a minute.
#include <torch/extension.h>

#include "../attention/csrc/decode_attention.cpp"
#include "../attention/csrc/extend_attention.cpp"
#include "../models/csrc/bf16_linear.cpp"
#include "../models/csrc/bf16_tiles.cpp"  // before bf16_packed.cpp, which calls it
#include "../models/csrc/bf16_packed.cpp"
#include "../models/csrc/fused_ops.cpp"
#include "../models/csrc/lora_ops.cpp"
#include "../models/csrc/quant_linear.cpp"
#include "../models/csrc/quant_packed.cpp"
#include "greedy.cpp"
// After the kernels it calls.
#include "../models/csrc/decode_stack.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_attention(m);
  register_extend_attention(m);
  register_quant_linear(m);
  register_quant_packed(m);
  register_fused_ops(m);
  register_lora_ops(m);
  register_bf16_linear(m);
  register_bf16_tiles(m);
  register_bf16_packed(m);
  register_decode_stack(m);
  register_greedy(m);
}
