// One decoding step of a pre-norm RMSNorm block (decode_step.cpp): llama, and with its options
// Qwen2, Qwen3, Phi-3 and Gemma 3.
#pragma once

#include <optional>

#include "common.h"
#include "ops.h"
#include "projection.h"

namespace powerinfer {

// x * w / sqrt(mean(x^2) + eps) as x / sqrt(|x|^2 + d * eps) * (w * sqrt(d)), one loop per vector
// instead of four torch calls (their overhead is most of what a norm costs at a few rows). A
// weight of several rows [k, d] normalizes each group of k consecutive d-vectors of a row with
// its rows in turn (one norm over the Q and K heads of a projection, as Python's RMSNorm does).
struct RMSNorm {
  torch::Tensor scaled_weight;  // weight * sqrt(d), float32 [d] or [k, d]
  float eps_square;             // d * eps

  RMSNorm(torch::Tensor scaled_weight, const torch::Tensor& eps_term);
  torch::Tensor operator()(const torch::Tensor& x) const;
  // The first scaled_weight.numel() values of each row of x (float32, contiguous), in place.
  void normalize_prefix(torch::Tensor& x) const;

 private:
  void normalize(const float* in, float* out, int64_t values) const;
};

// What a block has besides llama's: biases on the QKV projection (Qwen2), per-head Q and K norms
// (Qwen3, Gemma 3), norms of the attention and FFN outputs before they are added (Gemma 3).
struct BlockExtras {
  std::optional<torch::Tensor> qkv_bias;
  std::optional<RMSNorm> qk_norm, post_attention_norm, post_ffw_norm;
};

class BlockStep {
 public:
  BlockStep(RMSNorm attn_norm, ProjectionPtr qkv, ProjectionPtr output, AttentionSpec spec, RMSNorm ffn_norm,
            ProjectionPtr up, ProjectionPtr down, Activation activation, BlockExtras extras);

  // x += attention(norm(x)) for the token at `pos`; k/v_slot: [1, kv_heads, n_ctx, head_dim];
  // rotation: RoPE at `pos` (rope_dim / 2 complex numbers).
  void attention(torch::Tensor x, torch::Tensor k_slot, torch::Tensor v_slot, int64_t pos, torch::Tensor rotation) const;

  // x += attention(norm(x)) for one token of each of several sequences: row b of x [rows, d] sits at
  // positions[b] in cache slot slots[b] of keys/values [slots, kv_heads, n_ctx, head_dim];
  // rotations: [rows, 1, rope_dim / 2]. The projections run once for all rows; each row's
  // attention is computed as it would be alone, so rows get exactly their one-at-a-time result.
  void attention_rows(torch::Tensor x, torch::Tensor keys, torch::Tensor values, std::vector<int64_t> slots,
                      std::vector<int64_t> positions, torch::Tensor rotations) const;

  // x += ffn(norm(x)), all neurons.
  void dense_ffn(torch::Tensor x) const;

  // The FFN's input norm(x), and x += y for the output y of an FFN computed elsewhere (sparse, mixture).
  torch::Tensor ffn_input(torch::Tensor x) const;
  void add_ffn_output(torch::Tensor x, torch::Tensor y) const;

 private:
  void add_output(torch::Tensor& x, const torch::Tensor& y, const std::optional<RMSNorm>& post_norm) const;

  RMSNorm attn_norm_;
  ProjectionPtr qkv_, output_;
  AttentionSpec spec_;
  RMSNorm ffn_norm_;
  ProjectionPtr up_, down_;  // null without a dense FFN
  Activation activation_;
  BlockExtras extras_;
};

}  // namespace powerinfer
