// One decoding step of a pre-norm RMSNorm block for a single token, in C++ to spare ~25
// Python->torch calls per block (at batch 1 their overhead costs as much as the matrix products).
//
// The arithmetic follows the Python path (powerinfer/models/layers.py), which remains the reference:
// RMSNorm via hypot, the linear layers' own kernels for the projections; RoPE and attention over
// the slot's cache are attention.cpp's (torch's scaled_dot_product_attention to float32 rounding).
#include "decode_step.h"

#include <ATen/ATen.h>

#include <cmath>

namespace powerinfer {

RMSNorm::RMSNorm(torch::Tensor scaled_weight, const torch::Tensor& eps_term)
    : scaled_weight(scaled_weight.contiguous()), eps_square(eps_term.item<float>() * eps_term.item<float>()) {
  TORCH_CHECK(this->scaled_weight.dtype() == torch::kFloat32 && this->scaled_weight.dim() >= 1, "norm weight: float32");
}

void RMSNorm::normalize(const float* in, float* out, int64_t values) const {
  const int64_t d = scaled_weight.size(-1), weights = scaled_weight.numel();
  const float* w0 = scaled_weight.data_ptr<float>();
  for (int64_t at = 0; at < values; at += d) {
    const float* x = in + at;
    const float* w = w0 + at % weights;
    float* o = out + at;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
    const float norm = std::sqrt(squares + eps_square);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = x[i] / norm * w[i];
  }
}

torch::Tensor RMSNorm::operator()(const torch::Tensor& x) const {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) % scaled_weight.numel() == 0,
              "x must be float32 [rows, a multiple of the norm's size]");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty_like(xc);
  normalize(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel());
  return out;
}

void RMSNorm::normalize_prefix(torch::Tensor& x) const {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) >= scaled_weight.numel(),
              "x must be contiguous float32 [rows, at least the norm's size]");
  for (int64_t r = 0; r < x.size(0); ++r) {
    float* row = x.data_ptr<float>() + r * x.size(1);
    normalize(row, row, scaled_weight.numel());
  }
}

BlockStep::BlockStep(RMSNorm attn_norm, ProjectionPtr qkv, ProjectionPtr output, AttentionSpec spec, RMSNorm ffn_norm,
                     ProjectionPtr up, ProjectionPtr down, Activation activation, BlockExtras extras)
    : attn_norm_(std::move(attn_norm)), qkv_(std::move(qkv)), output_(std::move(output)), spec_(spec),
      ffn_norm_(std::move(ffn_norm)), up_(std::move(up)), down_(std::move(down)), activation_(activation),
      extras_(std::move(extras)) {}

void BlockStep::attention(torch::Tensor x, torch::Tensor k_slot, torch::Tensor v_slot, int64_t pos, torch::Tensor rotation) const {
  attention_rows(x, k_slot, v_slot, {0}, {pos}, rotation);
}

void BlockStep::attention_rows(torch::Tensor x, torch::Tensor keys, torch::Tensor values, std::vector<int64_t> slots,
                               std::vector<int64_t> positions, torch::Tensor rotations) const {
  torch::Tensor qkv = (*qkv_)(attn_norm_(x)).to(torch::kFloat32).contiguous();  // [rows, (q+2kv) * hd]
  if (extras_.qkv_bias) qkv.add_(*extras_.qkv_bias);
  if (extras_.qk_norm) extras_.qk_norm->normalize_prefix(qkv);  // the Q and K heads, before RoPE
  add_output(x, (*output_)(decode_attention(qkv, keys, values, slots, positions, rotations, spec_)),
             extras_.post_attention_norm);
}

void BlockStep::dense_ffn(torch::Tensor x) const {
  TORCH_CHECK(up_ && down_, "this block has no dense FFN weights");
  torch::Tensor h = (*up_)(ffn_norm_(x));
  torch::Tensor a;
  const int64_t half = h.size(1) / 2;
  switch (activation_) {
    case Activation::RELU_GATED: a = torch::relu(h.narrow(1, 0, half)).mul_(h.narrow(1, half, half)); break;
    case Activation::SILU_GATED: a = torch::silu(h.narrow(1, 0, half)).mul_(h.narrow(1, half, half)); break;
    case Activation::GELU_GATED: a = torch::gelu(h.narrow(1, 0, half), "tanh").mul_(h.narrow(1, half, half)); break;
    case Activation::DRELU: a = torch::relu(h.narrow(1, 0, half)).mul_(torch::relu(h.narrow(1, half, half))); break;
    case Activation::RELU: a = torch::relu(h); break;
    case Activation::GELU: a = torch::gelu(h, "tanh"); break;
  }
  add_output(x, (*down_)(a), extras_.post_ffw_norm);
}

torch::Tensor BlockStep::ffn_input(torch::Tensor x) const { return ffn_norm_(x); }

void BlockStep::add_ffn_output(torch::Tensor x, torch::Tensor y) const { add_output(x, y, extras_.post_ffw_norm); }

void BlockStep::add_output(torch::Tensor& x, const torch::Tensor& y, const std::optional<RMSNorm>& post_norm) const {
  if (post_norm)
    x.add_((*post_norm)(y.to(torch::kFloat32)));
  else
    x.add_(y);
}

}  // namespace powerinfer
