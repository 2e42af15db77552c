// One decoding step of a llama block for a single token, in C++ to spare ~25 Python->torch calls
// per block (at batch 1 their overhead costs as much as the matrix products).
//
// The arithmetic follows the Python path (powerinfer/models/layers.py), which remains the reference:
// RMSNorm via hypot, the linear layers' own kernels for the projections; RoPE and attention over
// the slot's cache are attention.cpp's (torch's scaled_dot_product_attention to float32 rounding).
#include "decode_step.h"

#include <ATen/ATen.h>

#include <cmath>

#include "ops.h"

namespace powerinfer {

RMSNorm::RMSNorm(torch::Tensor scaled_weight, const torch::Tensor& eps_term)
    : scaled_weight(scaled_weight.contiguous()), eps_square(eps_term.item<float>() * eps_term.item<float>()) {}

torch::Tensor RMSNorm::operator()(const torch::Tensor& x) const {
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

LlamaBlockStep::LlamaBlockStep(torch::Tensor attn_norm, torch::Tensor attn_eps, ProjectionPtr qkv, ProjectionPtr output,
                               int64_t n_head, int64_t n_head_kv, torch::Tensor ffn_norm, torch::Tensor ffn_eps,
                               ProjectionPtr up, ProjectionPtr down, Activation activation)
    : attn_norm_(attn_norm, attn_eps), qkv_(std::move(qkv)), output_(std::move(output)), n_head_(n_head),
      n_head_kv_(n_head_kv), ffn_norm_(ffn_norm, ffn_eps), up_(std::move(up)), down_(std::move(down)),
      activation_(activation) {}

void LlamaBlockStep::attention(torch::Tensor x, torch::Tensor k_slot, torch::Tensor v_slot, int64_t pos, torch::Tensor rotation) const {
  torch::Tensor qkv = (*qkv_)(attn_norm_(x)).to(torch::kFloat32).contiguous();  // [1, (q+2kv) * hd]
  x.add_((*output_)(decode_attention(qkv, k_slot, v_slot, {0}, {pos}, rotation, n_head_, n_head_kv_)));
}

void LlamaBlockStep::attention_rows(torch::Tensor x, torch::Tensor keys, torch::Tensor values, std::vector<int64_t> slots,
                                    std::vector<int64_t> positions, torch::Tensor rotations) const {
  torch::Tensor qkv = (*qkv_)(attn_norm_(x)).to(torch::kFloat32).contiguous();  // [rows, (q+2kv) * hd]
  x.add_((*output_)(decode_attention(qkv, keys, values, slots, positions, rotations, n_head_, n_head_kv_)));
}

void LlamaBlockStep::dense_ffn(torch::Tensor x) const {
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
  x.add_((*down_)(a));
}

torch::Tensor LlamaBlockStep::ffn_input(torch::Tensor x) const { return ffn_norm_(x); }

}  // namespace powerinfer
