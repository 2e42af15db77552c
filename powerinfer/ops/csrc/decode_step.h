// One decoding step of a llama block (decode_step.cpp).
#pragma once

#include "common.h"
#include "projection.h"

namespace powerinfer {

// x * w / sqrt(mean(x^2) + eps) as x / sqrt(|x|^2 + d * eps) * (w * sqrt(d)), one loop per row
// instead of four torch calls (their overhead is most of what a norm costs at a few rows).
struct RMSNorm {
  torch::Tensor scaled_weight;  // weight * sqrt(d), float32
  float eps_square;             // d * eps

  RMSNorm(torch::Tensor scaled_weight, const torch::Tensor& eps_term);
  torch::Tensor operator()(const torch::Tensor& x) const;
};

class LlamaBlockStep {
 public:
  LlamaBlockStep(torch::Tensor attn_norm, torch::Tensor attn_eps, ProjectionPtr qkv, ProjectionPtr output,
                 int64_t n_head, int64_t n_head_kv, torch::Tensor ffn_norm, torch::Tensor ffn_eps,
                 ProjectionPtr up, ProjectionPtr down, Activation activation);

  // x += attention(norm(x)) for the token at `pos`; k/v_slot: [1, kv_heads, n_ctx, head_dim];
  // rotation: RoPE at `pos` (head_dim / 2 complex numbers).
  void attention(torch::Tensor x, torch::Tensor k_slot, torch::Tensor v_slot, int64_t pos, torch::Tensor rotation) const;

  // x += attention(norm(x)) for one token of each of several sequences: row b of x [rows, d] sits at
  // positions[b] in cache slot slots[b] of keys/values [slots, kv_heads, n_ctx, head_dim];
  // rotations: [rows, 1, head_dim / 2]. The projections run once for all rows; each row's
  // attention is computed as it would be alone, so rows get exactly their one-at-a-time result.
  void attention_rows(torch::Tensor x, torch::Tensor keys, torch::Tensor values, std::vector<int64_t> slots,
                      std::vector<int64_t> positions, torch::Tensor rotations) const;

  // x += ffn(norm(x)), all neurons.
  void dense_ffn(torch::Tensor x) const;

  torch::Tensor ffn_input(torch::Tensor x) const;

 private:
  RMSNorm attn_norm_;
  ProjectionPtr qkv_, output_;
  int64_t n_head_, n_head_kv_;
  RMSNorm ffn_norm_;
  ProjectionPtr up_, down_;  // null without a dense FFN
  Activation activation_;
};

}  // namespace powerinfer
