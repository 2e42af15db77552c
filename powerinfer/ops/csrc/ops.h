// The operators Python calls (bindings.cpp), as the files that define them export them.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "common.h"

namespace powerinfer {

// neuron_kernels.cpp
torch::Tensor gather_matvec(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor x, torch::Tensor idx);
torch::Tensor accumulate_rows(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor a, torch::Tensor idx);
torch::Tensor sparse_ffn(torch::Tensor rec, std::vector<int64_t> gate_section, std::vector<int64_t> up_section,
                         std::vector<int64_t> down_section, Activation activation, torch::Tensor x, torch::Tensor idx);

// bus_error.cpp: on SIGBUS (a mapped file truncated under us), write `message` to stderr and exit
// with `status`, from then on.
void exit_on_bus_error(const std::string& message, int64_t status);

// attention.cpp

// What an architecture's attention adds to plain attention (powerinfer.models.layers.Attention and
// its AttentionOptions are the reference).
struct AttentionSpec {
  int64_t n_head = 0, n_kv = 0;
  int64_t rope_dim = 0;  // the leading values of each head that RoPE rotates (even, at most head_dim)
  bool neox = false;     // RoPE pairs values i and i + rope_dim / 2 (GGML's NeoX mode), else 2i and 2i + 1
  int64_t window = 0;    // a query sees keys fewer than `window` positions back (0: all)
  float scale = 0.0f;    // scores are q . k * scale (0: 1 / sqrt(head_dim))
  float softcap = 0.0f;  // scores -> softcap * tanh(scores / softcap) (0: none)
};

torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                               torch::Tensor rotations, const AttentionSpec& spec);

}  // namespace powerinfer
