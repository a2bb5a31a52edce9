// Every decoder layer of a decode step in one call: the same kernels as the Python layers, in the same order, with
// no Python between them.
//
// At one to a few rows a step of a small model is mostly host work: SmolLM2-135M runs ~400 small calls a step
// (30 layers of norms, projections, RoPE, KV writes, attention), each a Python frame, a module call and a kernel
// launch, ~40% of a one-user step on two cores. Here a layer is a handful of C++ calls into the kernels that
// runtime/models/llama.py calls (fused_ops, quant_packed, bf16_linear, decode_attention), so the result is the
// Python path's to the bit (runtime/models/decode_stack.py builds the stack and says when it applies; the Python
// layers stay the reference and the path for everything else).
//
// Per layer, for T decode rows (one query token each; the shared decoder of llama.py with plain attention):
//   h = add_rms_norm(x, residual, w_in)           (rms_norm(residual) on the first layer; residual updated in place)
//   qkv = qkv_proj(h); RoPE on q and k in place; k, v written to the layer's pool slots
//   o = o_proj(decode_attention(q, pool, slots, lens))
//   h = add_rms_norm(o, residual, w_post);  x = down_proj(silu_mul(gate_up_proj(h)))  (one call where gated)
// and the last layer's x is returned (the caller adds it and applies the final norm). With LoRA adapters, each
// projection's output gets its row groups' updates as runtime/lora.py LoRABatch.apply adds them (the same ops, so
// the same bits), and a gated gate/up projection runs ungated so its output can take them.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace radixserve_decode_stack {

// oneDNN's linear over its packed weight, the op Linear calls from Python (torch.ops.mkldnn._linear_pointwise).
const c10::OperatorHandle& onednn_linear() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

// A linear layer as the Python Linear would run it at these rows.
struct LinearOp {
  // 0: packed blocks (quant_packed; one call per part, outputs side by side), 1: bfloat16 parts (bf16_linear),
  // 2: a plain weight (at::linear), 3: a oneDNN-packed weight, 4: a bfloat16 weight packed in pairs (bf16_packed),
  // 5: a gate/up weight packed in pairs, multiplied gated (its output is silu(gate) * up already).
  int64_t kind = 0;
  std::vector<torch::Tensor> weights;
  std::vector<int64_t> types, outs;  // kind 0: each part's block type and output size
  int64_t in = 0;
  torch::Tensor bias;  // undefined: none

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == 0) {
      torch::Tensor y;
      if (weights.size() == 1) {
        y = radixserve_quant_packed::linear(x, weights[0], types[0], in, outs[0]);
      } else {
        std::vector<torch::Tensor> parts;
        for (size_t i = 0; i < weights.size(); ++i)
          parts.push_back(radixserve_quant_packed::linear(x, weights[i], types[i], in, outs[i]));
        y = torch::cat(parts, 1);
      }
      return bias.defined() ? y + bias : y;
    }
    if (kind == 1) return radixserve_bf16_linear::linear(x, weights, bias.defined() ? bias : torch::Tensor());
    if (kind == 4) return radixserve_bf16_packed::linear(x, weights[0], bias.defined() ? bias : torch::Tensor());
    if (kind == 5)
      return radixserve_bf16_packed::linear_silu_mul(x, weights[0], bias.defined() ? bias : torch::Tensor());
    if (kind == 3) {
      std::vector<c10::IValue> stack{x, weights[0], bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                     std::string("none"), c10::List<std::optional<at::Scalar>>(), c10::IValue()};
      onednn_linear().callBoxed(&stack);
      return stack[0].toTensor();
    }
    return bias.defined() ? at::linear(x, weights[0], bias) : at::linear(x, weights[0]);
  }

  // The projection itself, ungated (a gated gate/up weight as the Python Linear runs it unfused).
  torch::Tensor plain(const torch::Tensor& x) const {
    if (kind == 5) return radixserve_bf16_packed::linear(x, weights[0], bias.defined() ? bias : torch::Tensor());
    return (*this)(x);
  }
};

// An adapter's weights for the stack: per layer, per projection (0 qkv, 1 o, 2 gate_up, 3 down), A^T [in, r] and
// B^T [r, out] in float32 (empty: the projection is not adapted).
struct LoRAWeights {
  std::vector<torch::Tensor> at, bt;  // [layer * 4 + projection]
};

std::shared_ptr<LoRAWeights> make_lora(std::vector<torch::Tensor> at, std::vector<torch::Tensor> bt) {
  TORCH_CHECK(at.size() == bt.size() && at.size() % 4 == 0, "decode_stack: LoRA weights, 4 projections a layer");
  auto w = std::make_shared<LoRAWeights>();
  w->at = std::move(at);
  w->bt = std::move(bt);
  return w;
}

// The adapters of a step's rows: group g uses weights[g] on rows [start, end) (every row when end is -1), or on
// the rows ``index`` lists when it is not empty.
struct LoRAGroups {
  std::vector<std::shared_ptr<LoRAWeights>> weights;
  std::vector<int64_t> starts, ends;
  std::vector<torch::Tensor> indexes;

  bool empty() const { return weights.empty(); }

  // y += each group's update of the projection ``p`` of layer ``layer`` applied to x (LoRABatch.apply's ops).
  void apply(int64_t layer, int64_t p, const torch::Tensor& x, torch::Tensor& y) const {
    for (size_t g = 0; g < weights.size(); ++g) {
      const torch::Tensor& at = weights[g]->at[layer * 4 + p];
      if (at.numel() == 0) continue;
      const torch::Tensor& bt = weights[g]->bt[layer * 4 + p];
      const bool all = indexes[g].numel() == 0 && starts[g] == 0 && (ends[g] < 0 || ends[g] >= x.size(0));
      const int64_t n = indexes[g].numel() > 0 ? indexes[g].numel() : all ? x.size(0) : ends[g] - starts[g];
      if (n <= radixserve_lora_ops::kMaxRows) {  // each row on its own (lora_ops.cpp)
        radixserve_lora_ops::add_update(y, x, at, bt, all ? 0 : starts[g], all ? x.size(0) : ends[g], indexes[g]);
        continue;
      }
      if (indexes[g].numel() > 0) {
        torch::Tensor xs = x.index({indexes[g]});
        if (xs.scalar_type() != at.scalar_type()) xs = xs.to(at.scalar_type());
        y.index_put_({indexes[g]}, (y.index({indexes[g]}) + xs.mm(at).mm(bt)).to(y.scalar_type()));
        continue;
      }
      torch::Tensor xs = all ? x : x.narrow(0, starts[g], ends[g] - starts[g]);
      if (xs.scalar_type() != at.scalar_type()) xs = xs.to(at.scalar_type());
      torch::Tensor rows = all ? y : y.narrow(0, starts[g], ends[g] - starts[g]);
      rows.add_(xs.mm(at).mm(bt));
    }
  }
};

LinearOp make_linear(int64_t kind, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                     std::vector<int64_t> outs, int64_t in, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(kind >= 0 && kind <= 5 && !weights.empty(), "decode_stack: linear kind 0-5 with weights");
  TORCH_CHECK(kind != 0 || (types.size() == weights.size() && outs.size() == weights.size()),
              "decode_stack: a block type and an output size per packed part");
  LinearOp op;
  op.kind = kind;
  op.weights = std::move(weights);
  op.types = std::move(types);
  op.outs = std::move(outs);
  op.in = in;
  if (bias.has_value()) op.bias = *bias;
  return op;
}

struct Layer {
  torch::Tensor norm_in, norm_post;
  LinearOp qkv, o, gate_up, down;
};

class Stack {
 public:
  Stack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "decode_stack: head shapes");
  }

  void add_layer(torch::Tensor norm_in, torch::Tensor norm_post, LinearOp qkv, LinearOp o, LinearOp gate_up,
                 LinearOp down) {
    layers_.push_back({std::move(norm_in), std::move(norm_post), std::move(qkv), std::move(o), std::move(gate_up),
                       std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // residual [T, hidden] (the embeddings, updated in place); cos / signed_sin [T, 1, D]; kv the pool's
  // [layers, 2, Hkv, N, D]; out_slots [T] where each row's k and v go; slots [T, W] / lens [T] the rows' keys, as
  // the decode-attention kernel takes them (its own slot included), with its ``groups`` of rows that share a prefix
  // (or none). Returns the last layer's MLP output.
  torch::Tensor forward(torch::Tensor residual, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv,
                        torch::Tensor out_slots, torch::Tensor slots, torch::Tensor lens,
                        std::optional<torch::Tensor> groups, const LoRAGroups& lora) const {
    const int64_t T = residual.size(0), h = heads_, hkv = kv_heads_, d = head_dim_;
    TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "decode_stack: residual [T, hidden]");
    TORCH_CHECK(kv.dim() == 5 && kv.size(0) == num_layers() && kv.size(2) == hkv && kv.size(4) == d &&
                    kv.is_contiguous() && kv.scalar_type() == residual.scalar_type(),
                "decode_stack: kv [layers, 2, Hkv, N, D] in the activations' dtype");
    TORCH_CHECK(out_slots.dim() == 1 && out_slots.size(0) == T && out_slots.scalar_type() == torch::kInt64,
                "decode_stack: a slot per row");
    out_slots = out_slots.contiguous();
    const int64_t N = kv.size(3);
    const int64_t* op = out_slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(op[t] >= 0 && op[t] < N, "decode_stack: slot out of range");
    const double scale = std::pow(static_cast<double>(d), -0.5);  // Python's d**-0.5
    torch::Tensor x;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& layer = layers_[i];
      torch::Tensor hn = x.defined() ? radixserve_fused_ops::add_rms_norm(x, residual, layer.norm_in, eps_)
                                     : radixserve_fused_ops::rms_norm(residual, layer.norm_in, eps_);
      torch::Tensor qkv = layer.qkv(hn);
      if (!lora.empty()) lora.apply(i, 0, hn, qkv);
      torch::Tensor qk = qkv.narrow(1, 0, (h + hkv) * d).view({T, h + hkv, d});
      radixserve_fused_ops::rope(qk, cos, sin);
      torch::Tensor v = qkv.narrow(1, (h + hkv) * d, hkv * d).view({T, hkv, d});
      torch::Tensor pool = kv[i];
      store(pool, op, qk, h, v);
      torch::Tensor att =
          radixserve_decode_attention::decode_attention(qk.narrow(1, 0, h).contiguous(), pool, slots, lens, scale,
                                                        groups)[0];
      torch::Tensor a = att.view({T, h * d});
      torch::Tensor o = layer.o(a);
      if (!lora.empty()) lora.apply(i, 1, a, o);
      torch::Tensor h2 = radixserve_fused_ops::add_rms_norm(o, residual, layer.norm_post, eps_);
      if (lora.empty()) {
        x = layer.down(layer.gate_up.kind == 5 ? layer.gate_up(h2)
                                               : radixserve_fused_ops::silu_mul(layer.gate_up(h2)));
        continue;
      }
      torch::Tensor gate_up = layer.gate_up.plain(h2);
      lora.apply(i, 2, h2, gate_up);
      torch::Tensor m = radixserve_fused_ops::silu_mul(gate_up);
      x = layer.down(m);
      lora.apply(i, 3, m, x);
    }
    return x;
  }

 private:
  // k (heads [h, h + hkv) of qk) and v of each row into pool [2, Hkv, N, D] at its slot: KVPool.store's writes.
  void store(const torch::Tensor& pool, const int64_t* slots, const torch::Tensor& qk, int64_t h,
             const torch::Tensor& v) const {
    const int64_t T = qk.size(0), hkv = kv_heads_, d = head_dim_, N = pool.size(2);
    const int64_t es = pool.element_size(), row = d * es;
    char* base = static_cast<char*>(pool.data_ptr());
    const char* kp = static_cast<const char*>(qk.data_ptr());
    const char* vp = static_cast<const char*>(v.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < hkv; ++j) {
        std::memcpy(base + ((0 * hkv + j) * N + slots[t]) * row, kp + (t * qk.stride(0) + (h + j) * d) * es, row);
        std::memcpy(base + ((1 * hkv + j) * N + slots[t]) * row, vp + (t * v.stride(0) + j * d) * es, row);
      }
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace radixserve_decode_stack

void register_decode_stack(pybind11::module_& parent) {
  namespace ds = radixserve_decode_stack;
  auto m = parent.def_submodule("decode_stack");
  py::class_<ds::LinearOp>(m, "LinearOp");
  m.def("linear", &ds::make_linear, "a linear layer of the stack: kind, weights, block types, output sizes, K, bias");
  py::class_<ds::LoRAWeights, std::shared_ptr<ds::LoRAWeights>>(m, "LoRAWeights");
  m.def("lora", &ds::make_lora, "an adapter's A^T and B^T per layer and projection (qkv, o, gate_up, down)");
  py::class_<ds::LoRAGroups>(m, "LoRAGroups")
      .def(py::init([](std::vector<std::shared_ptr<ds::LoRAWeights>> w, std::vector<int64_t> starts,
                       std::vector<int64_t> ends, std::vector<torch::Tensor> indexes) {
        TORCH_CHECK(w.size() == starts.size() && w.size() == ends.size() && w.size() == indexes.size(),
                    "decode_stack: a start, an end and an index per LoRA group");
        return ds::LoRAGroups{std::move(w), std::move(starts), std::move(ends), std::move(indexes)};
      }));
  py::class_<ds::Stack>(m, "Stack")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &ds::Stack::add_layer)
      .def_property_readonly("num_layers", &ds::Stack::num_layers)
      .def("forward", &ds::Stack::forward, py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("kv"),
           py::arg("out_slots"), py::arg("slots"), py::arg("lens"), py::arg("groups") = py::none(),
           py::arg("lora") = ds::LoRAGroups{}, py::call_guard<py::gil_scoped_release>());
}
