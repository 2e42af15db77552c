// PredictedFFN (predicted_ffn.h): at batch 1 the dozen torch calls of the Python path (predictor,
// comparison, nonzero, indexing, the sparse operator) cost about 80 us per layer, a few percent of a
// 7B-width decode step; here they are one call, on the same kernels, with the same results.
#include "predicted_ffn.h"

#include "ops.h"

namespace powerinfer {

PredictedFFN::PredictedFFN(ProjectionPtr fc1, ProjectionPtr fc2, double threshold, torch::Tensor records,
                           std::vector<int64_t> gate, std::vector<int64_t> up, std::vector<int64_t> down, Activation activation)
    : fc1_(std::move(fc1)), fc2_(std::move(fc2)), threshold_(static_cast<float>(threshold)), records_(std::move(records)),
      gate_(std::move(gate)), up_(std::move(up)), down_(std::move(down)), activation_(activation) {}

std::tuple<torch::Tensor, int64_t> PredictedFFN::operator()(const torch::Tensor& h, const torch::Tensor& x) const {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && x.dim() == 2 && x.size(0) == 1, "one token: h and x must be [1, d]");
  const torch::Tensor scores = (*fc2_)((*fc1_)(x).to(torch::kFloat32).relu_()).to(torch::kFloat32).contiguous();
  const float* s = scores.data_ptr<float>();
  const int64_t n_ff = scores.size(1);
  torch::Tensor idx = torch::empty({n_ff}, torch::kInt64);
  int64_t* ids = idx.data_ptr<int64_t>();
  int64_t n = 0;
  for (int64_t j = 0; j < n_ff; ++j)
    if (s[j] >= threshold_) ids[n++] = j;
  idx = idx.narrow(0, 0, n);
  return {sparse_ffn(records_, gate_, up_, down_, activation_, h.to(torch::kFloat32).contiguous(), idx), n};
}

}  // namespace powerinfer
