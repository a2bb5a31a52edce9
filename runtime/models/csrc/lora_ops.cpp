// LoRA updates of a few rows: y[i] += (x[i] A^T) B^T for each listed row i (each row at most once), in one pass
// over the weights per block of rows.
//
// A decode step adds hundreds of these small products (four projections a layer): as two matmuls each they are
// tens of microseconds of dispatch, and the BLAS's sums, blocked by the row count and the memory's alignment, give
// last bits that change from run to run. Here each row is summed on its own, in a fixed order (k ascending, then r
// ascending), in float32: the same bits whatever rows share the step, the thread count or the run. The update is
// added to y's value in float32 and rounded once (bfloat16 y: round to nearest even), as runtime/lora.py's
// in-place adds of a float32 update do.
//
// x [T, K] float32 or bfloat16, at [K, R] float32 (A transposed), bt [R, N] float32 (B transposed, scale folded
// in), y [T, N] float32 or bfloat16; every tensor contiguous in its last dimension.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace radixserve_lora_ops {

constexpr int64_t kMaxRows = 64;  // beyond, the matmuls are faster (runtime/lora.py takes them)

constexpr int64_t kBlock = 8;  // rows that share one pass over A^T and B^T

template <typename X, typename Y>
void rows_update(const torch::Tensor& x, const torch::Tensor& at, const torch::Tensor& bt, torch::Tensor& y,
                 const std::vector<int64_t>& rows) {
  const int64_t K = at.size(0), R = at.size(1), N = bt.size(1), n = static_cast<int64_t>(rows.size());
  const X* xp = x.data_ptr<X>();
  const float* ap = at.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  Y* yp = y.data_ptr<Y>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  // Rows in blocks: a block reads the weights once. Each row's sums keep their order whatever its block.
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(kBlock, (n + 1) / 2));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> t(kBlock * R), u(kBlock * N);
    for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
      const int64_t m = std::min(kBlock, hi - b0);
      std::fill(t.begin(), t.begin() + m * R, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float* a = ap + k * R;
        for (int64_t q = 0; q < m; ++q) {
          const float xk = static_cast<float>(xp[rows[b0 + q] * xs + k]);
          float* tq = t.data() + q * R;
          for (int64_t r = 0; r < R; ++r) tq[r] += xk * a[r];
        }
      }
      std::fill(u.begin(), u.begin() + m * N, 0.0f);
      for (int64_t r = 0; r < R; ++r) {
        const float* b = bp + r * N;
        for (int64_t q = 0; q < m; ++q) {
          const float tr = t[q * R + r];
          float* uq = u.data() + q * N;
          for (int64_t j = 0; j < N; ++j) uq[j] += tr * b[j];
        }
      }
      for (int64_t q = 0; q < m; ++q) {
        Y* yr = yp + rows[b0 + q] * ys;
        const float* uq = u.data() + q * N;
        for (int64_t j = 0; j < N; ++j) yr[j] = static_cast<Y>(static_cast<float>(yr[j]) + uq[j]);
      }
    }
  });
}

// y[rows] += (x[rows] at) bt in place; ``rows`` empty: rows [start, end).
void add_update(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& at, const torch::Tensor& bt,
                int64_t start, int64_t end, const torch::Tensor& rows) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && at.dim() == 2 && bt.dim() == 2, "lora: 2-D x, y, A^T, B^T");
  TORCH_CHECK(at.scalar_type() == torch::kFloat32 && bt.scalar_type() == torch::kFloat32 && at.is_contiguous() &&
                  bt.is_contiguous(),
              "lora: contiguous float32 A^T and B^T");
  TORCH_CHECK(x.size(1) == at.size(0) && at.size(1) == bt.size(0) && y.size(1) == bt.size(1) &&
                  x.size(0) == y.size(0),
              "lora: shapes x [T, K], A^T [K, R], B^T [R, N], y [T, N]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora: rows of x and y contiguous");
  std::vector<int64_t> list;
  if (rows.numel() > 0) {
    TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1, "lora: int64 row indices");
    torch::Tensor r = rows.contiguous();
    list.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
  } else {
    for (int64_t i = start; i < end; ++i) list.push_back(i);
  }
  for (int64_t i : list) TORCH_CHECK(i >= 0 && i < x.size(0), "lora: row out of range");
  const auto xt = x.scalar_type(), yt = y.scalar_type();
  if (xt == torch::kFloat32 && yt == torch::kFloat32) {
    rows_update<float, float>(x, at, bt, y, list);
  } else if (xt == torch::kBFloat16 && yt == torch::kBFloat16) {
    rows_update<at::BFloat16, at::BFloat16>(x, at, bt, y, list);
  } else {
    TORCH_CHECK(false, "lora: x and y both float32 or both bfloat16");
  }
}

}  // namespace radixserve_lora_ops

void register_lora_ops(pybind11::module_& parent) {
  namespace lo = radixserve_lora_ops;
  auto m = parent.def_submodule("lora");
  m.attr("MAX_ROWS") = lo::kMaxRows;
  m.def("add_update", &lo::add_update, "y[rows] += (x[rows] A^T) B^T, each row on its own (rows empty: start..end)",
        py::arg("y"), py::arg("x"), py::arg("at"), py::arg("bt"), py::arg("start"), py::arg("end"), py::arg("rows"),
        py::call_guard<py::gil_scoped_release>());
}
