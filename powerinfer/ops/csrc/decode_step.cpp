// One decoding step of a llama block for a single token, in C++ to spare ~25 Python->torch calls
// per block (at batch 1 their overhead costs as much as the matrix products).
//
// The arithmetic follows the Python path (powerinfer/models/layers.py), which remains the reference:
// RMSNorm via hypot, the linear layers' own kernels for the projections; RoPE and attention over
// the slot's cache are attention.cpp's (torch's scaled_dot_product_attention to float32 rounding).
#include <torch/extension.h>
#include <ATen/ATen.h>
#include <cmath>
#include <memory>
#include <vector>

torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                           int64_t out_features);  // quant_matmul.cpp
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                               torch::Tensor rotations, int64_t n_head, int64_t n_kv);  // attention.cpp

namespace {

// A linear layer as the step calls it; one subclass per weight layout (powerinfer/ops/linear.py).
struct Projection {
  virtual ~Projection() = default;
  virtual torch::Tensor operator()(const torch::Tensor& x) const = 0;
};

// Int4Linear: torch's int4 kernel, the input repeated `repeats` times along K (Q8_0 as two nibble
// matrices), outputs padded to a multiple of 64 and cut back to `out_features`.
struct Int4Projection : Projection {
  torch::Tensor packed, scale_zero;
  int64_t out_features, repeats;

  Int4Projection(torch::Tensor packed, torch::Tensor scale_zero, int64_t out_features, int64_t repeats)
      : packed(std::move(packed)), scale_zero(std::move(scale_zero)), out_features(out_features), repeats(repeats) {}

  torch::Tensor operator()(const torch::Tensor& x) const override {
    torch::Tensor input = x.to(torch::kBFloat16);
    if (repeats > 1) input = torch::cat(std::vector<torch::Tensor>(repeats, input), 1);
    torch::Tensor y = at::_weight_int4pack_mm_for_cpu(input, packed, 32, scale_zero);
    return y.size(1) == out_features ? y : y.narrow(1, 0, out_features);
  }
};

// QuantLinear: our bfloat16 dot-product kernel (quant_matmul.cpp), float32 outputs.
struct QuantProjection : Projection {
  torch::Tensor weight, scales;
  int64_t out_features;

  QuantProjection(torch::Tensor weight, torch::Tensor scales, int64_t out_features)
      : weight(std::move(weight)), scales(std::move(scales)), out_features(out_features) {}

  torch::Tensor operator()(const torch::Tensor& x) const override { return quant_matmul(x, weight, scales, out_features); }
};

using ProjectionPtr = std::shared_ptr<Projection>;

// x * w / sqrt(mean(x^2) + eps) as x / sqrt(|x|^2 + d * eps) * (w * sqrt(d)), one loop per row
// instead of four torch calls (their overhead is most of what a norm costs at a few rows).
struct RMSNorm {
  torch::Tensor scaled_weight;  // weight * sqrt(d), float32
  float eps_square;             // d * eps

  RMSNorm(torch::Tensor scaled_weight, const torch::Tensor& eps_term)
      : scaled_weight(scaled_weight.contiguous()), eps_square(eps_term.item<float>() * eps_term.item<float>()) {}

  torch::Tensor operator()(const torch::Tensor& x) const {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == scaled_weight.numel(), "x must be float32 [rows, d]");
    const torch::Tensor xc = x.contiguous();
    torch::Tensor out = torch::empty_like(xc);
    const int64_t d = xc.size(1);
    const float* w = scaled_weight.data_ptr<float>();
    for (int64_t r = 0; r < xc.size(0); ++r) {
      const float* in = xc.data_ptr<float>() + r * d;
      float* o = out.data_ptr<float>() + r * d;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) squares += in[i] * in[i];
      const float norm = std::sqrt(squares + eps_square);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = in[i] / norm * w[i];
    }
    return out;
  }
};

class LlamaBlockStep {
 public:
  LlamaBlockStep(torch::Tensor attn_norm, torch::Tensor attn_eps, ProjectionPtr qkv, ProjectionPtr output,
                 int64_t n_head, int64_t n_head_kv, torch::Tensor ffn_norm, torch::Tensor ffn_eps,
                 ProjectionPtr up, ProjectionPtr down, int64_t activation)
      : attn_norm_(attn_norm, attn_eps), qkv_(std::move(qkv)), output_(std::move(output)), n_head_(n_head),
        n_head_kv_(n_head_kv), ffn_norm_(ffn_norm, ffn_eps), up_(std::move(up)),
        down_(std::move(down)), activation_(activation) {}

  // x += attention(norm(x)) for the token at `pos`; k/v_slot: [1, kv_heads, n_ctx, head_dim];
  // rotation: RoPE at `pos` (head_dim / 2 complex numbers).
  void attention(torch::Tensor x, torch::Tensor k_slot, torch::Tensor v_slot, int64_t pos, torch::Tensor rotation) const {
    torch::Tensor qkv = (*qkv_)(attn_norm_(x)).to(torch::kFloat32).contiguous();  // [1, (q+2kv) * hd]
    x.add_((*output_)(decode_attention(qkv, k_slot, v_slot, {0}, {pos}, rotation, n_head_, n_head_kv_)));
  }

  // x += attention(norm(x)) for one token of each of several sequences: row b of x [rows, d] sits at
  // positions[b] in cache slot slots[b] of keys/values [slots, kv_heads, n_ctx, head_dim];
  // rotations: [rows, 1, head_dim / 2]. The projections run once for all rows; each row's
  // attention is computed as it would be alone, so rows get exactly their one-at-a-time result.
  void attention_rows(torch::Tensor x, torch::Tensor keys, torch::Tensor values, std::vector<int64_t> slots,
                      std::vector<int64_t> positions, torch::Tensor rotations) const {
    torch::Tensor qkv = (*qkv_)(attn_norm_(x)).to(torch::kFloat32).contiguous();  // [rows, (q+2kv) * hd]
    x.add_((*output_)(decode_attention(qkv, keys, values, slots, positions, rotations, n_head_, n_head_kv_)));
  }

  // x += ffn(norm(x)), all neurons.
  void dense_ffn(torch::Tensor x) const {
    TORCH_CHECK(up_ && down_, "this block has no dense FFN weights");
    torch::Tensor h = (*up_)(ffn_norm_(x));
    torch::Tensor a;
    const int64_t half = h.size(1) / 2;
    switch (activation_) {
      case 0: a = torch::relu(h.narrow(1, 0, half)).mul_(h.narrow(1, half, half)); break;             // ReGLU
      case 1: a = torch::silu(h.narrow(1, 0, half)).mul_(h.narrow(1, half, half)); break;             // SwiGLU
      case 2: a = torch::gelu(h.narrow(1, 0, half), "tanh").mul_(h.narrow(1, half, half)); break;     // GeGLU
      case 3: a = torch::relu(h.narrow(1, 0, half)).mul_(torch::relu(h.narrow(1, half, half))); break; // dReLU
      case 4: a = torch::relu(h); break;
      case 5: a = torch::gelu(h, "tanh"); break;
      default: TORCH_CHECK(false, "unknown activation ", activation_);
    }
    x.add_((*down_)(a));
  }

  torch::Tensor ffn_input(torch::Tensor x) const { return ffn_norm_(x); }

 private:
  RMSNorm attn_norm_;
  ProjectionPtr qkv_, output_;
  int64_t n_head_, n_head_kv_;
  RMSNorm ffn_norm_;
  ProjectionPtr up_, down_;  // null without a dense FFN
  int64_t activation_;
};

}  // namespace

void register_decode_step(pybind11::module& m) {
  namespace py = pybind11;
  // The steps hold no Python objects: other Python threads (the server's event loop) run meanwhile.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<Projection, ProjectionPtr>(m, "Projection").def("__call__", &Projection::operator(), no_gil);
  py::class_<Int4Projection, Projection, std::shared_ptr<Int4Projection>>(m, "Int4Projection")
      .def(py::init<torch::Tensor, torch::Tensor, int64_t, int64_t>());
  py::class_<QuantProjection, Projection, std::shared_ptr<QuantProjection>>(m, "QuantProjection")
      .def(py::init<torch::Tensor, torch::Tensor, int64_t>());
  py::class_<LlamaBlockStep>(m, "LlamaBlockStep")
      .def(py::init<torch::Tensor, torch::Tensor, ProjectionPtr, ProjectionPtr, int64_t, int64_t, torch::Tensor,
                    torch::Tensor, ProjectionPtr, ProjectionPtr, int64_t>())
      .def("attention", &LlamaBlockStep::attention, no_gil)
      .def("attention_rows", &LlamaBlockStep::attention_rows, no_gil)
      .def("dense_ffn", &LlamaBlockStep::dense_ffn, no_gil)
      .def("ffn_input", &LlamaBlockStep::ffn_input, no_gil);
}
